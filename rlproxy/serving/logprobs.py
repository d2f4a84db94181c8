"""Log-probabilities of tokens under a model, at temperature 1 and in float32: the quantity the
engine records for every sampled token, the trainer's losses compare with, the judge's teacher
returns, the Tinker API's `compute_logprobs` answers and the eval gate's KL is made of. Written
once, here, at the lowest layer, so that scoring, training and tinker all compute the same thing.

`sequence_logprobs` is the one model-forward function over a token sequence: a KV cache prefilled
in chunks (keys and values only, no logits), then the scored positions, so a long sequence never
materialises logits for all its positions. `between(seconds)` is called after each evaluated
chunk: the caller's chance to yield to live requests.

`chosen_logprobs` and `top_logprobs` read the engine's rows, already evaluated by its decode
step, in place.

Not here: sampling (serving/sampler.py), losses (training/losses.py), the trainer's chunked
forward and backward with gradients (training/chunked_grad.py, which uses `logprobs_of`).
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache


def log_softmax(logits: mx.array) -> mx.array:
    """Every token's log-prob at temperature 1, in float32. (..., V) -> (..., V)."""
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def logprobs_of(logits: mx.array, targets: mx.array) -> mx.array:
    """The targets' log-softmax at temperature 1. logits: (B, T, V), targets: (B, T) -> (B, T)."""
    logits = logits.astype(mx.float32)
    return mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - mx.logsumexp(
        logits, axis=-1)


def token_logprobs(model: nn.Module, inputs: mx.array, targets: mx.array) -> mx.array:
    """log p(targets[t] | inputs[..t]) in one pass, differentiable through MODEL.
    inputs: (B, T), targets: (B, T) next tokens -> (B, T)."""
    return logprobs_of(model(inputs), targets)


def spans(n: int, step: int) -> list[tuple[int, int]]:
    """[0, n) cut into (start, end) pieces of at most STEP positions."""
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def prefill(model: nn.Module, ids: list[int], cuts: Iterable[tuple[int, int]],
            between: Callable[[float], None] = lambda s: None) -> list:
    """A KV cache holding IDS, run through MODEL one (start, end) of CUTS at a time, each
    evaluated and followed by `between(its seconds)`."""
    cache = make_prompt_cache(model)
    for a, b in cuts:
        tic = time.perf_counter()
        model(mx.array(ids[a:b])[None], cache=cache)
        mx.eval([c.state for c in cache])
        between(time.perf_counter() - tic)
    return cache


def sequence_logprobs(model: nn.Module, ids: list[int], start: int = 1, step: int | None = None,
                      between: Callable[[float], None] = lambda s: None) -> mx.array:
    """log p(ids[t] | ids[:t]) for t = START .. len(IDS) - 1, shape (len(IDS) - START,).
    ids[:START - 1] only fill the KV cache; the scored positions run STEP at a time (None: all
    at once); the prefill is cut the same way."""
    ids, step = list(ids), step or len(ids)
    cache = prefill(model, ids, spans(start - 1, step), between)
    out = []
    for a in range(start - 1, len(ids) - 1, step):  # position t predicts ids[t + 1]
        b = min(a + step, len(ids) - 1)
        tic = time.perf_counter()
        lp = logprobs_of(model(mx.array(ids[a:b])[None], cache=cache),
                         mx.array(ids[a + 1:b + 1])[None])[0]
        mx.eval(lp)
        between(time.perf_counter() - tic)
        out.append(lp)
    return mx.concatenate(out) if out else mx.zeros((0,), mx.float32)


def chosen_logprobs(rows: list[mx.array], tokens: list[int]) -> list[float]:
    """Each token's log-prob from its row of evaluated log-probs. A float32 or float16 row is
    read in place through NumPy (no MLX op, no copy: stacking the rows cost 2 ms a step at a
    151k vocabulary and 16 streams); a bfloat16 row, which NumPy cannot view, is indexed in MLX
    before anything is stacked."""
    if all(row.dtype in _NUMPY_VIEWS for row in rows):
        return [float(np.asarray(row)[t]) for row, t in zip(rows, tokens)]
    return mx.stack([row[t] for row, t in zip(rows, tokens)]).astype(mx.float32).tolist()


def top_logprobs(row: mx.array, k: int) -> list[tuple[int, float]]:
    """The K most likely tokens of one evaluated row of log-probs, most likely first."""
    values = np.asarray(row if row.dtype in _NUMPY_VIEWS else row.astype(mx.float32))
    k = min(k, values.shape[-1])
    ids = np.argpartition(-values, k - 1)[:k]
    ids = ids[np.argsort(-values[ids], kind="stable")]
    return [(int(i), float(values[i])) for i in ids]


_NUMPY_VIEWS = (mx.float32, mx.float16)
