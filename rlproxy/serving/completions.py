"""From a parsed chat request to engine jobs, and from engine tokens back to OpenAI choices.

Owns: a request's prompt (serving/chat_template.py renders it), token budgets, per-choice text assembly
(streaming detokenization, stop strings, `<tool_call>` blocks turned into `tool_calls`,
logprobs), the exact token record of each choice, and delivery from the engine thread with a
bounded backlog (`Generation`, MAX_BACKLOG: a reader that falls behind is stopped, not
buffered). Does not own HTTP (app.py) or the model (serving/engine.py).

Library parts: markers and stop strings are matched by mlx-lm's `TextStateMachine` (with
transitions of our own; ChoiceText says why), tool calls are read by the model's mlx-lm tool
parser given the request's tools (or the fallback format's parser, for templates without tool
support: serving/chat_template.py), and token bytes come from transformers' `bytes_to_unicode`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from dataclasses import dataclass, field

from mlx_lm.generate import TextStateMachine
from transformers.convert_slow_tokenizer import bytes_to_unicode

from rlproxy import protocol
from rlproxy.protocol import APIError, ChatRequest
from rlproxy.serving.chat_template import ToolFormat, render_prompt, tool_format
from rlproxy.serving.engine import Engine, Job, SamplingParams


@dataclass
class Prompt:
    ids: list[int]
    messages: list[dict]
    tools: list[dict] | None


def build_prompt(tokenizer, req: ChatRequest) -> Prompt:
    """Template the conversation exactly once; these ids are what is sampled and trained on."""
    messages = protocol.template_messages(req)
    tools = protocol.template_tools(req)
    try:
        ids = render_prompt(tokenizer, messages, tools)
    except Exception as e:  # jinja raises on conversations the template refuses
        raise APIError(400, f"the chat template rejected these messages: {e}", param="messages")
    return Prompt(ids=ids, messages=messages, tools=tools)


def sampling_params(req: ChatRequest, prompt_len: int, context: int, default_max: int,
                    vocab_size: int, strict_max_tokens: bool = False):
    """One engine job's parameters per choice. A `max_tokens` beyond what the context has left
    is clamped to what is left (the choice then ends with `length`; compare the job's
    max_tokens with req.max_tokens to see the clamp), or a 400 when `strict_max_tokens`:
    agents ask for budgets of models they do not know, and a 400 sent OpenCode into a loop of
    compactions. A prompt that alone fills the context is a 400 either way."""
    room = context - prompt_len
    if room <= 0:
        raise APIError(
            400,
            f"This model's maximum context length is {context} tokens. However, your messages "
            f"resulted in {prompt_len} tokens. Please reduce the length of the messages "
            "(or serve a longer window: rlproxy --context-length, RoPE scaling).",
            param="messages", code="context_length_exceeded",
        )
    if strict_max_tokens and req.max_tokens is not None and req.max_tokens > room:
        raise APIError(
            400,
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt_len + req.max_tokens} tokens ({prompt_len} in the messages, "
            f"{req.max_tokens} in the completion). Please reduce the length of the messages "
            "or completion.",
            param="max_tokens", code="context_length_exceeded",
        )
    bad = [t for t in (req.logit_bias or {}) if not 0 <= t < vocab_size]
    if bad:  # an out-of-range id would index past the logits inside the batched decode step
        raise APIError(400, f"logit_bias token ids must be in [0, {vocab_size}); got {bad[:5]}",
                       param="logit_bias")
    return [
        SamplingParams(
            max_tokens=min(req.max_tokens or default_max, room),
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k or 0,
            # n > 1 with a seed: choice i uses seed + i, so the choices differ but replay.
            # (mod 2**64: MLX keys are uint64, and the recorded seed is the one actually used)
            seed=None if req.seed is None else (req.seed + i) % 2**64,
            top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
            logit_bias=req.logit_bias,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
        )
        for i in range(req.n)
    ]


def reasoning_markers(tokenizer) -> tuple[str, str]:
    """The model's think markers: mlx-lm's where its tokenizer metadata knows them (Qwen3,
    DeepSeek-R1, gpt-oss-style channels, ...), else the literal `<think>` / `</think>`."""
    if tokenizer.has_thinking:
        return tokenizer.think_start, tokenizer.think_end
    return "<think>", "</think>"


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
                 tools: list[dict] | None = None):
        self.tokenizer, self.tools = tokenizer, tools
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
            lead = self._head.lstrip()
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


@dataclass
class ChoiceRecord:
    """Exactly what was sampled for one choice: what training and the records use."""

    index: int
    seed: int
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    adapter_versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    reasoning: str = ""  # the think text, apart from `text` (the ids above hold both)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    cached_kv_version: int | None = None  # the adapter version that computed that KV
    kv_lag: int = 0  # versions between that KV and the adapter of the first sampled token


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


class EngineFailure(Exception):
    pass


class Interrupted(Exception):
    """A generation ended from outside before its end: `reason` is "client_stalled" (its
    reader fell MAX_BACKLOG steps behind) or "shutdown" (the server is stopping)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# Steps one choice may have decoded and not yet handed to its writer. A stream whose client
# stops reading fills its socket's send buffers (~150 chunks with turns.SSE_SEND_BUFFER), then
# its writer blocks and steps pile up here; past this many the engine stops decoding it, so a
# stalled reader holds neither a batch slot nor memory (~0.5 KB a step) while it waits out
# --stall-timeout-s. Streams that are read peaked at 2 queued steps (bench/stalled_clients.py,
# 4 normal streams beside 16 stalled ones on 2 loaded cores); 128 still covers an event-loop
# pause of 0.4 s at the tiny model's fastest single-sequence rate (~300 steps/s).
MAX_BACKLOG = 128
_STALLED = object()  # queued after a choice's last step when its reader fell behind


@dataclass
class ChoiceEvent:
    index: int
    deltas: list[tuple[str, object]]
    logprobs: list[dict]  # OpenAI logprob entries for the tokens in this event
    finish_reason: str | None


class Generation:
    """One request's n choices running on the engine; iterate `events()` to consume them.

    The engine thread hands each step over with `_deliver`; the queue holds at most
    MAX_BACKLOG + 1 steps per choice (a choice further behind is cancelled there, without a
    round trip through the event loop, which may be the thing that is slow)."""

    def __init__(self, engine: Engine, tokenizer, prompt: Prompt, params: list[SamplingParams],
                 req: ChatRequest, reasoning: bool = True, max_backlog: int = MAX_BACKLOG):
        self.engine, self.tokenizer, self.prompt, self.req = engine, tokenizer, prompt, req
        self.queue: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        parse_tools = prompt.tools is not None
        markers = reasoning_markers(tokenizer) if reasoning else None
        opened = markers is not None and prompt_opens_reasoning(tokenizer, prompt.ids, markers)
        self.texts = [ChoiceText(tokenizer, req.stop, parse_tools, markers, opened, prompt.tools)
                      for _ in params]
        # Each counter has one writer: produced/cut the engine thread, consumed the loop.
        self.max_backlog = max_backlog
        self._produced, self._consumed = [0] * len(params), [0] * len(params)
        self._cut = [False] * len(params)
        self.jobs = []
        for i, p in enumerate(params):
            job = Job(prompt.ids, p, None)
            job.deliver = functools.partial(self._deliver, i, job)
            self.jobs.append(engine.submit(job))
        self.records = [ChoiceRecord(index=i, seed=j.params.seed) for i, j in enumerate(self.jobs)]
        self.started = time.time()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None

    def _deliver(self, i: int, job: Job, step) -> None:
        """On the engine thread: queue one step, or stop a choice whose reader fell behind."""
        if self._cut[i]:
            return  # decoded before the cancel reached the engine
        self._produced[i] += 1
        self._loop.call_soon_threadsafe(self.queue.put_nowait, (i, step))
        if step.finish_reason is None and self._produced[i] - self._consumed[i] > \
                self.max_backlog:
            self._cut[i] = True
            self.engine.cancel(job)
            self._loop.call_soon_threadsafe(self.queue.put_nowait, (i, _STALLED))

    @property
    def decoded(self) -> int:
        """Steps the engine decoded for this request, read by its writer or not."""
        return sum(self._produced)

    @property
    def stalled(self) -> bool:
        """A choice was stopped because its reader fell behind."""
        return any(self._cut)

    def interrupt(self, reason: str) -> None:
        """End `events()` now with Interrupted(reason) (on the event loop's thread)."""
        self.queue.put_nowait((None, reason))

    def cancel(self) -> None:
        for job, rec in zip(self.jobs, self.records):
            if rec.finish_reason is None:
                self.engine.cancel(job)

    async def events(self):
        remaining = len(self.jobs)
        while remaining:
            i, step = await self.queue.get()
            if i is None:  # interrupt()
                self.cancel()
                raise Interrupted(step)
            self._consumed[i] += 1
            if step is _STALLED:
                self.cancel()
                raise Interrupted("client_stalled")
            rec, text = self.records[i], self.texts[i]
            if rec.finish_reason is not None:
                continue  # tokens that were in flight after a stop string matched
            if step.error:
                self.cancel()
                raise EngineFailure(step.error)
            deltas: list = []
            entries: list = []
            if step.token is not None:
                if self.first_token_at is None:
                    self.first_token_at = time.time()
                t = step.token
                job = self.jobs[i]
                if not rec.completion_ids and job.cached_version is not None:
                    # set on the engine thread before it delivered this token
                    rec.cached_tokens, rec.cached_kv_version = job.cached_tokens, job.cached_version
                    rec.kv_lag = t.adapter_version - job.cached_version
                rec.completion_ids.append(t.id)
                rec.logprobs.append(t.logprob)
                rec.adapter_versions.append(t.adapter_version)
                deltas = text.add(t.id)
                if self.req.logprobs and t.id not in self.tokenizer.eos_token_ids:
                    entries.append(self._logprob_entry(t))
            finish = step.finish_reason
            if text.stopped:
                finish = "stop"
                self.engine.cancel(self.jobs[i])
            elif finish is not None:
                deltas += text.finish()
            if finish is not None:
                if text.tool_calls and finish == "stop":
                    finish = "tool_calls"
                rec.finish_reason, rec.text, rec.tool_calls = finish, text.text, text.tool_calls
                rec.reasoning = text.reasoning
                remaining -= 1
            yield ChoiceEvent(i, deltas, entries, finish)
        self.finished_at = time.time()

    def _logprob_entry(self, t) -> dict:
        top = [(token_bytes(self.tokenizer, tid), lp) for tid, lp in (t.top or [])]
        return protocol.token_logprob(token_bytes(self.tokenizer, t.id), t.logprob, top)

    def usage(self) -> dict:
        # A prompt token counts as cached only if every choice got it from the prefix cache.
        cached = min(job.cached_tokens for job in self.jobs)
        completion = sum(len(r.completion_ids) for r in self.records)
        return protocol.usage(len(self.prompt.ids), completion, cached)
