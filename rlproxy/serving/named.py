"""Adapters the engine serves by name beside the live one (the Tinker API's sampler weights).

Each named adapter is a model object sharing the serving model's frozen base arrays with LoRA
weights of its own, decoded by a BatchGenerator of its own (a lane) that the engine steps in turn
with the live batch. A lane belongs to a model object, not to a name: a job is admitted to the
lane of the model it names (`Job.adapter_model`, else the one its name holds now) and finishes
there. So adding a name again with the same model changes nothing, and replacing or dropping a
name never fails a job already admitted: its lane decodes on until its last job ends, then
closes. No prefix cache here (its KV is not the live adapter's). Engine thread only; knows
nothing of HTTP or of the Tinker API.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import mlx.nn as nn
from mlx_lm.generate import BatchGenerator, StopSequences

from rlproxy.serving.jobs import Job, Step, Token
from rlproxy.serving.sampler import make_processors, make_sampler

log = logging.getLogger("rlproxy.engine")


@dataclass
class Lane:
    """One adapter model's generator and the jobs decoding in it, by uid."""
    model: nn.Module
    gen: BatchGenerator
    jobs: dict[int, Job] = field(default_factory=dict)


class NamedAdapters:
    """Names -> model objects, and a lane per model object in use. `new_generator(model)` makes
    a generator on the engine thread's stream, `fail(job, message)` ends a job with an error, and
    STATS is the engine's `EngineStats` (requests and tokens count here too)."""

    def __init__(self, new_generator: Callable[[nn.Module], BatchGenerator],
                 fail: Callable[[Job, str], None], eos_token_ids: list[int], stats):
        self.new_generator, self.fail = new_generator, fail
        self.eos_token_ids, self.stats = eos_token_ids, stats
        self.names: dict[str, nn.Module] = {}
        self.lanes: dict[int, Lane] = {}  # id(model) -> its lane (the lane keeps the model alive)

    def busy(self) -> bool:
        return any(lane.jobs for lane in self.lanes.values())

    def change(self, kind: str, name: str, model: nn.Module | None) -> None:
        """`add_adapter` (NAME now names MODEL) or `drop_adapter`. Jobs already admitted finish
        on the model they were admitted with."""
        old = self.names.pop(name, None)
        if kind == "add_adapter":
            self.names[name] = model
        if old is not None and old is not model:
            self._close_if_unused(id(old))

    def insert(self, job: Job) -> None:
        p = job.params
        try:
            model = job.adapter_model if job.adapter_model is not None else \
                self.names.get(job.adapter)
            if model is None:
                raise KeyError(f"no adapter named {job.adapter!r} is loaded")
            lane = self.lanes.get(id(model))
            if lane is None:
                lane = self.lanes[id(model)] = Lane(model, self.new_generator(model))
            (uid,) = lane.gen.insert(
                [job.prompt_ids], max_tokens=[p.max_tokens],
                samplers=[make_sampler(p.temperature, p.top_p, p.seed, p.top_k)],
                logits_processors=[make_processors(p.logit_bias, p.presence_penalty,
                                                   p.frequency_penalty)],
                stop_sequences=[StopSequences([(t,) for t in self.eos_token_ids])])
        except Exception as e:
            log.warning("a job for adapter %s was refused: %s: %s", job.adapter,
                        type(e).__name__, e)
            self.fail(job, f"{type(e).__name__}: {e}")
            return
        job.uid = uid
        lane.jobs[uid] = job
        self.stats.requests += 1

    def step(self) -> None:
        """One decode step of every lane with jobs; a lane whose model no name holds any more
        closes once its last job has ended."""
        for key, lane in list(self.lanes.items()):
            if not lane.jobs:
                continue
            try:
                _, responses = lane.gen.next()
            except Exception as e:  # this lane's jobs fail, nothing else
                log.exception("decode step for adapter lane %s failed", self._name_of(lane))
                self.fail_jobs(lane.jobs, f"{type(e).__name__}: {e}")
                lane.gen.close()
                lane.gen = self.new_generator(lane.model)
                self._close_if_unused(key)
                continue
            for r in responses:
                job = lane.jobs.get(r.uid)
                if job is None:
                    continue
                lp = r.logprobs.reshape(-1)[r.token].item()  # temperature 1, as the live lane
                self.stats.tokens += 1
                if r.finish_reason is not None:
                    del lane.jobs[r.uid]
                    job.done = True
                job.deliver(Step(token=Token(id=r.token, logprob=lp, adapter_version=0),
                                 finish_reason=r.finish_reason))
            self._close_if_unused(key)

    def cancel(self, job: Job) -> None:
        for key, lane in list(self.lanes.items()):
            if job.uid is not None and lane.jobs.get(job.uid) is job:
                lane.gen.remove([job.uid])
                del lane.jobs[job.uid]
                self._close_if_unused(key)
                break
        job.done = True

    def _close_if_unused(self, key: int) -> None:
        lane = self.lanes.get(key)
        if lane is not None and not lane.jobs and all(m is not lane.model
                                                      for m in self.names.values()):
            lane.gen.close()
            del self.lanes[key]

    def _name_of(self, lane: Lane) -> str:
        return next((n for n, m in self.names.items() if m is lane.model), "(dropped)")

    def fail_jobs(self, jobs: dict, message: str) -> None:
        for job in list(jobs.values()):
            self.fail(job, message)
        jobs.clear()

    def fail_all(self, message: str) -> None:
        for lane in self.lanes.values():
            self.fail_jobs(lane.jobs, message)

    def close(self) -> None:
        """Close every generator (the engine thread is ending)."""
        for lane in self.lanes.values():
            lane.gen.close()
        self.lanes, self.names = {}, {}
