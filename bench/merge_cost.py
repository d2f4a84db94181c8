"""What the merged adapter buys and costs (serving/merge.py), on one model, in one run.

A trained-like adapter (rlproxy's default LoRA layers, every lora_b drawn) on the serving model.
Alternating, one decode step of one sequence (one token after a 500-token KV cache, evaluated):
the LoRA layers unmerged (what every step paid before), the same layers merged, and the bare
base model (no adapter; version 0 serves exactly this when merged). Also: the merge's own time
(it runs on the publisher's thread, the trainer's, not between decode steps), the memory the merged
weights hold beyond the base, and the largest log-prob difference between the merged and
unmerged forwards over 200 positions.

    python bench/merge_cost.py [--model smollm2-135m-instruct] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import rlproxy  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
from mlx.utils import tree_unflatten
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from rlproxy.serving.logprobs import token_logprobs
from rlproxy.serving.merge import merge_layers, merged_bytes, merged_weights, set_merged
from rlproxy.serving.model import load_serving_model, lora_weights
from rlproxy.settings import ModelSettings


def step_ms(model, cache) -> float:
    tic = time.perf_counter()
    mx.eval(model(mx.array([[7]]), cache=cache))
    took = (time.perf_counter() - tic) * 1000
    trim_prompt_cache(cache, 1)
    return took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", type=Path, default=Path("bench/results/merge_cost.json"))
    a = p.parse_args()
    loaded = load_serving_model(ModelSettings(model=a.model), lora_seed=0)
    model = loaded.model
    layers = merge_layers(model)
    drawn = {k: (mx.random.normal(v.shape, key=mx.random.key(i)) * 0.01).astype(v.dtype)
             if k.endswith("lora_b") else v
             for i, (k, v) in enumerate(sorted(lora_weights(model).items()))}
    mx.eval(drawn)
    zero = {k: mx.zeros_like(v) if k.endswith("lora_b") else v for k, v in drawn.items()}
    merge_s = []
    for _ in range(3):
        tic = time.perf_counter()
        merged = merged_weights(layers, drawn)
        merge_s.append(time.perf_counter() - tic)
    base = merged_weights(layers, zero)
    cache = make_prompt_cache(model)
    model(mx.array([list(range(10, 510))]), cache=cache)
    mx.eval([c.state for c in cache])
    forms = {"unmerged": (drawn, None), "merged": (drawn, merged), "base": (zero, base)}
    times = {f: [] for f in forms}
    for _ in range(a.steps):  # alternate: the machine's load hits each form alike
        for form, (weights, m) in forms.items():
            model.update(tree_unflatten(list(weights.items())))
            set_merged(layers, m)
            times[form].append(step_ms(model, cache))
    model.update(tree_unflatten(list(drawn.items())))
    ids = mx.array([list(range(20, 221))])
    set_merged(layers, None)
    unmerged_lp = token_logprobs(model, ids[:, :-1], ids[:, 1:])
    set_merged(layers, merged)
    merged_lp = token_logprobs(model, ids[:, :-1], ids[:, 1:])
    result = {
        "model": loaded.model_id, "lora_layers": len(layers),
        "step_ms_median": {f: statistics.median(t) for f, t in times.items()},
        "merge_s_median": statistics.median(merge_s),
        "merged_bytes": merged_bytes(merged),
        "adapted_projection_bytes": sum(layer.linear.weight.nbytes for layer in layers.values()),
        "max_logprob_diff": mx.abs(merged_lp - unmerged_lp).max().item(),
    }
    med = result["step_ms_median"]
    print(f"{loaded.model_id}: {len(layers)} LoRA layers; one decode step (batch 1, 500-token "
          f"cache, median of {a.steps}): unmerged {med['unmerged']:.2f} ms, merged "
          f"{med['merged']:.2f} ms ({med['merged'] / med['unmerged']:.2f}x), base "
          f"{med['base']:.2f} ms (merged / base {med['merged'] / med['base']:.2f}x)")
    print(f"merge: {result['merge_s_median'] * 1000:.0f} ms on the publisher's thread; merged "
          f"weights {result['merged_bytes'] / 2**20:.0f} MiB beyond the base (the adapted projections "
          f"again, float32); merged vs unmerged log-probs: max diff "
          f"{result['max_logprob_diff']:.2e}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
