"""Getting a job's prompt KV ready without stalling the streams already decoding.

Two stages sit between `Engine.submit` and the batched decode (serving/engine.py):

- **Loader** (a thread of its own): looks the prompt up in the prefix cache, which may read a
  blob from disk, check its CRC, unpack and dequantize it, and hands the job on with its KV
  restored and evaluated. That work once ran on the engine thread between two decode steps and
  stalled every stream for its whole length.
- **PrefillLane** (on the engine thread): a prompt with more than a few hundred tokens left to
  prefill is run through the model here, one `prefill_step_size` chunk per engine step, and
  enters the decode batch only once its KV covers all but the last prompt token (the way a
  prefix-cache hit enters). mlx-lm's BatchGenerator would prefill it inside one `next()` (every
  chunk back to back, and a short prompt that arrives meanwhile padded into the same chunks), so
  a 4-token request waited for a whole 30k-character prompt. Between two chunks the decode
  batch gets at least as much time as the last chunk took: a short request that arrives during a
  long prefill waits for at most the chunk under way, then runs at no worse than half speed.
  Among several long prompts, the one with the fewest tokens left goes first.

Neither stage knows about HTTP, sampling or what happens to the tokens.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from rlproxy.serving.mlx_threads import mlx_thread

log = logging.getLogger("rlproxy.prefill")


class Loader:
    """One thread that restores each job's cached prefix (`prefix_cache.fetch`) before the job
    reaches the engine; `ready(job)` gets it with `job.restored` set, or None on a miss."""

    def __init__(self, prefix_cache, ready: Callable):
        self.prefix_cache, self.ready = prefix_cache, ready
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="rlproxy-kv-loader", daemon=True)
        self._thread.start()

    def submit(self, job) -> None:
        self._queue.put(job)

    def busy(self) -> bool:
        return self._queue.unfinished_tasks > 0

    def stop(self) -> list:
        """End the thread; return the jobs it had not handed on."""
        self._queue.put(None)
        self._thread.join(timeout=60)
        left = []
        while not self._queue.empty():
            job = self._queue.get_nowait()
            if job is not None:
                left.append(job)
        return left

    def _run(self) -> None:
        with mlx_thread():
            while True:
                job = self._queue.get()
                if job is None:
                    break
                try:
                    if not job.done:  # cancelled while queued: nothing to load
                        self._load(job)
                except Exception:  # a bug here costs the cache hit, never the request
                    log.exception("prefix cache load failed")
                    job.restored, job.cached_tokens = None, 0
                finally:
                    self.ready(job)
                    job = None  # drop the KV here, not while waiting for the next job
                    self._queue.task_done()

    def _load(self, job) -> None:
        cache, n, source = self.prefix_cache.fetch(job.prompt_ids)
        if cache is not None:
            mx.eval([(c.keys, c.values) for c in cache])  # on this thread: MLX streams are ours
        job.restored, job.cached_tokens, job.kv_source = cache, n, source


@dataclass
class Prefilling:
    job: object
    cache: list  # the model's KV cache, covering prompt_ids[:done]
    done: int


class PrefillLane:
    """Prompts being prefilled chunk by chunk on the engine thread, with the decode batch's
    fair share of time between chunks."""

    def __init__(self, model: nn.Module, step_size: int):
        self.model, self.step_size = model, step_size
        self.items: list[Prefilling] = []
        self.chunks = 0
        self.last_chunk_s = 0.0
        self._decode_s = 0.0  # decode time since the last chunk

    def __len__(self) -> int:
        return len(self.items)

    def add(self, job, cache: list | None) -> None:
        cache = cache if cache is not None else make_prompt_cache(self.model)
        self.items.append(Prefilling(job, cache, job.cached_tokens))

    def remove(self, job) -> Prefilling | None:
        for i, item in enumerate(self.items):
            if item.job is job:
                return self.items.pop(i)
        return None

    def decoded(self, seconds: float) -> None:
        self._decode_s += seconds

    def due(self, decoding: bool) -> bool:
        """A chunk may run now: nothing else decodes, or decoding has had its half."""
        return bool(self.items) and (not decoding or self._decode_s >= self.last_chunk_s)

    def next(self) -> Prefilling:
        """The prompt to prefill next: the one with the fewest tokens left."""
        return min(self.items, key=lambda it: len(it.job.prompt_ids) - it.done)

    def run(self, item: Prefilling) -> bool:
        """Prefill one chunk of ITEM; True (and it leaves the lane) once its KV covers all but
        the last prompt token: it is ready to decode."""
        end = min(item.done + self.step_size, len(item.job.prompt_ids) - 1)
        tic = time.perf_counter()
        self.model(mx.array(item.job.prompt_ids[item.done:end])[None], cache=item.cache)
        mx.eval([c.state for c in item.cache])
        mx.clear_cache()
        self.last_chunk_s, self._decode_s = time.perf_counter() - tic, 0.0
        self.chunks += 1
        item.done = end
        if end < len(item.job.prompt_ids) - 1:
            return False
        self.items.remove(item)
        return True
