"""The engine thread: owns the serving model and decodes every live request in one batch.

One long-lived thread runs mlx-lm's `BatchGenerator` (continuous batching: requests join and
leave between steps). The asyncio side talks to it only through `submit`, `cancel` and
`publish_adapter`, which put messages in an inbox; results cross back with
`loop.call_soon_threadsafe`. Nothing here knows HTTP, text, stop strings or sessions: the engine
takes token ids and gives token ids with their log-probs.

With a prefix cache (prefix_cache.py), each new job starts from the longest stored prefix of its
prompt under the adapter now served or, with `--kv-reuse-max-lag N`, one of the N before it, and
prefills only the rest (`Job.cached_tokens` says how much came from the cache, and
`Job.cached_version` from which adapter). A job's KV goes back to the store when it finishes or
is cancelled, filed under the oldest adapter that computed any of it: the restored prefix's, or
the one served when the job started (an adapter swap during its life only makes it newer). The
store refuses it once that adapter is more than N versions old.

What a stored log-prob is: log-softmax of the model's logits at temperature 1 (after logit_bias
and penalties when a request asks for them), *before* temperature, top_k and top_p. Sampling
then applies temperature first, top_k and top_p after, in OpenAI's order (mlx-lm's own sampler
filters top_p before temperature). Training recomputes the same temperature-1 quantity.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.sample_utils import apply_top_k, apply_top_p, make_logits_processors

from rlproxy import metrics
from rlproxy.kv_blobs import adapter_fingerprint, weights_fingerprint
from rlproxy.prefix_cache import PrefixCache

log = logging.getLogger("rlproxy.engine")


@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off (Anthropic's top_k; vLLM's extension to Chat Completions)
    seed: int | None = None  # None: a fresh random seed, reported back so the run can be redone
    top_logprobs: int = 0
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


@dataclass
class Token:
    id: int
    logprob: float
    adapter_version: int
    top: list[tuple[int, float]] | None = None


@dataclass
class Step:
    """What one request got from one engine step: a token, maybe the end, maybe an error."""

    token: Token | None = None
    finish_reason: str | None = None  # "stop" (end token) | "length" | "error"
    error: str | None = None


@dataclass
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    deliver: Callable[[Step], None]  # called on the engine thread; must be thread-safe
    uid: int | None = None
    done: bool = False
    submitted_at: float = field(default_factory=time.perf_counter)
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache, not prefilled
    cached_version: int | None = None  # the adapter version that computed those tokens' KV
    kv_source: tuple | None = None  # (version, namespace) of the oldest adapter in its KV
    adapter: str | None = None  # a named adapter (add_adapter) to sample from; None: the live one


def make_sampler(temperature: float, top_p: float, seed: int, top_k: int = 0):
    """A per-request sampler with its own PRNG key: the same seed gives the same tokens."""
    if temperature == 0:
        return lambda logprobs: mx.argmax(logprobs, axis=-1)
    key = mx.random.key(seed % 2**64)  # MLX keys take uint64; OpenAI seeds may be negative

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        scaled = logprobs * (1.0 / temperature)
        if 0 < top_k < scaled.shape[-1]:  # a k at or past the vocabulary keeps every token
            scaled = apply_top_k(scaled, top_k)
        if top_p < 1.0:
            scaled = apply_top_p(scaled - mx.logsumexp(scaled, axis=-1, keepdims=True), top_p)
        return mx.random.categorical(scaled, key=sub)

    return sample


class Engine:
    """The serving model's only user. Thread-safe entry points: submit, cancel, publish_adapter."""

    def __init__(self, model: nn.Module, eos_token_ids, *, max_batch: int = 16,
                 prefill_step_size: int = 2048, prefix_cache: PrefixCache | None = None):
        self.model = model
        self.prefix_cache = prefix_cache
        self.eos_token_ids = sorted(eos_token_ids)
        self.max_batch = max_batch
        self.prefill_step_size = prefill_step_size
        self.adapter_version = 0
        self.error: str | None = None  # set if the thread died; /healthz reports it
        self.stats = {"requests": 0, "active": 0, "tokens": 0, "steps": 0, "swaps": 0,
                      "last_swap_ms": 0.0}
        self._inbox: deque = deque()
        self._wake = threading.Event()
        self._running = False
        self._thread: threading.Thread | None = None

    # ---- entry points (any thread) ----

    def start(self) -> None:
        self._running = True
        self._thread = threading.Thread(target=self._run, name="rlproxy-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._running = False
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job: Job) -> Job:
        if job.params.seed is None:
            job.params.seed = secrets.randbits(63)
        self._inbox.append(("submit", job))
        self._wake.set()
        return job

    def busy(self) -> bool:
        """Requests waiting to start or decoding (thread-safe): the trainer yields meanwhile."""
        return bool(self._inbox) or self.stats["active"] > 0

    def cancel(self, job: Job) -> None:
        self._inbox.append(("cancel", job))
        self._wake.set()

    def publish_adapter(self, weights: dict[str, mx.array], version: int) -> None:
        """Hand over an *evaluated* adapter; it is applied between two decode steps."""
        # The prefix cache's key for this adapter is hashed here, on the publisher's thread,
        # not on the engine thread between two decode steps.
        fingerprint = weights_fingerprint(weights) if self.prefix_cache is not None else None
        self._inbox.append(("adapter", (weights, version, fingerprint)))
        self._wake.set()

    def add_adapter(self, name: str, model: nn.Module) -> None:
        """Serve MODEL (the serving model's base arrays with LoRA weights of its own, already
        evaluated) to jobs whose `adapter` is NAME; every other job keeps the live adapter."""
        self._inbox.append(("add_adapter", (name, model)))
        self._wake.set()

    def drop_adapter(self, name: str) -> None:
        self._inbox.append(("drop_adapter", (name, None)))
        self._wake.set()

    # ---- the thread ----

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # surfaced on /healthz; the server keeps answering
            log.exception("engine thread died")
            self.error = f"{type(e).__name__}: {e}"
            self._fail_all(self.error)
        finally:
            # Free MLX objects on the thread that made them: destroying them at interpreter
            # exit from another thread aborts the process.
            self._fail_all("the engine stopped")
            if getattr(self, "_gen", None) is not None:
                self._gen.close()
                self._gen = None
            for gen, _ in getattr(self, "_named", {}).values():
                gen.close()
            gc.collect()  # drop per-request samplers (lazy PRNG keys) here, not at exit
            mx.synchronize()
            mx.clear_streams()  # each MLX thread must, or the process can abort at exit

    def _new_generator(self, model: nn.Module | None = None) -> BatchGenerator:
        # The stream is made on this thread: MLX streams are per thread.
        return BatchGenerator(
            model or self.model,
            stop_tokens=[[t] for t in self.eos_token_ids],
            completion_batch_size=self.max_batch,
            prefill_batch_size=min(8, self.max_batch),
            prefill_step_size=self.prefill_step_size,
            stream=mx.new_stream(mx.default_device()),
        )

    def _loop(self) -> None:
        self._gen = self._new_generator()
        if self.prefix_cache is not None:
            self.prefix_cache.set_adapter(self.adapter_version, adapter_fingerprint(self.model))
        self._jobs: dict[int, Job] = {}
        self._named: dict[str, tuple] = {}  # adapter name -> (its BatchGenerator, {uid: Job})
        # A token returned by a step was sampled from logits of the previous step's forward
        # pass (BatchGenerator pipelines one step ahead), so it carries that step's version.
        previous_version = self.adapter_version
        while self._running:
            self._drain_inbox()
            self._step_named()  # named adapters' requests: one step each, between live steps
            if not self._jobs:
                self.stats["active"] = 0
                if not any(jobs for _, jobs in self._named.values()):
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                previous_version = self.adapter_version
                continue
            try:
                _, responses = self._gen.next()
            except Exception as e:  # one bad batch fails its requests, not the server
                log.exception("decode step failed")
                self._fail_all(f"{type(e).__name__}: {e}")
                self._gen = self._new_generator()
                continue
            self.stats["steps"] += 1
            self.stats["active"] = len(self._jobs)
            if responses:
                self._deliver(responses, previous_version)
            previous_version = self.adapter_version

    def _drain_inbox(self) -> None:
        while self._inbox:
            kind, payload = self._inbox.popleft()
            if kind == "submit":
                self._insert(payload)
            elif kind == "cancel":
                job = payload
                if job.adapter is not None:
                    self._cancel_named(job)
                    continue
                if job.uid is not None and job.uid in self._jobs:
                    if self.prefix_cache is None:
                        self._gen.remove([job.uid])
                    else:
                        kept = self._gen.remove([job.uid], return_prompt_caches=True)
                        if job.uid in kept:
                            self._store(job, *kept[job.uid])
                    del self._jobs[job.uid]
                job.done = True
            elif kind == "adapter":
                weights, version, fingerprint = payload
                tic = time.perf_counter()
                self.model.update(_unflatten(weights))
                if self.prefix_cache is not None:
                    self.prefix_cache.set_adapter(version, fingerprint)
                self.adapter_version = version  # last: who sees it sees the cache switched too
                self.stats["swaps"] += 1
                self.stats["last_swap_ms"] = (time.perf_counter() - tic) * 1000
                metrics.observe_swap(self.stats["last_swap_ms"] / 1000, version)
            elif kind in ("add_adapter", "drop_adapter"):
                self._change_named(kind, payload)

    def _insert(self, job: Job) -> None:
        if job.done:  # cancelled before it started
            return
        if job.adapter is not None:
            return self._insert_named(job)
        p = job.params
        processors = make_logits_processors(
            logit_bias=p.logit_bias,
            presence_penalty=p.presence_penalty or None,
            frequency_penalty=p.frequency_penalty or None,
        )
        restored = {}
        if self.prefix_cache is not None:
            cache, job.cached_tokens, job.kv_source = self.prefix_cache.fetch(job.prompt_ids)
            if cache is not None:  # the prefix's tokens still count for penalties
                job.cached_version = job.kv_source[0]
                restored = {"caches": [cache], "all_tokens": [job.prompt_ids[:job.cached_tokens]]}
        try:
            (uid,) = self._gen.insert(
                [job.prompt_ids[job.cached_tokens:]],
                max_tokens=[p.max_tokens],
                samplers=[make_sampler(p.temperature, p.top_p, p.seed, p.top_k)],
                logits_processors=[processors],
                stop_sequences=[StopSequences([(t,) for t in self.eos_token_ids])],
                **restored,
            )
        except Exception as e:
            job.done = True
            job.deliver(Step(finish_reason="error", error=f"{type(e).__name__}: {e}"))
            return
        job.uid = uid
        self._jobs[uid] = job
        self.stats["requests"] += 1
        self.stats["active"] = len(self._jobs)  # before its prefill: the judge yields now

    def _deliver(self, responses, version: int) -> None:
        live = [r for r in responses if r.uid in self._jobs]
        if not live:
            return
        ids = mx.array([r.token for r in live])
        rows = mx.stack([r.logprobs.reshape(-1) for r in live])
        chosen = mx.take_along_axis(rows, ids[:, None], axis=1)[:, 0].tolist()
        want_top = max(self._jobs[r.uid].params.top_logprobs for r in live)
        if want_top:
            order = mx.argsort(-rows, axis=-1)[:, :want_top]
            top_ids = order.tolist()
            top_lps = mx.take_along_axis(rows, order, axis=1).tolist()
        for i, r in enumerate(live):
            job = self._jobs[r.uid]
            k = job.params.top_logprobs
            top = list(zip(top_ids[i][:k], top_lps[i][:k])) if k else None
            token = Token(id=r.token, logprob=chosen[i], adapter_version=version, top=top)
            self.stats["tokens"] += 1
            if r.finish_reason is not None:
                del self._jobs[r.uid]
                job.done = True
                if self.prefix_cache is not None:  # before the last token: a next turn finds it
                    self._store(job, r.prompt_cache, r.all_tokens)
            job.deliver(Step(token=token, finish_reason=r.finish_reason))

    def _store(self, job: Job, cache, tokens: list[int]) -> None:
        """Hand a job's KV (covering exactly `tokens`: prompt + every sampled token) to the
        prefix cache if it holds something new; the store files it under the job's oldest
        adapter, or refuses it when that one has left the reuse window."""
        if len(tokens) > job.cached_tokens:
            prompt_end = min(len(job.prompt_ids), len(tokens))
            self.prefix_cache.put(list(tokens), cache, [prompt_end, len(tokens)], job.kv_source)

    def _fail_all(self, message: str) -> None:
        for _, jobs in getattr(self, "_named", {}).values():
            for job in list(jobs.values()):
                job.done = True
                job.deliver(Step(finish_reason="error", error=message))
            jobs.clear()
        for job in list(getattr(self, "_jobs", {}).values()):
            job.done = True
            job.deliver(Step(finish_reason="error", error=message))
        if hasattr(self, "_jobs"):
            self._jobs.clear()


    # ---- named adapters: a BatchGenerator each, stepped in turn with the live one ----

    def _change_named(self, kind: str, payload) -> None:
        name, model = payload
        old = self._named.pop(name, None)
        if old is not None:
            for job in old[1].values():
                job.done = True
                job.deliver(Step(finish_reason="error", error=f"adapter {name!r} was replaced"))
            old[0].close()
        if kind == "add_adapter":
            self._named[name] = (self._new_generator(model), {})

    def _insert_named(self, job: Job) -> None:
        lane, p = self._named.get(job.adapter), job.params
        try:
            if lane is None:
                raise KeyError(f"no adapter named {job.adapter!r} is loaded")
            processors = make_logits_processors(
                logit_bias=p.logit_bias, presence_penalty=p.presence_penalty or None,
                frequency_penalty=p.frequency_penalty or None)
            (uid,) = lane[0].insert(
                [job.prompt_ids], max_tokens=[p.max_tokens],
                samplers=[make_sampler(p.temperature, p.top_p, p.seed, p.top_k)],
                logits_processors=[processors],
                stop_sequences=[StopSequences([(t,) for t in self.eos_token_ids])])
        except Exception as e:
            job.done = True
            job.deliver(Step(finish_reason="error", error=f"{type(e).__name__}: {e}"))
            return
        job.uid = uid
        lane[1][uid] = job
        self.stats["requests"] += 1

    def _step_named(self) -> None:
        for name, (gen, jobs) in list(self._named.items()):
            if not jobs:
                continue
            try:
                _, responses = gen.next()
            except Exception as e:  # this adapter's requests fail, nothing else
                log.exception("decode step for adapter %s failed", name)
                for job in jobs.values():
                    job.done = True
                    job.deliver(Step(finish_reason="error", error=f"{type(e).__name__}: {e}"))
                jobs.clear()
                self._change_named("add_adapter", (name, gen.model))  # a fresh generator
                continue
            for r in responses:
                job = jobs.get(r.uid)
                if job is None:
                    continue
                lp = r.logprobs.reshape(-1)[r.token].item()  # temperature 1, as the live lane
                self.stats["tokens"] += 1
                if r.finish_reason is not None:
                    del jobs[r.uid]
                    job.done = True
                job.deliver(Step(token=Token(id=r.token, logprob=lp, adapter_version=0),
                                 finish_reason=r.finish_reason))

    def _cancel_named(self, job: Job) -> None:
        lane = self._named.get(job.adapter)
        if lane is not None and job.uid in lane[1]:
            lane[0].remove([job.uid])
            del lane[1][job.uid]
        job.done = True


def _unflatten(weights: dict[str, mx.array]):
    from mlx.utils import tree_unflatten

    return tree_unflatten(list(weights.items()))


def asyncio_delivery(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> Callable[[Step], None]:
    """A `deliver` callback that moves engine steps onto an asyncio queue, thread-safely."""
    return lambda step: loop.call_soon_threadsafe(queue.put_nowait, step)
