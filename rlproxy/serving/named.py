"""Adapters the engine serves by name beside the live one (the Tinker API's sampler weights).

Each named adapter is a model object sharing the serving model's frozen base arrays with LoRA
weights of its own, decoded by a BatchGenerator of its own that the engine steps in turn with
the live batch. No prefix cache here (its KV is not the live adapter's). Engine thread only;
knows nothing of HTTP or of the Tinker API.
"""

from __future__ import annotations

import logging
from typing import Callable

import mlx.nn as nn
from mlx_lm.generate import BatchGenerator, StopSequences

from rlproxy.serving.jobs import Job, Step, Token
from rlproxy.serving.sampler import make_processors, make_sampler

log = logging.getLogger("rlproxy.engine")


class NamedAdapters:
    """name -> (its BatchGenerator, {uid: Job}). `new_generator(model)` makes a generator on
    the engine thread's stream, `fail(job, message)` ends a job with an error, and STATS is the
    engine's `EngineStats` (requests and tokens count here too)."""

    def __init__(self, new_generator: Callable[[nn.Module], BatchGenerator],
                 fail: Callable[[Job, str], None], eos_token_ids: list[int], stats):
        self.new_generator, self.fail = new_generator, fail
        self.eos_token_ids, self.stats = eos_token_ids, stats
        self.lanes: dict[str, tuple[BatchGenerator, dict[int, Job]]] = {}

    def busy(self) -> bool:
        return any(jobs for _, jobs in self.lanes.values())

    def change(self, kind: str, name: str, model: nn.Module | None) -> None:
        """`add_adapter` (replacing one of the same name) or `drop_adapter`."""
        old = self.lanes.pop(name, None)
        if old is not None:
            self.fail_jobs(old[1], f"adapter {name!r} was replaced")
            old[0].close()
        if kind == "add_adapter":
            self.lanes[name] = (self.new_generator(model), {})

    def insert(self, job: Job) -> None:
        lane, p = self.lanes.get(job.adapter), job.params
        try:
            if lane is None:
                raise KeyError(f"no adapter named {job.adapter!r} is loaded")
            (uid,) = lane[0].insert(
                [job.prompt_ids], max_tokens=[p.max_tokens],
                samplers=[make_sampler(p.temperature, p.top_p, p.seed, p.top_k)],
                logits_processors=[make_processors(p.logit_bias, p.presence_penalty,
                                                   p.frequency_penalty)],
                stop_sequences=[StopSequences([(t,) for t in self.eos_token_ids])])
        except Exception as e:
            self.fail(job, f"{type(e).__name__}: {e}")
            return
        job.uid = uid
        lane[1][uid] = job
        self.stats.requests += 1

    def step(self) -> None:
        """One decode step of every named adapter with requests."""
        for name, (gen, jobs) in list(self.lanes.items()):
            if not jobs:
                continue
            try:
                _, responses = gen.next()
            except Exception as e:  # this adapter's requests fail, nothing else
                log.exception("decode step for adapter %s failed", name)
                self.fail_jobs(jobs, f"{type(e).__name__}: {e}")
                self.change("add_adapter", name, gen.model)  # a fresh generator
                continue
            for r in responses:
                job = jobs.get(r.uid)
                if job is None:
                    continue
                lp = r.logprobs.reshape(-1)[r.token].item()  # temperature 1, as the live lane
                self.stats.tokens += 1
                if r.finish_reason is not None:
                    del jobs[r.uid]
                    job.done = True
                job.deliver(Step(token=Token(id=r.token, logprob=lp, adapter_version=0),
                                 finish_reason=r.finish_reason))

    def cancel(self, job: Job) -> None:
        lane = self.lanes.get(job.adapter)
        if lane is not None and job.uid in lane[1]:
            lane[0].remove([job.uid])
            del lane[1][job.uid]
        job.done = True

    def fail_jobs(self, jobs: dict, message: str) -> None:
        for job in list(jobs.values()):
            self.fail(job, message)
        jobs.clear()

    def fail_all(self, message: str) -> None:
        for _, jobs in self.lanes.values():
            self.fail_jobs(jobs, message)

    def close(self) -> None:
        """Close every generator (the engine thread is ending)."""
        for gen, _ in self.lanes.values():
            gen.close()
        self.lanes = {}
