"""From a parsed chat request to engine jobs, and from engine tokens back to OpenAI choices.

Owns: templating the prompt, token budgets, per-choice text assembly (streaming detokenization,
stop strings, `<tool_call>` blocks turned into `tool_calls`, logprobs) and the exact token record
of each choice. Does not own HTTP (server.py) or the model (engine.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from rlproxy import protocol
from rlproxy.engine import Engine, Job, SamplingParams, Step
from rlproxy.protocol import APIError, ChatRequest


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
        ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    except Exception as e:  # jinja raises on conversations the template refuses
        raise APIError(400, f"the chat template rejected these messages: {e}", param="messages")
    return Prompt(ids=list(ids), messages=messages, tools=tools)


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
            f"resulted in {prompt_len} tokens. Please reduce the length of the messages.",
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
    tool-call or a think marker, cuts at the first stop string, turns `<tool_call>{json}
    </tool_call>` blocks into OpenAI tool calls (only when the request offered tools), and
    splits off reasoning: text inside a think block that opens the completion (or that the
    prompt opened) up to its end marker. Tool calls are not parsed inside reasoning."""

    def __init__(self, tokenizer, stop: list[str] | None, parse_tools: bool,
                 reasoning: tuple[str, str] | None = None, in_reasoning: bool = False):
        self.tokenizer = tokenizer
        self.detokenizer = tokenizer.detokenizer
        self.stop = [s for s in (stop or []) if s]
        self.tool_start = tokenizer.tool_call_start if parse_tools else None
        self.tool_end = tokenizer.tool_call_end if parse_tools else None
        self.pending = ""  # decoded but not yet emitted
        self.in_tool = False
        self.stopped = False  # a stop string matched: the choice ends here
        self.stop_sequence: str | None = None  # which one (Anthropic's stop_sequence reports it)
        self.text = ""  # all content emitted
        self.tool_calls: list[dict] = []
        self.think_start, self.think_end = reasoning or (None, None)
        self.in_think = reasoning is not None and in_reasoning
        self.at_start = reasoning is not None and not in_reasoning  # a think block may open
        self.after_think = False  # the blank lines between the end marker and the answer go
        self.reasoning = ""  # all reasoning emitted
        self._markers = self.stop + ([self.tool_start] if self.tool_start else [])

    def add(self, token_id: int) -> list[tuple[str, object]]:
        """Feed one sampled token; return deltas: ("content", str), ("reasoning", str) or
        ("tool_call", dict)."""
        if token_id in self.tokenizer.eos_token_ids:
            return []
        self.detokenizer.add_token(token_id)
        self.pending += self.detokenizer.last_segment
        return self._drain(final=False)

    def finish(self) -> list[tuple[str, object]]:
        """The choice ended (end token or length): flush everything held back."""
        if self.stopped:
            return []
        self.detokenizer.finalize()
        self.pending += self.detokenizer.last_segment
        out = self._drain(final=True)
        if self.in_tool:  # an unterminated call: give the text back as it was written
            out += self._content(self.tool_start + self.pending)
            self.pending, self.in_tool = "", False
        elif self.pending:
            out += self._content(self.pending)
            self.pending = ""
        return out

    def _content(self, text: str) -> list[tuple[str, object]]:
        if self.after_think:
            text = text.lstrip()
            self.after_think = not text
        if not text:
            return []
        self.text += text
        return [("content", text)]

    def _reasoning(self, text: str) -> list[tuple[str, object]]:
        if not text:
            return []
        self.reasoning += text
        return [("reasoning", text)]

    def _drain_reasoning(self, final: bool) -> tuple[list[tuple[str, object]], bool]:
        """Handle the think block's start and inside; (deltas, whether to go on draining)."""
        if self.at_start:
            head = self.pending.lstrip()
            if head.startswith(self.think_start):
                self.pending, self.at_start, self.in_think = \
                    head[len(self.think_start):], False, True
                return [], True
            if not final and self.think_start.startswith(head):  # the marker may be coming
                return [], False
            self.at_start = False
            return [], True
        markers = [self.think_end] + self.stop
        hits = [(i, m) for i, m in ((self.pending.find(m), m) for m in markers) if i >= 0]
        if hits:
            i, marker = min(hits, key=lambda h: h[0])
            out = self._reasoning(self.pending[:i])
            self.pending = self.pending[i + len(marker):]
            if marker == self.think_end:
                self.in_think, self.after_think = False, True
            else:
                self.stopped, self.stop_sequence, self.pending = True, marker, ""
            return out, True
        keep = 0 if final else _partial_marker_len(self.pending, markers)
        out = self._reasoning(self.pending[: len(self.pending) - keep])
        self.pending = self.pending[len(self.pending) - keep:]
        return out, False

    def _drain(self, final: bool) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        while self.pending and not self.stopped:
            if self.at_start or self.in_think:
                deltas, go_on = self._drain_reasoning(final)
                out += deltas
                if not go_on:
                    return out
                continue
            if self.in_tool:
                end = self.pending.find(self.tool_end)
                if end < 0:
                    return out
                block, self.pending = self.pending[:end], self.pending[end + len(self.tool_end):]
                self.in_tool = False
                call = self._parse_tool_call(block)
                if call is None:
                    out += self._content(self.tool_start + block + self.tool_end)
                else:
                    self.tool_calls.append(call)
                    out.append(("tool_call", call))
                continue
            hits = [(self.pending.find(m), m) for m in self._markers]
            hits = [(i, m) for i, m in hits if i >= 0]
            if hits:
                i, marker = min(hits, key=lambda h: h[0])
                out += self._content(self.pending[:i])
                self.pending = self.pending[i + len(marker):]
                if marker == self.tool_start and marker not in self.stop:
                    self.in_tool = True
                else:
                    self.stopped, self.stop_sequence, self.pending = True, marker, ""
                continue
            keep = 0 if final else _partial_marker_len(self.pending, self._markers)
            out += self._content(self.pending[: len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep:]
            return out
        return out

    def _parse_tool_call(self, block: str) -> dict | None:
        try:
            parsed = self.tokenizer.tool_parser(block, None)
            name, arguments = parsed["name"], parsed.get("arguments", {})
        except Exception:
            return None
        if not isinstance(name, str):
            return None
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        return {"id": protocol.tool_call_id(), "type": "function",
                "function": {"name": name, "arguments": arguments}}


def _partial_marker_len(text: str, markers: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some marker."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


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


def _byte_level_alphabet() -> dict[str, int]:
    # GPT-2's reversible byte <-> printable-character mapping, inverted.
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_LEVEL = _byte_level_alphabet()
_TOKEN_BYTES: dict[int, dict[int, bytes]] = {}
_ADDED: dict[int, set] = {}


def _added(tokenizer) -> set:
    if id(tokenizer) not in _ADDED:
        _ADDED[id(tokenizer)] = set(tokenizer.get_added_vocab())
    return _ADDED[id(tokenizer)]


class EngineFailure(Exception):
    pass


@dataclass
class ChoiceEvent:
    index: int
    deltas: list[tuple[str, object]]
    logprobs: list[dict]  # OpenAI logprob entries for the tokens in this event
    finish_reason: str | None


class Generation:
    """One request's n choices running on the engine; iterate `events()` to consume them."""

    def __init__(self, engine: Engine, tokenizer, prompt: Prompt, params: list[SamplingParams],
                 req: ChatRequest, reasoning: bool = True):
        self.engine, self.tokenizer, self.prompt, self.req = engine, tokenizer, prompt, req
        self.queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        parse_tools = prompt.tools is not None
        markers = reasoning_markers(tokenizer) if reasoning else None
        opened = markers is not None and prompt_opens_reasoning(tokenizer, prompt.ids, markers)
        self.texts = [ChoiceText(tokenizer, req.stop, parse_tools, markers, opened)
                      for _ in params]
        self.jobs = []
        for i, p in enumerate(params):
            deliver = (lambda i: lambda step: loop.call_soon_threadsafe(
                self.queue.put_nowait, (i, step)))(i)
            self.jobs.append(engine.submit(Job(prompt.ids, p, deliver)))
        self.records = [ChoiceRecord(index=i, seed=j.params.seed) for i, j in enumerate(self.jobs)]
        self.started = time.time()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None

    def cancel(self) -> None:
        for job, rec in zip(self.jobs, self.records):
            if rec.finish_reason is None:
                self.engine.cancel(job)

    async def events(self):
        remaining = len(self.jobs)
        while remaining:
            i, step = await self.queue.get()
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
