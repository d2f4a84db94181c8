"""The engine thread: owns the serving model and decodes every live request in one batch.

One long-lived thread runs mlx-lm's `BatchGenerator` (continuous batching: requests join and
leave between steps). The asyncio side talks to it only through `submit`, `cancel` and
`publish_adapter`, which put messages in an inbox; results cross back with
`loop.call_soon_threadsafe`. Nothing here knows HTTP, text, stop strings or sessions: the engine
takes token ids and gives token ids with their log-probs (the records are serving/jobs.py).
Sampling rules are serving/sampler.py; how a job's prompt KV gets ready (prefix-cache restore on
a loader thread, long prompts prefilled chunk by chunk between decode steps) is
serving/prefill.py; adapters served by name beside the live one (Tinker's sampler weights,
`MODEL@STEP`) decode in the same batch, each row with its own adapter (serving/named.py). Its
counters are `EngineStats`, read by /healthz, /metrics and the dashboard.

With a prefix cache (kv/prefix_cache.py), each new job starts from the longest stored prefix of its
prompt under the adapter now served or, with `--kv-reuse-max-lag N`, one of the N before it, and
prefills only the rest (`Job.cached_tokens` says how much came from the cache, and
`Job.cached_version` from which adapter). A job's KV goes back to the store when it finishes or
is cancelled, filed under the oldest adapter that computed any of it: the restored prefix's, or
the one served when the job started (an adapter swap during its life only makes it newer). The
store refuses it once that adapter is more than N versions old.

What a stored log-prob is: log-softmax of the model's logits at temperature 1 (after logit_bias
and penalties when a request asks for them), *before* temperature, top_k and top_p.

Two things make a lone stream cheaper: the live adapter is served merged (serving/merge.py: the
merge is made by `publish_adapter` on the publisher's thread, the trainer's, and the engine
thread only swaps references between two steps), and a job that starts while nothing else
decodes is decoded by prompt-lookup speculation (serving/speculate.py, `LoneStream`) until
another job wants the batch; it is then handed to the BatchGenerator with its KV, and decodes on
there. When the batch is down to one job, that job leaves it with its KV and speculates.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import trim_prompt_cache

from rlproxy.kv.blobs import adapter_fingerprint, weights_fingerprint
from rlproxy.kv.prefix_cache import PrefixCache
from rlproxy.mlx_threads import mlx_thread
from rlproxy.ops import metrics
from rlproxy.serving.jobs import Job  # noqa: F401  (the engine's interface)
from rlproxy.serving.jobs import SamplingParams  # noqa: F401  (the engine's interface)
from rlproxy.serving.jobs import Step  # noqa: F401  (the engine's interface)
from rlproxy.serving.jobs import Token  # noqa: F401  (the engine's interface)
from rlproxy.serving.logprobs import chosen_logprobs, top_logprobs
from rlproxy.serving.merge import merge_layers, merged_bytes, merged_weights, set_merged
from rlproxy.serving.model import adapter_slots, lora_weights, put_adapter
from rlproxy.serving.named import NamedAdapters, RowsModel
from rlproxy.serving.prefill import Loader, PrefillLane
from rlproxy.serving.sampler import make_processors, make_sampler
from rlproxy.serving.speculate import LoneStream, speculable, speculation

log = logging.getLogger("rlproxy.engine")
RETIRE_PER_STEP = 8  # replaced merged weights freed a step (~0.15 ms each on SmolLM2)


@dataclass
class EngineStats:
    """What /healthz shows under "engine"; the engine thread writes it, anyone reads it."""

    requests: int = 0  # jobs started, live and named adapters
    active: int = 0  # in the decode batch or the prefill lane
    tokens: int = 0  # tokens delivered
    steps: int = 0  # batched decode steps of the live adapter
    swaps: int = 0  # adapters applied
    last_swap_ms: float = 0.0
    prefill_chunks: int = 0  # chunks of a long prompt prefilled on their own
    prefill_groups: int = 0  # groups of waiting prompts prefilled in one batched pass
    last_prefill_chunk_ms: float = 0.0
    max_prefill_chunk_ms: float = 0.0  # the longest a prefill held decoding up
    merged: bool = False  # the live adapter is served merged (serving/merge.py)
    merged_bytes: int = 0  # what the merged weights hold beyond the base
    speculate: str = "off"  # what --speculate came to for this model: "ngram" or "off"
    spec_steps: int = 0  # forward passes of speculated lone streams (serving/speculate.py)
    spec_tokens: int = 0  # tokens they yielded
    spec_drafted: int = 0  # tokens drafted, and of those accepted
    spec_accepted: int = 0


class Engine:
    """The serving model's only user. Thread-safe entry points: submit, cancel, publish_adapter."""

    def __init__(self, model: nn.Module, eos_token_ids, *, max_batch: int = 16,
                 prefill_step_size: int = 2048, prefix_cache: PrefixCache | None = None,
                 merge: bool = True, speculate: str = "auto"):
        self.model = model
        self._merge_layers = merge_layers(model) if merge else {}
        self._adapter_slots = adapter_slots(model)  # a swap sets references there
        self._retired: deque = deque()  # merged weights a swap replaced, freed a few a step
        self.speculate = speculation(speculate, model)  # "ngram" or "off"
        self._lone: LoneStream | None = None
        self.prefix_cache = prefix_cache
        self.eos_token_ids = sorted(eos_token_ids)
        self.max_batch = max_batch
        self.prefill_step_size = prefill_step_size
        self.adapter_version = 0
        self.error: str | None = None  # set if the thread died; /healthz reports it
        self.stats = EngineStats(speculate=self.speculate)
        self._inbox: deque = deque()
        self._wake = threading.Event()
        self._running = False
        self._thread: threading.Thread | None = None
        self._loader: Loader | None = None
        self._gen: BatchGenerator | None = None
        self._jobs: dict[int, Job] = {}  # in the live BatchGenerator, by uid
        self._named = NamedAdapters(model)  # named adapters' rows in this one batch
        # named adapters with a prefix-cache lineage of their own (personal adapters: added
        # with a fingerprint); their jobs restore and store KV under it
        self._kv_names: set[str] = set()
        self._lane = PrefillLane(model, prefill_step_size, min(8, max_batch))
        self._group_pending = False  # a group was handed over; the next step prefills it

    # ---- entry points (any thread) ----

    def start(self) -> None:
        self._running = True
        if self._merge_layers:  # on the thread that loaded the model, like its arrays
            merged = merged_weights(self._merge_layers, lora_weights(self.model))
            set_merged(self._merge_layers, merged)
            self.stats.merged, self.stats.merged_bytes = True, merged_bytes(merged)
        if self.prefix_cache is not None:
            # Before the loader's first lookup; the model's arrays are evaluated (serving/model.py).
            self.prefix_cache.set_adapter(self.adapter_version, adapter_fingerprint(self.model))
            self._loader = Loader(self.prefix_cache, lambda job: self._post("submit", job))
        self._thread = threading.Thread(target=self._run, name="rlproxy-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._loader is not None:
            for job in self._loader.stop():
                self._post("submit", job)  # failed by the engine thread on its way out
        self._running = False
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def health(self) -> dict:
        """What /healthz shows under "engine"."""
        return asdict(self.stats)

    def submit(self, job: Job) -> Job:
        job.seeded = job.params.seed is not None
        if job.params.seed is None:
            job.params.seed = secrets.randbits(63)
        if self._loader is not None and (job.adapter is None or job.adapter in self._kv_names):
            self._loader.submit(job)  # its cached prefix is restored there, off this thread
        else:
            self._post("submit", job)
        return job

    def busy(self) -> bool:
        """Requests waiting to start or decoding (thread-safe): the trainer yields meanwhile."""
        loading = self._loader is not None and self._loader.busy()
        return bool(self._inbox) or loading or self.stats.active > 0

    def cancel(self, job: Job) -> None:
        self._post("cancel", job)

    def publish_adapter(self, weights: dict[str, mx.array], version: int) -> None:
        """Hand over an *evaluated* adapter; it is applied between two decode steps."""
        # The prefix cache's key for this adapter is hashed here, on the publisher's thread,
        # not on the engine thread between two decode steps.
        while self._retired:  # merged weights earlier swaps replaced, not freed yet: freed here
            try:                # (so at most one replaced adapter's worth is ever held)
                self._retired.pop()
            except IndexError:  # the engine thread freed the last one meanwhile
                break
        fingerprint = weights_fingerprint(weights) if self.prefix_cache is not None else None
        # merged here too, on the publisher's thread (serving/merge.py), so the engine thread
        # only swaps references, and the adapter is served merged from its first step
        merged = None
        if self._merge_layers:
            try:
                merged = merged_weights(self._merge_layers, weights)
            except Exception:  # served unmerged: slower, the same numbers
                log.exception("merging adapter version %d failed; serving it unmerged", version)
        self._post("adapter", (weights, version, fingerprint, merged, merged_bytes(merged)))

    def add_adapter(self, name: str, model: nn.Module, version: int = 0,
                    fingerprint: str | None = None) -> None:
        """Serve MODEL (the serving model's base arrays with LoRA weights of its own, already
        evaluated) to jobs whose `adapter` is NAME, their tokens marked adapter version VERSION
        (a personal adapter's; 0 for saved ones); every other job keeps the live adapter.
        FINGERPRINT (a personal adapter's: kv/blobs.py `weights_fingerprint`): its jobs restore
        and store prefix KV in a lineage of NAME's own, as the live adapter's do in its.
        Adding the same MODEL again changes nothing; another model under NAME takes the jobs
        admitted from now on, and those admitted before finish on the model they started with."""
        self._post("add_adapter", (name, model, version, fingerprint))

    def drop_adapter(self, name: str) -> None:
        """NAME serves no new job; the jobs admitted under it finish first (serving/named.py)."""
        self._post("drop_adapter", (name, None))

    def _post(self, kind: str, payload) -> None:
        self._inbox.append((kind, payload))
        self._wake.set()
        if self._thread is not None and not self._running:
            # stopped or died (the loader may still hand over jobs): nobody will take them, so
            # fail them here rather than leave their requests waiting forever
            while self._inbox:
                try:
                    kind, payload = self._inbox.popleft()
                except IndexError:  # the engine thread drained it meanwhile
                    break
                if kind == "submit" and not payload.done:
                    self._fail(payload, self.error or "the engine stopped")

    def _active(self) -> int:
        return len(self._jobs) + len(self._lane) + (self._lone is not None)

    # ---- the thread ----

    def _run(self) -> None:
        # mlx_thread: this thread's own stream, and its MLX objects freed here, not at exit.
        with mlx_thread() as stream:
            self._stream = stream
            try:
                self._loop()
            except BaseException as e:  # surfaced on /healthz; the server keeps answering
                log.exception("engine thread died")
                self.error = f"{type(e).__name__}: {e}"
            finally:
                self._fail_all(self.error or "the engine stopped")
                if self._gen is not None:
                    self._gen.close()
                self._gen = None

    def _new_generator(self) -> BatchGenerator:
        return BatchGenerator(
            RowsModel(self.model, self._named),  # each pass: which row runs which adapter
            stop_tokens=[[t] for t in self.eos_token_ids],
            completion_batch_size=self.max_batch,
            prefill_batch_size=min(8, self.max_batch),
            prefill_step_size=self.prefill_step_size,
            stream=self._stream,  # this thread's: MLX streams are per thread
        )

    def _loop(self) -> None:
        self._gen = self._new_generator()
        # A token returned by a step was sampled from logits of the previous step's forward
        # pass (BatchGenerator pipelines one step ahead), so it carries that step's version.
        previous_version = self.adapter_version
        while self._running:
            self._drain_inbox()
            self._release_retired()
            self.stats.active = self._active()
            if self._lone is not None:
                if not self._jobs and not self._lane:
                    self._lone_step()
                    previous_version = self.adapter_version
                    continue
                self._hand_over()  # another job wants to decode: the batch takes both
            if not self._jobs and not self._lane:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                previous_version = self.adapter_version
                continue
            if self._lane.due(bool(self._jobs), self.max_batch - len(self._jobs)):
                self._prefill()
            if not self._jobs:
                previous_version = self.adapter_version
                continue
            tic = time.perf_counter()
            try:
                _, responses = self._gen.next()
            except Exception as e:  # one bad batch fails its requests, not the server
                log.exception("decode step failed")
                self._fail_jobs(self._jobs, f"{type(e).__name__}: {e}")
                self._named.forget_rows()
                self._gen = self._new_generator()
                self._group_pending = False
                continue
            if self._group_pending:  # this step prefilled the group handed over
                self._group_pending = False
                self._lane.prefilled(time.perf_counter() - tic)
                self._count_prefill()
            else:
                self._lane.decoded(time.perf_counter() - tic)
            self.stats.steps += 1
            if responses:
                self._deliver(responses, previous_version)
            previous_version = self.adapter_version
            if len(self._jobs) == 1 and not self._lane and self.speculate == "ngram":
                self._take_back()  # the last one left decodes alone again

    def _release_retired(self) -> None:
        """Drop the merged weights that swaps replaced, RETIRE_PER_STEP a step, or all of them
        when nothing decodes: dropping all of SmolLM2's at once (210 buffers, 405 MiB) took
        30-90 ms on this thread, a pause in every stream; a few a step cost well under a
        millisecond. The next `publish_adapter` drops what is left, on its own thread."""
        busy = self._jobs or self._lane or self._lone is not None
        for _ in range(RETIRE_PER_STEP if busy else len(self._retired)):
            try:
                self._retired.pop()
            except IndexError:
                break

    def _drain_inbox(self) -> None:
        while self._inbox:
            kind, payload = self._inbox.popleft()
            if kind == "submit":
                self._insert(payload)
            elif kind == "cancel":
                self._cancel(payload)
            elif kind == "adapter":
                weights, version, fingerprint, merged, extra_bytes = payload
                tic = time.perf_counter()
                put_adapter(self.model, self._adapter_slots, weights)
                self._named.invalidate()  # the stacks of named rows hold the live arrays
                if self._merge_layers:
                    self._retired.extend(set_merged(self._merge_layers, merged))
                    self.stats.merged, self.stats.merged_bytes = merged is not None, extra_bytes
                if self.prefix_cache is not None:
                    self.prefix_cache.set_adapter(version, fingerprint)
                self.adapter_version = version  # last: who sees it sees the cache switched too
                self.stats.swaps += 1
                self.stats.last_swap_ms = (time.perf_counter() - tic) * 1000
                metrics.observe_swap(self.stats.last_swap_ms / 1000, version)
            elif kind == "add_adapter":
                name, model, version, fingerprint = payload
                self._named.change(kind, name, model, version)
                if fingerprint is not None and self.prefix_cache is not None:
                    self.prefix_cache.set_adapter(version, fingerprint, adapter=name)
                    self._kv_names.add(name)
            elif kind == "drop_adapter":
                self._named.change(kind, payload[0], None)
                self._kv_names.discard(payload[0])

    def _insert(self, job: Job) -> None:
        if job.done or not self._running:  # cancelled before it started, or shutting down
            if not job.done:
                self._fail(job, "the engine stopped")
            return
        restored, job.restored = job.restored, None
        if job.adapter is not None:  # a named adapter: its model now
            try:
                job.adapter_model = self._named.model_for(job)
            except KeyError as e:
                log.warning("a job for adapter %s was refused: %s", job.adapter, e)
                return self._fail(job, f"KeyError: {e}")
        if self._cached(job):  # the live adapter's, or a personal adapter's own lineage
            served = self.prefix_cache.served(job.adapter)
            if restored is None or job.kv_source not in self.prefix_cache.window(job.adapter):
                # a miss, or an adapter swap since the lookup outran the window: start afresh
                restored, job.cached_tokens, job.kv_source = None, 0, served
            else:  # the prefix's tokens count as prompt for the sampler's context
                job.cached_version = job.kv_source[0]
        else:  # KV kept nowhere (a saved adapter's), or a name dropped since its lookup
            restored, job.cached_tokens = None, 0
        self.stats.requests += 1
        self._lane.add(job, restored)  # prefilled when decoding has had its share
        self.stats.active = self._active()  # the judge yields now

    def _start(self, job: Job, cache: list | None, done: int, alone: bool = True) -> bool:
        """Hand the job to the BatchGenerator with KV for prompt_ids[:done] (or none), or decode
        it alone by speculation when nothing else wants to decode; True if the BatchGenerator
        took it, False if it runs alone or was refused (then failed)."""
        if (self.speculate == "ngram" and alone and self._lone is None and not self._jobs
                and not self._lane and speculable(job, job.seeded)):
            try:
                self._lone = LoneStream.start(self._model_of(job), job, cache, done)
            except Exception as e:  # this prompt fails, nothing else
                log.exception("prefill for a lone stream failed")
                self._fail(job, f"{type(e).__name__}: {e}")
                return False
            if self._lone is not None:
                return False
        p = job.params
        restored = {"caches": [cache], "all_tokens": [job.prompt_ids[:done]]} if cache else {}
        try:
            (uid,) = self._gen.insert(
                [job.prompt_ids[done:]],
                max_tokens=[p.max_tokens],
                samplers=[make_sampler(p.temperature, p.top_p, p.seed, p.top_k)],
                logits_processors=[make_processors(p.logit_bias, p.presence_penalty,
                                                   p.frequency_penalty)],
                stop_sequences=[StopSequences([(t,) for t in self.eos_token_ids])],
                **restored,
            )
        except Exception as e:
            self._fail(job, f"{type(e).__name__}: {e}")
            return False
        job.uid = uid
        self._jobs[uid] = job
        if job.adapter is not None:
            self._named.admitted(uid, job.adapter_model)
        return True

    def _prefill(self) -> None:
        """The lane's next prefill: a group of waiting prompts that fit one chunk, handed to the
        generator (its next step prefills them in one batched pass), or one chunk of a longer
        prompt, run here."""
        room = self.max_batch - len(self._jobs)
        if self._lane.plan(room) == "group":
            started = 0
            group = self._lane.group(room)
            for item in group:  # a group of several starts as one batch: none runs alone
                started += self._start(item.job, item.cache, item.done, alone=len(group) == 1)
            self._group_pending = started > 0
            self.stats.prefill_groups = self._lane.groups
            return
        item = self._lane.next_chunk()
        if item is None:
            return
        try:
            self._named.use([item.job.adapter_model])  # this prompt's adapter
            try:
                ready = self._lane.run(item)
            finally:
                self._named.clear()
        except Exception as e:  # this prompt fails, nothing else
            log.exception("prefill chunk failed")
            self._lane.remove(item.job)
            self._fail(item.job, f"{type(e).__name__}: {e}")
            return
        self.stats.prefill_chunks = self._lane.chunks
        self._count_prefill()
        if ready:
            self._start(item.job, item.cache, item.done)

    def _count_prefill(self) -> None:
        chunk_ms = self._lane.last_chunk_s * 1000
        self.stats.last_prefill_chunk_ms = chunk_ms
        self.stats.max_prefill_chunk_ms = max(self.stats.max_prefill_chunk_ms, chunk_ms)

    def _cancel(self, job: Job) -> None:
        if self._lone is not None and self._lone.job is job:
            lone, self._lone = self._lone, None
            if self.prefix_cache is not None:
                self._store(job, lone.cache, lone.kv_tokens())
        elif job.uid is not None and job.uid in self._jobs:
            if self.prefix_cache is None:
                self._gen.remove([job.uid])
            else:
                kept = self._gen.remove([job.uid], return_prompt_caches=True)
                if job.uid in kept:
                    self._store(job, *kept[job.uid])
            del self._jobs[job.uid]
            self._named.ended(job.uid)
        else:
            item = self._lane.remove(job)
            if item is not None and self.prefix_cache is not None:  # what it prefilled so far
                self._store(job, item.cache, job.prompt_ids[:item.done])
        job.done = True

    def _deliver(self, responses, version: int) -> None:
        live = [r for r in responses if r.uid in self._jobs]
        if not live:
            return
        chosen = chosen_logprobs([r.logprobs for r in live], [r.token for r in live])
        for r, logprob in zip(live, chosen):
            job = self._jobs[r.uid]
            job.produced += 1
            k = job.params.top_logprobs
            token = Token(id=r.token, logprob=logprob,
                          adapter_version=version if job.adapter is None else job.adapter_version,
                          top=top_logprobs(r.logprobs, k) if k else None)
            self.stats.tokens += 1
            if r.finish_reason is not None:
                del self._jobs[r.uid]
                self._named.ended(r.uid)
                job.done = True
                if self.prefix_cache is not None:  # before the last token: a next turn finds it
                    self._store(job, r.prompt_cache, r.all_tokens)
            job.deliver(Step(token=token, finish_reason=r.finish_reason))

    def _lone_step(self) -> None:
        """One speculative step of the lone stream: its tokens delivered, the stream ended at
        an end token or its budget."""
        lone, job = self._lone, self._lone.job
        version = self.adapter_version if job.adapter is None else job.adapter_version
        try:
            emitted = lone.step(self._model_of(job))
        except Exception as e:  # this stream fails, nothing else
            log.exception("speculative step failed")
            self._lone = None
            self._fail(job, f"{type(e).__name__}: {e}")
            return
        self.stats.spec_steps += 1
        self.stats.spec_drafted += lone.last_drafted
        self.stats.spec_accepted += lone.last_accepted
        job.drafted += lone.last_drafted
        job.accepted += lone.last_accepted
        for n, e in enumerate(emitted, 1):
            finish = ("stop" if e.token in self.eos_token_ids else
                      "length" if lone.produced - len(emitted) + n >= job.params.max_tokens
                      else None)
            self.stats.tokens += 1
            self.stats.spec_tokens += 1
            if finish is not None:
                self._lone = None
                job.done = True
                if self.prefix_cache is not None:  # the KV of every token but this last one
                    trim_prompt_cache(lone.cache, len(emitted) - n)
                    kept = len(job.prompt_ids) + lone.produced - len(emitted) + n - 1
                    self._store(job, lone.cache, lone.kv_tokens()[:kept])
            job.deliver(Step(token=Token(id=e.token, logprob=e.logprob, adapter_version=version,
                                         top=e.top), finish_reason=finish))
            if finish is not None:
                return

    def _take_back(self) -> None:
        """The batch's last job leaves it to decode alone, with its KV, if it may speculate and
        has a token out (so it is past its prefill); else it stays."""
        ((uid, job),) = self._jobs.items()
        if job.done or not job.produced or job.stays_batched or not speculable(job, job.seeded):
            return
        try:
            cache, tokens = self._gen.extract_cache([uid])[uid]
            lone = LoneStream.resume(job, list(cache), list(tokens))
        except Exception:  # it decodes on in the batch
            log.exception("taking a stream back from the batch failed")
            lone = None
        if lone is None:  # (a cache that cannot be trimmed): not tried again for this job
            job.stays_batched = True
            return
        self._gen.remove([uid])
        del self._jobs[uid]
        self._named.ended(uid)
        job.uid = None
        self._lone = lone

    def _hand_over(self) -> None:
        """The lone stream joins the BatchGenerator with its KV: its unfed last token is the
        prompt there, its budget what is left of it."""
        lone, self._lone = self._lone, None
        job, p = lone.job, lone.job.params
        tokens = lone.tokens.list()
        try:
            (uid,) = self._gen.insert(
                [tokens[-1:]], max_tokens=[p.max_tokens - lone.produced],
                caches=[lone.cache], all_tokens=[tokens[:-1]],
                # a key chain of its own for each batched phase, never one already drawn from
                samplers=[make_sampler(p.temperature, p.top_p, (p.seed + lone.produced) % 2**64,
                                       p.top_k)],
                logits_processors=[make_processors(p.logit_bias, 0.0, 0.0)],
                stop_sequences=[StopSequences([(t,) for t in self.eos_token_ids])],
            )
        except Exception as e:
            self._fail(job, f"{type(e).__name__}: {e}")
            return
        job.uid = uid
        job.produced = 0  # counts this batched phase: a take-back needs a token out of it
        self._jobs[uid] = job
        if job.adapter is not None:
            self._named.admitted(uid, job.adapter_model)

    def _model_of(self, job: Job) -> nn.Module:
        """The model a lone stream decodes JOB with: its named adapter's own, or the live one."""
        return job.adapter_model if job.adapter is not None else self.model

    def _cached(self, job: Job) -> bool:
        """Whether JOB restores and stores prefix KV: the live adapter's jobs, and a personal
        adapter's (in its own lineage); other named adapters' KV is kept nowhere."""
        return self.prefix_cache is not None and (
            job.adapter is None or job.adapter in self._kv_names)

    def _store(self, job: Job, cache, tokens: list[int]) -> None:
        """Hand a job's KV (covering exactly `tokens`: prompt + every sampled token) to the
        prefix cache if it holds something new; the store files it under the job's oldest
        adapter, or refuses it when that one has left the reuse window."""
        if self._cached(job) and job.kv_source is not None and len(tokens) > job.cached_tokens:
            prompt_end = min(len(job.prompt_ids), len(tokens))
            self.prefix_cache.put(list(tokens), cache, [prompt_end, len(tokens)], job.kv_source,
                                  adapter=job.adapter)

    def _fail(self, job: Job, message: str) -> None:
        job.done = True
        job.deliver(Step(finish_reason="error", error=message))

    def _fail_jobs(self, jobs: dict, message: str) -> None:
        for job in list(jobs.values()):
            self._fail(job, message)
        jobs.clear()

    def _fail_all(self, message: str) -> None:
        self._running = False
        if self._lone is not None:
            job, self._lone = self._lone.job, None
            self._fail(job, message)
        self._fail_jobs(self._jobs, message)
        for item in list(self._lane.items):
            self._lane.remove(item.job)
            self._fail(item.job, message)
        while self._inbox:  # submits that will never start
            kind, payload = self._inbox.popleft()
            if kind == "submit" and not payload.done:
                self._fail(payload, message)


def asyncio_delivery(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> Callable[[Step], None]:
    """A `deliver` callback that moves engine steps onto an asyncio queue, thread-safely."""
    return lambda step: loop.call_soon_threadsafe(queue.put_nowait, step)
