"""The live adapter served merged: each LoRA projection decodes with one weight, W + s * (A B)^T.

The serving model keeps its LoRA layers (ServingLoRALinear, serving/model.py): training copies,
checkpoints, the prefix cache's fingerprint and `model.update` all see the adapter as today. What
changes is the forward of the live model: a layer holding a merged weight (`_merged`, outside the
module's parameters) runs one matmul with it, the base model's own cost, where the unmerged form
adds two thin matmuls and an add per projection (`bench/serving_step.py`: 2.41 ms against 1.90
ms a step on the tiny model).

- `merged_weights` computes the merged arrays for an adapter's flat LoRA weights, evaluated, on
  the caller's thread (`Engine.publish_adapter`'s: the trainer's, or the event loop's for a
  rollback by hand): the engine thread only swaps references between two decode steps
  (`set_merged`), so the swap pause is a few reference sets, and the adapter is served merged
  from its first step.
- A merged weight remembers the LoRA arrays it was made from (`Merged`); a layer that holds
  other ones (an adapter put in with `model.update` by any other path) runs unmerged.
- A layer whose `lora_b` is all zero (version 0, a fresh adapter) serves the base weight itself:
  no copy, no memory, exactly the base model.
- Otherwise each merged projection is a copy of its base weight: the adapted projections' size
  again, in float32 (measured by `merged_bytes`; the README gives it for SmolLM2). The
  weights a swap replaces are freed a few per decode step (`Engine._release_retired`).
- Off (every layer keeps the unmerged form) where merging would change the numbers or cannot be
  done: a base that is not float32 (a half-precision merge rounds every weight: log-probs would
  drift past 1e-4), a quantized base (QLoRA), and `--no-merge-lora`. Named adapters (the Tinker
  API's sampler weights) are other model objects and stay unmerged.

In float32 the merged forward gives the unmerged log-probs to within float rounding order
(tests/test_merge.py: within 1e-4 on SmolLM2 with a trained-like adapter).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True)
class Merged:
    """A layer's merged weight and the LoRA and base arrays it was made from: the forward uses it
    only while the layer still holds those very arrays, so an adapter (or base) put in by any
    other path (`model.update` by hand) is served unmerged, never stale."""
    weight: mx.array
    a: mx.array
    b: mx.array
    base: mx.array  # the base weight it was made from


def merge_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The serving model's LoRA layers that can serve merged, by module path; empty where none
    can (see the module's docstring)."""
    from rlproxy.serving.model import ServingLoRALinear

    layers = {name: m for name, m in model.named_modules() if isinstance(m, ServingLoRALinear)}
    if not layers or not all(type(m.linear) is nn.Linear and m.linear.weight.dtype == mx.float32
                             and m.lora_a.dtype == mx.float32 for m in layers.values()):
        return {}
    return layers


def merged_weights(layers: dict[str, nn.Module], weights: dict[str, mx.array]) -> dict:
    """For each layer, its merged weight under the adapter WEIGHTS (flat LoRA names, as
    `lora_weights` gives them), evaluated. Reads the layers' base weights and scales only."""
    out = {}
    for name, layer in layers.items():
        a, b = weights[f"{name}.lora_a"], weights[f"{name}.lora_b"]
        base = layer.linear.weight
        if not mx.any(b).item():
            out[name] = Merged(base, a, b, base)  # nothing to add: the base weight itself
        else:
            merged = mx.addmm(base, b.T, a.T, alpha=layer.scale)  # W + s (A B)^T
            mx.eval(merged)
            out[name] = Merged(merged, a, b, base)
    return out


def set_merged(layers: dict[str, nn.Module], merged: dict | None) -> list[Merged]:
    """Serve MERGED (from `merged_weights`), or the unmerged form when None. References only:
    the merged weights it replaces are returned, for the caller to drop when it suits it
    (freeing SmolLM2's 405 MiB of them takes 30-90 ms: see Engine._release_retired)."""
    replaced = []
    for name, layer in layers.items():
        if getattr(layer, "_merged", None) is not None:
            replaced.append(layer._merged)
        layer._merged = None if merged is None else merged[name]
    return replaced


def merged_bytes(merged: dict | None) -> int:
    """Memory MERGED (from `merged_weights`) holds beyond the base: the copies of changed
    projections."""
    return sum(m.weight.nbytes for m in (merged or {}).values() if m.weight is not m.base)
