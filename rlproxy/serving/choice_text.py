"""One choice's text as it streams, from token ids: detokenization to exact bytes, stop strings,
`<tool_call>` blocks turned into tool calls, and reasoning split off (`ChoiceText`).

Library parts: markers and stop strings are matched by mlx-lm's `TextStateMachine` (with
transitions of our own; ChoiceText says why), tool calls are read by the model's mlx-lm tool
parser given the request's tools (or the fallback format's parser, for templates without tool
support: serving/chat_template.py), and token bytes come from transformers' `bytes_to_unicode`.

Does not own the request, the token budget or delivery from the engine (serving/completions.py).
"""

from __future__ import annotations

import functools
import json

from mlx_lm.generate import TextStateMachine
from transformers.convert_slow_tokenizer import bytes_to_unicode

from rlproxy import protocol
from rlproxy.serving.chat_template import ToolFormat, tool_format


def reasoning_markers(tokenizer) -> tuple[str, str]:
    """The model's think markers: mlx-lm's where its tokenizer metadata knows them (Qwen3,
    DeepSeek-R1, gpt-oss-style channels, ...), else the literal `<think>` / `</think>`."""
    if tokenizer.has_thinking:
        return tokenizer.think_start, tokenizer.think_end
    return "<think>", "</think>"


def model_thinks(tokenizer, markers: tuple[str, str]) -> bool:
    """Can this model open a think block after leading whitespace? Only one whose vocabulary
    has the markers (mlx-lm's `has_thinking`) or whose chat template writes the start marker.
    For any other model, leading whitespace streams at once (a think block must then open the
    completion's very first characters): holding it back made a reply that starts with blank
    lines show no content until its first non-blank token."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates (transformers' {"default": ..., ...})
        template = " ".join(t for t in template.values() if isinstance(t, str))
    elif isinstance(template, list):  # the same as [{"name": ..., "template": ...}]
        template = " ".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return bool(tokenizer.has_thinking) or (isinstance(template, str) and markers[0] in template)


def prompt_opens_reasoning(tokenizer, prompt_ids: list[int], markers: tuple[str, str]) -> bool:
    """Does the generation prompt end with the think start marker (templates that open the
    think block for the model, e.g. Qwen3's and DeepSeek-R1's)? Only the very end counts: a
    `<think>` quoted in a message, or an empty think block (thinking off), does not."""
    return tokenizer.decode(prompt_ids[-8:]).rstrip().endswith(markers[0])


class ChoiceText:
    """One choice's text as it streams: holds back what may be the start of a stop string, a
    tool-call or a think marker, cuts at the first stop string, turns `<tool_call>...
    </tool_call>` blocks into OpenAI tool calls (only when the request offered tools; the
    model's tool parser gets the request's tools, so arguments are typed from their schema;
    the markers and parser are chat_template.tool_format's: the model's own, or the fallback's),
    and splits off reasoning: text inside a think block that opens the completion (or that the
    prompt opened) up to its end marker. Tool calls are not parsed inside reasoning.

    The matching is mlx-lm's TextStateMachine, with transitions of our own rather than
    `make_text_state_machine`'s: there a stop word is stripped and generation goes on (mlx-lm
    stops on the word's token ids), while an OpenAI stop string ends the choice wherever it
    falls, inside a token too; and there `<think>` opens reasoning anywhere and tool calls are
    parsed inside it."""

    def __init__(self, tokenizer, stop: list[str] | None, parse_tools: bool,
                 reasoning: tuple[str, str] | None = None, in_reasoning: bool = False,
                 tools: list[dict] | None = None, thinks: bool = True):
        self.tokenizer, self.tools = tokenizer, tools
        self._hold_blank = thinks  # leading whitespace may precede the think marker
        self.detokenizer = tokenizer.detokenizer
        self.stop = [s for s in (stop or []) if s]
        self.format: ToolFormat | None = tool_format(tokenizer) if parse_tools else None
        self.tool_start = self.format.start if self.format else None
        self.tool_end = self.format.end if self.format else None
        self.stopped = False  # a stop string matched: the choice ends here
        self.stop_sequence: str | None = None  # which one (Anthropic's stop_sequence reports it)
        self.text = ""  # all content emitted
        self.tool_calls: list[dict] = []
        self.reasoning = ""  # all reasoning emitted
        self.think_start = reasoning[0] if reasoning else None
        self._machine = _machine(tokenizer, tuple(self.stop), self.tool_start, self.tool_end,
                                 reasoning)
        self._head = ""  # the completion's start, until it shows whether a think block opens
        self._state = None if reasoning and not in_reasoning else \
            self._machine.make_state("reasoning" if in_reasoning else "normal")
        self._last = self._state[0] if self._state else "normal"  # last segment's state
        self._tool = ""  # the tool call being read
        self._after_think = False  # the blank lines between the end marker and the answer go

    def add(self, token_id: int) -> list[tuple[str, object]]:
        """Feed one sampled token; return deltas: ("content", str), ("reasoning", str) or
        ("tool_call", dict)."""
        if token_id in self.tokenizer.eos_token_ids or self.stopped:
            return []
        self.detokenizer.add_token(token_id)
        return self._feed(self.detokenizer.last_segment, final=False)

    def finish(self) -> list[tuple[str, object]]:
        """The choice ended (end token or length): flush everything held back."""
        if self.stopped:
            return []
        self.detokenizer.finalize()
        out = self._feed(self.detokenizer.last_segment, final=True)
        if self.stopped:
            return out
        self._state, rest, state = TextStateMachine.flush(self._state)
        if state == "tool" and not self.tool_end:  # a format whose calls run to the end
            out += self._tool_call(self._tool + rest)
        elif state == "tool":  # an unterminated call: give the text back as it was written
            out += self._content(self.tool_start + self._tool + rest)
            self._tool = ""
        elif state == "reasoning":
            out += self._reasoning(rest)
        else:
            out += self._content(rest)
        return out

    def _feed(self, text: str, final: bool) -> list[tuple[str, object]]:
        if self._state is None:  # a think block may open the completion, after whitespace
            self._head += text
            lead = self._head.lstrip() if self._hold_blank else self._head
            if lead.startswith(self.think_start):
                text = lead[len(self.think_start):]
                self._state, self._last = self._machine.make_state("reasoning"), "reasoning"
            elif not final and self.think_start.startswith(lead):  # the marker may be coming
                return []
            else:
                self._state, text = self._machine.make_state("normal"), self._head
        self._state, segments = TextStateMachine.split(self._state, text)
        out: list[tuple[str, object]] = []
        for state, piece in segments:
            if self._last == "tool" and state != "tool":  # the block ended
                out += self._tool_call(self._tool)
                self._tool = ""
            elif self._last == "reasoning" and state == "normal":
                self._after_think = True
            self._last = state
            if state.startswith("stop:"):
                self.stopped, self.stop_sequence = True, self.stop[int(state[5:])]
                break
            if state == "tool":
                self._tool += piece
            elif state == "reasoning":
                out += self._reasoning(piece)
            else:
                out += self._content(piece)
        return out

    def _content(self, text: str) -> list[tuple[str, object]]:
        if self._after_think:
            text = text.lstrip()
            self._after_think = not text
        if not text:
            return []
        self.text += text
        return [("content", text)]

    def _reasoning(self, text: str) -> list[tuple[str, object]]:
        if not text:
            return []
        self.reasoning += text
        return [("reasoning", text)]

    def _tool_call(self, block: str) -> list[tuple[str, object]]:
        try:
            parsed = self.format.parser(block, self.tools)
            calls = [(p["name"], p.get("arguments", {}))
                     for p in (parsed if isinstance(parsed, list) else [parsed])]
        except Exception:  # not a call after all: the text stays, markers and all
            calls = None
        if not calls or not all(isinstance(name, str) for name, _ in calls):
            return self._content(self.tool_start + block + (self.tool_end or ""))
        out = []
        for name, arguments in calls:
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            call = {"id": protocol.tool_call_id(), "type": "function",
                    "function": {"name": name, "arguments": arguments}}
            self.tool_calls.append(call)
            out.append(("tool_call", call))
        return out


@functools.lru_cache(maxsize=256)
def _machine(tokenizer, stop: tuple[str, ...], tool_start: str | None, tool_end: str | None,
             reasoning: tuple[str, str] | None) -> TextStateMachine:
    """States normal, reasoning and tool; a stop string leads to a state of its own (stop:i)
    from normal and reasoning, and ends the choice. Structural markers (mlx-lm's, for models
    that wrap the answer in them) are stripped from the content."""
    stops = [(s, f"stop:{i}") for i, s in enumerate(stop)]
    normal = [(m, "normal") for m in tokenizer.structural_markers]
    transitions = {"normal": normal, "tool": [], **{f"stop:{i}": [] for i in range(len(stop))}}
    if tool_start:
        normal.append((tool_start, "tool"))
        transitions["tool"] = [(tool_end, "normal")] if tool_end else []
    if reasoning:
        transitions["reasoning"] = [(reasoning[1], "normal")] + stops
    normal += stops  # after tool_start: a stop string that is also the marker stops
    return TextStateMachine(transitions)


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The exact bytes one token stands for (a token may hold part of a UTF-8 character)."""
    cache = _TOKEN_BYTES.setdefault(id(tokenizer), {})
    if token_id not in cache:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if token_id in tokenizer.all_special_ids or piece in _added(tokenizer):
            cache[token_id] = piece.encode()
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            cache[token_id] = bytes([int(piece[3:5], 16)])  # SentencePiece byte fallback
        elif all(c in BYTE_LEVEL for c in piece):  # byte-level BPE (GPT-2, Qwen, Llama 3)
            cache[token_id] = bytes(BYTE_LEVEL[c] for c in piece)
        else:
            cache[token_id] = piece.replace("\u2581", " ").encode()  # SentencePiece piece
    return cache[token_id]


BYTE_LEVEL = {c: b for b, c in bytes_to_unicode().items()}  # GPT-2's byte alphabet, inverted
_TOKEN_BYTES: dict[int, dict[int, bytes]] = {}
_ADDED: dict[int, set] = {}


def _added(tokenizer) -> set:
    if id(tokenizer) not in _ADDED:
        _ADDED[id(tokenizer)] = set(tokenizer.get_added_vocab())
    return _ADDED[id(tokenizer)]
