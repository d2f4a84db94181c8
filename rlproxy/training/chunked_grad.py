"""Memory-bounded forward and backward of one training sequence, in short units.

Owns how one (possibly packed) sequence's loss and LoRA gradient are computed without ever
materializing the whole C x C attention: the sequence is cut into chunks of positions, and a
chunk sees the earlier positions only through their keys and values (per layer), which a tiny
cache object (`ChunkKV`) hands to the model's own attention code, as prefill does.

  forward   chunks 0..n-2 without gradient, keeping each layer's K/V (one unit each)
  backward  chunks n-1 down to the first trained one (one unit each): recompute the chunk with
            the earlier K/V as inputs, and take the gradient of
              chunk loss + sum(K_chunk * dK_chunk) + sum(V_chunk * dV_chunk)
            w.r.t. the LoRA weights and the earlier K/V; dK, dV (cotangents from later chunks)
            are accumulated per position. This is exact backprop with per-chunk recomputation.
  prompt_grad "full": every chunk is recomputed, the gradient is exact.
  prompt_grad "none": K/V before the first trained position are constants (no gradient through
            them, no backward over them); log-probs are still exact.

Peak memory is O(chunk x C) for attention plus O(C) for K/V, not O(C^2). The lm_head runs only
on trained positions (chunks are cut where the mask changes). Each unit ends in mx.eval, and
`between(unit_seconds)` is called after it, so the trainer can yield to serving.

Not here: the policy losses' math (training/losses.py), building and packing examples
(training/examples.py), batches, optimizer steps (training/learner.py), records (training/loop.py).
Models that bring their own cache (`make_cache`: sliding windows, SSM layers) are not supported.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import create_attention_mask

from rlproxy.serving.logprobs import logprobs_of
from rlproxy.training import losses

PROMPT_GRAD = ("full", "none")


class ChunkKV:
    """One layer's KV for one chunk: the earlier positions' K/V, then this chunk's appended.
    It keeps this chunk's own K/V in `new` (what the next chunks attend to)."""

    def __init__(self, keys: mx.array | None = None, values: mx.array | None = None):
        self.keys, self.values = keys, values
        self.offset = 0 if keys is None else keys.shape[-2]  # rope position of the chunk
        self.new: tuple[mx.array, mx.array] | None = None

    def update_and_fetch(self, keys, values):
        self.new = (keys, values)
        if self.keys is None:
            return keys, values
        return (mx.concatenate([self.keys, keys], axis=-2),
                mx.concatenate([self.values, values], axis=-2))

    def make_mask(self, n: int, return_array: bool = False, window_size=None):
        return create_attention_mask(n, self.offset, return_array, window_size)


# Past this many earlier positions a chunk shrinks (to no fewer than MIN_CHUNK positions), so a
# unit's attention work and memory, chunk x context, stays near chunk x FULL_CHUNK_CONTEXT.
FULL_CHUNK_CONTEXT = 8192
MIN_CHUNK = 32


def chunk_bounds(mask: list[float], chunk: int) -> list[tuple[int, int, bool]]:
    """(start, end, trained) chunks of at most `chunk` positions (fewer deep into a long
    sequence), cut wherever the mask turns on or off, so a chunk is either all trained positions
    or none: the lm_head runs on trained positions only."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        size = max(MIN_CHUNK, chunk * FULL_CHUNK_CONTEXT // max(start, FULL_CHUNK_CONTEXT))
        if i == len(mask) or i - start == min(chunk, size) or (mask[i] > 0) != (mask[start] > 0):
            out.append((start, i, mask[start] > 0))
            start = i
    return out


def _concat(parts: list[mx.array]) -> mx.array | None:
    return None if not parts else parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-2)


def _run_chunk(model, inputs, past_k, past_v):
    caches = [ChunkKV(k, v) for k, v in zip(past_k, past_v)]
    logits = model(inputs, cache=caches)
    return logits, [c.new[0] for c in caches], [c.new[1] for c in caches]


def _unit(between, tic, *arrays) -> None:
    mx.eval(*arrays)
    between(time.perf_counter() - tic)


def _forward(model, inputs, targets, bounds, between):
    """Chunks in order without gradient, one unit each: per-layer K/V lists ([layer][chunk]),
    and, given targets, the log-probs of trained chunks (zeros elsewhere)."""
    keys = [[] for _ in model.layers]
    values = [[] for _ in model.layers]
    out = []
    for a, b, trained in bounds:
        tic = time.perf_counter()
        logits, k, v = _run_chunk(model, inputs[:, a:b], [_concat(x) for x in keys],
                                  [_concat(x) for x in values])
        for layer in range(len(keys)):
            keys[layer].append(k[layer])
            values[layer].append(v[layer])
        if targets is not None:  # without targets, the logits are never computed (lazy)
            out.append(logprobs_of(logits, targets[:, a:b]) if trained
                       else mx.zeros((1, b - a)))
        _unit(between, tic, out[-1:], k, v)
    return keys, values, out


def chunked_logprobs(model: nn.Module, inputs: mx.array, targets: mx.array, mask: list[float],
                     chunk: int, between: Callable[[float], None] = lambda s: None) -> mx.array:
    """log p(targets | inputs) at trained positions (0 elsewhere), without gradient, in chunks:
    the values of serving/logprobs.py's token_logprobs, at O(chunk x C) memory.
    (1, L) -> (1, L)."""
    _, _, out = _forward(model, inputs, targets, chunk_bounds(mask, chunk), between)
    return mx.concatenate(out, axis=1)


def sequence_grad(model: nn.Module, inputs: mx.array, targets: mx.array, mask: list[float],
                  chunk_loss: Callable, *, chunk: int, prompt_grad: str = "none",
                  between: Callable[[float], None] = lambda s: None):
    """Summed aux values and the LoRA gradient of one sequence's loss, computed in units.

    chunk_loss(logp, a, b, logits) -> (objective, aux) for the trained positions a..b (logp:
    (1, b - a), the chunk's logits: (1, b - a, V)), where aux is a tuple of scalars; the
    objectives of all chunks add up to the sequence's loss.
    Returns (aux summed over chunks, as floats; grads, evaluated)."""
    bounds = chunk_bounds(mask, chunk)
    first = next(i for i, (_, _, trained) in enumerate(bounds) if trained)
    grad_from = 0 if prompt_grad == "full" else first  # chunks before it are constants
    n_layers = len(model.layers)
    # the last chunk's K/V is nobody's past
    keys, values, _ = _forward(model, inputs, None, bounds[:-1], between)

    frozen_k = [_concat(x[:grad_from]) for x in keys]
    frozen_v = [_concat(x[:grad_from]) for x in values]
    params = model.trainable_parameters()
    grads, aux = None, None
    cot: dict[int, tuple[list, list]] = {}  # chunk -> per-layer (dK, dV) from later chunks
    for j in range(len(bounds) - 1, grad_from - 1, -1):
        tic = time.perf_counter()
        a, b, trained = bounds[j]
        live = ([_concat(x[grad_from:j]) for x in keys],
                [_concat(x[grad_from:j]) for x in values]) if j > grad_from else None
        d_k, d_v = cot.pop(j, (None, None))

        def objective(p, live):
            model.update(p)
            past_k, past_v = frozen_k, frozen_v
            if live is not None:
                past_k = [x if f is None else mx.concatenate([f, x], axis=-2)
                          for f, x in zip(frozen_k, live[0])]
                past_v = [x if f is None else mx.concatenate([f, x], axis=-2)
                          for f, x in zip(frozen_v, live[1])]
            logits, k, v = _run_chunk(model, inputs[:, a:b], past_k, past_v)
            total, part = mx.array(0.0), None
            if trained:
                total, part = chunk_loss(logprobs_of(logits, targets[:, a:b]), a, b, logits)
            if d_k is not None:  # the later chunks' pull on this chunk's K/V
                total = total + sum((x * g).sum() for x, g in zip(k + v, d_k + d_v))
            return total, part

        if live is None:
            (_, part), g_params = mx.value_and_grad(objective)(params, None)
        else:
            (_, part), (g_params, g_live) = mx.value_and_grad(objective, argnums=(0, 1))(
                params, live)
            base = bounds[grad_from][0]  # hand each earlier live chunk its share of dK, dV
            for i in range(grad_from, j):
                lo, hi = bounds[i][0] - base, bounds[i][1] - base
                share = ([x[..., lo:hi, :] for x in g_live[0]],
                         [x[..., lo:hi, :] for x in g_live[1]])
                cot[i] = share if i not in cot else tree_map(mx.add, cot[i], share)
        model.update(params)
        for layer in range(n_layers):  # chunk j's own K/V: no chunk left that attends to it
            del keys[layer][j:], values[layer][j:]
        grads = g_params if grads is None else tree_map(mx.add, grads, g_params)
        if part is not None:
            aux = part if aux is None else tree_map(mx.add, aux, part)
        _unit(between, tic, grads, aux or [], list(cot.values()))
    return tuple(float(x.item()) for x in aux), grads


def example_grad(model: nn.Module, ex: dict, loss_fn: Callable, normaliser: int, *, chunk: int,
                 prompt_grad: str, between: Callable[[float], None], ref_model=None,
                 kl_coef: float = 0.0, entropy_coef: float = 0.0, **loss_kw):
    """((loss / normaliser, summed KL, summed entropy) as floats, LoRA gradient) of one example:
    a turn or a packed session, as lists `ids`, `old`, `adv`, `mask` (training/examples.py). The
    loss includes the KL penalty and the entropy bonus (training/losses.py); the entropy is always
    reported, and carries a gradient only when ENTROPY_COEF > 0."""
    ids = ex["ids"]
    inputs, targets = mx.array(ids[:-1])[None], mx.array(ids[1:])[None]
    old, adv, mask = (mx.array(ex[k])[None] for k in ("old", "adv", "mask"))
    prox = mx.array(ex["prox"])[None] if ex.get("prox") is not None else None  # epochs > 1
    ref = None
    if ref_model is not None and kl_coef > 0:
        ref = chunked_logprobs(ref_model, inputs, targets, ex["mask"], chunk, between)

    def chunk_loss(logp, a, b, logits):
        m = mask[:, a:b]
        kw = loss_kw if prox is None else {**loss_kw, "prox": prox[:, a:b]}
        loss = loss_fn(logp, old[:, a:b], adv[:, a:b], m, **kw)
        kl = mx.array(0.0)
        if ref is not None:
            kl = losses.kl_penalty(logp, ref[:, a:b], m)
            loss = loss + kl_coef * kl
        ent = losses.entropy(logits, m)
        if entropy_coef > 0:
            loss = loss - entropy_coef * ent
        else:  # logged only: no gradient to build through it
            ent = mx.stop_gradient(ent)
        return loss / normaliser, (loss / normaliser, kl, ent)

    return sequence_grad(model, inputs, targets, ex["mask"], chunk_loss, chunk=chunk,
                         prompt_grad=prompt_grad, between=between)


# ---- memory ----

def model_shape(model: nn.Module) -> dict:
    """What the memory estimate needs, from an mlx-lm model's config (`model.args`)."""
    args = vars(model.args)
    args = {**args.get("text_config", {}), **args}
    heads = args["num_attention_heads"]
    hidden = args["hidden_size"]
    return {"layers": len(model.layers), "heads": heads,
            "kv_heads": args.get("num_key_value_heads") or heads,
            "head_dim": args.get("head_dim") or hidden // heads, "hidden": hidden,
            "intermediate": args.get("intermediate_size") or 4 * hidden,
            "vocab": args["vocab_size"]}


RUNTIME_SLACK = 128 * 2**20  # measured: ~100-150 MB more than the terms below on the tiny model


def estimate_step_bytes(shape: dict, length: int, chunk: int, prompt_grad: str,
                        trained: int) -> int:
    """Peak bytes one sequence's step adds on top of the loaded model (float32 activations).

    Terms, checked against measured peak RSS on the CPU backend (NOTES_longctx): the K/V of every
    position, x4.5 in `none` (the chunks' own, the concatenated past, a layer's transient copy,
    and the allocator's rounding: 4.05 copies measured at 24k on a K/V-heavy model,
    NOTES_trainfix), x5.5 in `full` (+ the live past's gradient and the dK/dV accumulators:
    4.8 measured); one chunk's recomputation with its backward, whose largest part is the
    attention scores MLX materializes (about 4 copies of heads x chunk x context per layer);
    the chunk's hidden activations (~10 hidden + 4 intermediate wide per layer); the logits of
    a trained chunk (logits, softmax, their gradient); and RUNTIME_SLACK for MLX's allocator
    and graphs. `trained` is the number of trained positions."""
    f = 4
    s = shape
    kv = s["layers"] * 2 * s["kv_heads"] * s["head_dim"] * length * f
    kv = int(kv * (5.5 if prompt_grad == "full" else 4.5))
    c = min(chunk, length)
    window = max(c * min(length, FULL_CHUNK_CONTEXT), MIN_CHUNK * length)  # see chunk_bounds
    scores = s["layers"] * 4 * s["heads"] * window * f
    acts = s["layers"] * c * (10 * s["hidden"] + 4 * s["intermediate"]) * f
    logits = 3 * min(c, max(trained, 1)) * s["vocab"] * f
    return int(kv + scores + acts + logits + RUNTIME_SLACK)


def over_budget(shape: dict, ex: dict, chunk: int, prompt_grad: str, budget: int) -> str | None:
    """Why a step on this example would not fit in `budget` bytes, or None if it fits."""
    need = estimate_step_bytes(shape, len(ex["ids"]), chunk, prompt_grad, ex["tokens"])
    if need <= budget:
        return None
    return (f"a step on {len(ex['ids'])} tokens needs about {need / 2**30:.2f} GB (prompt_grad "
            f"{prompt_grad}), over train_memory_gb {budget / 2**30:.2f}")


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


SERVING_RESERVE = 2 * 2**30  # the engine's KV caches, prefix cache and the process besides
TRAIN_SHARE = 0.75  # of what is left: the estimate is approximate, the OS needs room too


def default_budget(*models) -> int:
    """The step budget when train_memory_gb is not set: TRAIN_SHARE of physical memory less
    the resident weights of MODELS (the training model, whose base the serving model shares,
    and a KL reference model if loaded) and SERVING_RESERVE. 0 when nothing is left."""
    resident = sum(v.nbytes for m in models if m is not None
                   for _, v in tree_flatten(m.parameters()))
    return max(0, int(TRAIN_SHARE * (physical_memory_bytes() - resident - SERVING_RESERVE)))
