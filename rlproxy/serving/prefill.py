"""Getting a job's prompt KV ready without stalling the streams already decoding.

Two stages sit between `Engine.submit` and the batched decode (serving/engine.py):

- **Loader** (a thread of its own): looks the prompt up in the prefix cache, which may read a
  blob from disk, check its CRC, unpack and dequantize it, and hands the job on with its KV
  restored and evaluated. That work once ran on the engine thread between two decode steps and
  stalled every stream for its whole length.
- **PrefillLane** (on the engine thread): every prompt waits here until the decode batch has
  had its share of time. Then the lane either hands a *group* to mlx-lm's BatchGenerator, as
  many waiting prompts (fewest tokens left first, at most `prefill_batch`) as fit in one
  `prefill_step_size` chunk padded to the longest of them, which the generator prefills in one
  batched forward pass inside its next step; or, when even the shortest waiting prompt has more
  than a chunk left, it runs one chunk of that prompt through the model here. A long prompt
  thus enters the decode batch once its rest fits a chunk (the way a prefix-cache hit enters).
  Left to itself, BatchGenerator would prefill a long prompt inside one `next()` (every chunk
  back to back, and a short prompt that arrives meanwhile padded into the same chunks), so a
  4-token request waited for a whole 30k-character prompt. Between two prefills the decode
  batch gets at least as much time as the last prefill took: a short request that arrives
  during a long prefill waits for at most the chunk under way, then runs at no worse than half
  speed. Batching the waiting prompts into one forward pass, rather than one chunk each with
  decode time between, is what keeps many concurrent arrivals as fast as a plain batched server.

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

from rlproxy.mlx_threads import mlx_thread

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
        cache, n, source = self.prefix_cache.fetch(job.prompt_ids, job.adapter)
        if cache is not None:
            mx.eval([(c.keys, c.values) for c in cache])  # on this thread: MLX streams are ours
        job.restored, job.cached_tokens, job.kv_source = cache, n, source


@dataclass
class Prefilling:
    job: object
    cache: list | None  # the model's KV cache covering prompt_ids[:done]; None: nothing yet
    done: int
    passed: int = 0  # groups formed without it while it fitted one


class PrefillLane:
    """Prompts waiting for their prefill on the engine thread, with the decode batch's fair
    share of time between two prefills."""

    def __init__(self, model: nn.Module, step_size: int, prefill_batch: int = 8):
        self.model, self.step_size, self.prefill_batch = model, step_size, prefill_batch
        self.items: list[Prefilling] = []
        self.chunks = 0  # chunks of one long prompt run here
        self.groups = 0  # groups handed to the BatchGenerator
        self.last_chunk_s = 0.0  # the last prefill's time, a chunk's or a group's
        # What the next prefill will likely take, by kind: decoding gets as much before it
        self._chunk_s = 0.0  # the last chunk of a long prompt's time
        self._group_s = 0.0  # the last group's time
        self._decode_s = 0.0  # decode time since the last prefill
        self._last = "chunk"  # the last prefill's kind

    def __len__(self) -> int:
        return len(self.items)

    def add(self, job, cache: list | None) -> None:
        self.items.append(Prefilling(job, cache, job.cached_tokens))

    def remove(self, job) -> Prefilling | None:
        for i, item in enumerate(self.items):
            if item.job is job:
                return self.items.pop(i)
        return None

    def decoded(self, seconds: float) -> None:
        self._decode_s += seconds

    def prefilled(self, seconds: float) -> None:
        """A group's prefill (inside the generator step that took SECONDS) is done."""
        self.last_chunk_s = self._group_s = seconds
        self._decode_s = 0.0

    def plan(self, room: int) -> str | None:
        """What the next prefill is: "group" (waiting prompts that fit one chunk, handed to
        the generator; needs ROOM in the batch), "chunk" (a chunk of a longer prompt, here; no
        room needed), or None. With both waiting they take turns, so neither a stream of short
        requests nor a long prompt holds the other up for more than one prefill."""
        fits = room > 0 and any(_left(it) <= self.step_size for it in self.items)
        long = any(_left(it) > self.step_size for it in self.items)
        if fits and long:
            return "chunk" if self._last == "group" else "group"
        return "group" if fits else "chunk" if long else None

    def due(self, decoding: bool, room: int) -> bool:
        """A prefill may run now: nothing else decodes, or decoding has had as much time since
        the last prefill as the next one will likely take (a group's or a chunk's): every
        stream then runs at no worse than half speed, and a short request let in between two
        chunks of a long prompt finishes before the next chunk holds it up."""
        kind = self.plan(room) if self.items else None
        if kind is None:
            return False
        return not decoding or self._decode_s >= (self._group_s if kind == "group"
                                                  else self._chunk_s)

    def group(self, room: int) -> list[Prefilling]:
        """Take the waiting prompts to prefill together, at most ROOM and `prefill_batch` of
        them: one passed over twice first, then fewest tokens left first, while they fit one
        chunk padded to the longest and padding adds at most half again, both to the tokens to
        prefill and to the whole prompts (their caches are padded to the longest when merged):
        a 13-token request is not padded to a long prompt's tail, nor to a 20k-token cache hit."""
        out: list[Prefilling] = []
        left = whole = 0
        fitting = [it for it in self.items if _left(it) <= self.step_size]
        for item in sorted(fitting, key=lambda it: (it.passed < 2, _left(it))):
            n = len(out) + 1
            padded = n * max([_left(item)] + [_left(it) for it in out])
            padded_whole = n * max(len(it.job.prompt_ids) for it in out + [item])
            if n > min(room, self.prefill_batch) or padded > self.step_size or (out and (
                    2 * padded > 3 * (left + _left(item)) or
                    2 * padded_whole > 3 * (whole + len(item.job.prompt_ids)))):
                break
            out.append(item)
            left, whole = left + _left(item), whole + len(item.job.prompt_ids)
        for item in out:
            self.items.remove(item)
        for item in fitting:
            item.passed += item not in out
        if out:
            self.groups += 1
            self._last = "group"
        return out

    def next_chunk(self) -> Prefilling | None:
        """The prompt to prefill a chunk of: of those longer than a chunk, the one with the
        fewest tokens left."""
        long = [it for it in self.items if _left(it) > self.step_size]
        return min(long, key=_left) if long else None

    def run(self, item: Prefilling) -> bool:
        """Prefill one chunk of ITEM; True (and it leaves the lane) once its KV covers all but
        the last prompt token: it is ready to decode."""
        if item.cache is None:
            item.cache = make_prompt_cache(self.model)
        end = min(item.done + self.step_size, len(item.job.prompt_ids) - 1)
        tic = time.perf_counter()
        self.model(mx.array(item.job.prompt_ids[item.done:end])[None], cache=item.cache)
        mx.eval([c.state for c in item.cache])
        mx.clear_cache()
        self.last_chunk_s = self._chunk_s = time.perf_counter() - tic
        self._decode_s, self._last = 0.0, "chunk"
        self.chunks += 1
        item.done = end
        if end < len(item.job.prompt_ids) - 1:
            return False
        self.items.remove(item)
        return True


def _left(item: Prefilling) -> int:
    """Prompt tokens ITEM still has to prefill."""
    return len(item.job.prompt_ids) - item.done
