"""What the engine takes and gives: a job (prompt ids, sampling parameters, a delivery callback)
and, per engine step, a Step holding a Token with its log-prob and adapter version. Plain records;
serving/engine.py runs them (and re-exports them: `from rlproxy.engine import Job` works).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


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
    status: int = 500  # the error's HTTP status: 503 a sampler elsewhere is down, 400 refused


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
    # that adapter's model object when the caller holds it: the job decodes with it even if
    # the name is replaced or dropped before the job starts (serving/named.py)
    adapter_model: object | None = None
    adapter_version: int = 0  # that adapter's version, recorded on its tokens (serving/named.py)
    restored: list | None = None  # the cached prefix's KV (loader thread -> engine thread)
    seeded: bool = False  # the request chose its seed (set by Engine.submit)
    produced: int = 0  # tokens the live batch delivered for it since it (last) joined the batch
    stays_batched: bool = False  # a take-back failed (serving/speculate.py): not tried again
    drafted: int = 0  # tokens speculation drafted for it, and of those accepted (speculate.py)
    accepted: int = 0
