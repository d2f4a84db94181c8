"""From a parsed chat request to engine jobs, and from engine tokens back to OpenAI choices.

Owns: a request's prompt (serving/chat_template.py renders it), token budgets, per-choice text assembly
(streaming detokenization, stop strings, `<tool_call>` blocks turned into `tool_calls`,
logprobs), the exact token record of each choice, and delivery from the engine thread with a
bounded backlog (`Generation`, MAX_BACKLOG: a reader that falls behind is stopped, not
buffered). Does not own HTTP (api/) or the model (serving/engine.py).

The text of a choice as it streams (stop strings, tool calls, reasoning, token bytes) is
serving/choice_text.py's.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field

from rlproxy import protocol
from rlproxy.protocol import APIError, ChatRequest
from rlproxy.serving.chat_template import render_prompt
from rlproxy.serving.choice_text import ChoiceText, model_thinks, prompt_opens_reasoning, \
    reasoning_markers, token_bytes
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
                    vocab_size: int, strict_max_tokens: bool = False,
                    max_completion: int | None = None):
    """One engine job's parameters per choice. A `max_tokens` beyond what the context has left
    is clamped to what is left (the choice then ends with `length`; compare the job's
    max_tokens with req.max_tokens to see the clamp), or a 400 when `strict_max_tokens`:
    agents ask for budgets of models they do not know, and a 400 sent OpenCode into a loop of
    compactions. A prompt that alone fills the context is a 400 either way. MAX_COMPLETION
    (--max-completion-tokens) caps every budget, silently like the context: an operator's
    limit, not the client's mistake (Hermes Agent always asks for 65,536)."""
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
            max_tokens=min(req.max_tokens or default_max, room, max_completion or room),
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


class EngineFailure(Exception):
    """A generation that failed; `status`: 503 a sampler elsewhere was down, 400 it refused
    the request's parameters, 500 anything else."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


class Interrupted(Exception):
    """A generation ended from outside before its end: `reason` is "client_stalled" (its
    reader stayed MAX_BACKLOG steps behind for BACKLOG_GRACE_S) or "shutdown" (the server is
    stopping)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# Steps one choice may have decoded and not yet handed to its writer. A stream whose client
# stops reading fills its socket's send buffers (~150 chunks with streams.SSE_SEND_BUFFER), then
# its writer blocks and steps pile up here; past this many the engine stops decoding it, so a
# stalled reader holds neither a batch slot nor memory (~0.5 KB a step) while it waits out
# --stall-timeout-s. Streams that are read peaked at 2 queued steps (bench/stalled_clients.py,
# 4 normal streams beside 16 stalled ones on 2 loaded cores); 128 still covers an event-loop
# pause of 0.4 s at the tiny model's fastest single-sequence rate (~300 steps/s).
MAX_BACKLOG = 128
# ... for longer than this: a reader that pauses (a GC, a busy terminal) once its buffers are
# full catches up instead of losing its stream. A hard cap bounds the memory meanwhile.
BACKLOG_GRACE_S = 2.0
HARD_BACKLOG = 16 * MAX_BACKLOG
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
                 req: ChatRequest, reasoning: bool = True, max_backlog: int = MAX_BACKLOG,
                 adapter: tuple[str, object] | None = None):
        self.engine, self.tokenizer, self.prompt, self.req = engine, tokenizer, prompt, req
        self.queue: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        parse_tools = prompt.tools is not None
        markers = reasoning_markers(tokenizer) if reasoning else None
        opened = markers is not None and prompt_opens_reasoning(tokenizer, prompt.ids, markers)
        thinks = markers is not None and model_thinks(tokenizer, markers)
        self.texts = [ChoiceText(tokenizer, req.stop, parse_tools, markers, opened, prompt.tools,
                                 thinks) for _ in params]
        # Each counter has one writer: produced/cut the engine thread, consumed the loop.
        self.max_backlog = max_backlog
        self._produced, self._consumed = [0] * len(params), [0] * len(params)
        self._cut = [False] * len(params)
        self._behind_since: list[float | None] = [None] * len(params)  # the engine thread's
        # every job exists before the first is submitted: _deliver finds its own by index
        # ADAPTER: (name, model object) of an adapter served by name (serving/saved.py)
        name, model = adapter or (None, None)
        self.jobs = [Job(prompt.ids, p, functools.partial(self._deliver, i), adapter=name,
                         adapter_model=model) for i, p in enumerate(params)]
        for job in self.jobs:
            engine.submit(job)
        self.records = [ChoiceRecord(index=i, seed=j.params.seed) for i, j in enumerate(self.jobs)]
        self.started = time.time()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None

    def _deliver(self, i: int, step) -> None:
        """On the engine thread: queue one step, or stop a choice whose reader fell behind."""
        if self._cut[i]:
            return  # decoded before the cancel reached the engine
        self._produced[i] += 1
        self._loop.call_soon_threadsafe(self.queue.put_nowait, (i, step))
        backlog = self._produced[i] - self._consumed[i]
        if step.finish_reason is not None or backlog <= self.max_backlog:
            self._behind_since[i] = None
            return
        now = time.monotonic()
        since = self._behind_since[i] = self._behind_since[i] or now
        if now - since >= BACKLOG_GRACE_S or backlog > HARD_BACKLOG:
            self._cut[i] = True
            self.engine.cancel(self.jobs[i])
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
                raise EngineFailure(step.error, step.status)
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
