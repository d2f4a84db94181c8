"""Many adapters on one server: what serving several adapters at once costs against one.

Issue 38's throughput goals, measured on what rlproxy serves by name today: kept checkpoints
asked for as `MODEL@STEP` (serving/saved.py, the path the Tinker API's sampler weights take).
The script writes STEPS checkpoints of the model's default LoRA layout into a fresh data dir,
each with its own drawn `lora_b` (so each is a different adapter), starts `rlproxy serve
--no-train --no-judge` on it, loads each checkpoint once, then alternates, in rounds:

- `live x8`: 8 concurrent streams on the live adapter (the model's own name);
- `named 4x2`: 2 concurrent streams on each of 4 checkpoints (`MODEL@1` .. `MODEL@4`);
- `live x1`: one stream on the live adapter;
- `named x1`: one stream on `MODEL@1`.

Each request asks for MAX_TOKENS greedy tokens of a story (the end token may stop it sooner:
tokens are counted from `usage`). Aggregate tokens/s of a round is its completion tokens over its
wall time; the figures are medians over rounds, and the ratios the goals name: named 4x2 / live
x8 (goal >= 0.8x) and named x1 / live x1 (goal >= 0.95x). Prints them and writes JSON.

Also the server's resident memory serving the live adapter, after each checkpoint is loaded (a
named adapter shares the base's arrays: it should cost about its LoRA weights), and after the
rounds (the mixed passes' side-by-side LoRA arrays).

`--personal` measures the same on personal adapters instead (`MODEL:user1` .. `MODEL:user4`,
pipeline.py `Adapters`: each a fresh LoRA of the model's layout, made by its first request), the
path a team's adapters take.

    python bench/adapters.py [--model tiny|smollm2-135m-instruct] [--rounds 3] [--max-tokens 64]
                             [--personal]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import rlproxy  # noqa: E402,F401  (preloads OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402

from common import proc_memory_mb  # noqa: E402,I001  (bench/: the script dir)
from rlproxy import paths  # noqa: E402
from rlproxy.ops.served import Served  # noqa: E402
from rlproxy.serving.model import load_serving_model, lora_weights, save_adapter  # noqa: E402
from rlproxy.settings import ModelSettings  # noqa: E402

TOPICS = ["a lighthouse", "a river town", "a clockmaker", "a night train", "an old map",
          "a glass blower", "a beekeeper", "a salt marsh"]
GOALS = {"named 4x2 / live x8": 0.8, "named x1 / live x1": 0.95}


def write_checkpoints(model: str, data_dir: Path, steps: int) -> None:
    """STEPS checkpoints in the layout `kept_checkpoint` lists, each a different adapter."""
    loaded = load_serving_model(ModelSettings(model=model), lora_seed=0)
    weights = lora_weights(loaded.model)
    for step in range(1, steps + 1):
        drawn = {k: mx.random.normal(v.shape, key=mx.random.key(100 * step + i)) * 0.01
                 for i, (k, v) in enumerate(sorted(weights.items())) if k.endswith("lora_b")}
        loaded.model.load_weights(list(drawn.items()), strict=False)
        folder = data_dir / paths.CHECKPOINTS / f"step_{step:06d}"
        save_adapter(loaded.model, loaded.lora_config, folder)
        (folder / paths.TRAINER_STATE).write_text(json.dumps({"step": step,
                                                              "adapter_version": step}))


def ask(url: str, model: str, i: int, max_tokens: int) -> int:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
            "messages": [{"role": "user", "content": f"Request {i}: write a long story about "
                          f"{TOPICS[i % len(TOPICS)]}, with many details."}]}
    r = requests.post(url + "/v1/chat/completions", json=body, timeout=900)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


def round_of(url: str, models: list[str], max_tokens: int, first: int) -> dict:
    """One request per entry of MODELS, all at once: aggregate completion tokens/s."""
    tic = time.perf_counter()
    with ThreadPoolExecutor(len(models)) as pool:
        tokens = list(pool.map(lambda a: ask(url, a[1], first + a[0], max_tokens),
                               enumerate(models)))
    wall = time.perf_counter() - tic
    return {"tokens": sum(tokens), "wall_s": wall, "tok_s": sum(tokens) / wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--personal", action="store_true",
                   help="personal adapters MODEL:user1..4 instead of checkpoints MODEL@1..4")
    p.add_argument("--out", type=Path, default=Path("bench/results/adapters.json"))
    a = p.parse_args()
    name = a.model

    def named(step: int) -> str:
        return f"{name}:user{step}" if a.personal else f"{name}@{step}"

    conditions = {"live x8": [name] * 8,
                  "named 4x2": [named(s) for s in (1, 2, 3, 4) for _ in range(2)],
                  "live x1": [name], "named x1": [named(1)]}
    runs: dict[str, list[dict]] = {c: [] for c in conditions}
    with tempfile.TemporaryDirectory(prefix="rlproxy-bench-adapters-") as tmp:
        data = Path(tmp) / "data"
        write_checkpoints(a.model, data, 4)
        with Served(data, "--no-train", "--no-judge", "--log-level", "WARNING", model=a.model,
                    wait_s=600) as server:
            ask(server.url, name, 0, 4)
            rss = [proc_memory_mb(server.proc.pid)["rss_mb"]]
            for step in (1, 2, 3, 4):  # each checkpoint loaded once, before any round
                ask(server.url, named(step), 0, 4)
                rss.append(proc_memory_mb(server.proc.pid)["rss_mb"])
            for r in range(a.rounds):  # alternating: the machine's load hits each alike
                for c, models in conditions.items():
                    runs[c].append(round_of(server.url, models, a.max_tokens, 100 * r))
                    print(f"round {r + 1} {c}: {runs[c][-1]['tok_s']:.1f} tok/s", flush=True)
            health = server.health() or {}
            rss.append(proc_memory_mb(server.proc.pid)["rss_mb"])  # the mixed passes' stacks too
    median = {c: statistics.median(x["tok_s"] for x in v) for c, v in runs.items()}
    ratios = {"named 4x2 / live x8": median["named 4x2"] / median["live x8"],
              "named x1 / live x1": median["named x1"] / median["live x1"]}
    lora_mb = sum(v.nbytes for v in lora_weights(
        load_serving_model(ModelSettings(model=a.model)).model).values()) / 2**20
    memory = {"rss_mb_live_then_each_load": rss[:-1], "rss_mb_after_rounds": rss[-1],
              "per_adapter_mb": [b - a for a, b in zip(rss[:-2], rss[1:-1])],
              "adapter_weights_mb": lora_mb}
    result = {"model": a.model, "rounds": a.rounds, "max_tokens": a.max_tokens,
              "named": "personal" if a.personal else "checkpoints", "runs": runs,
              "memory": memory,
              "median_tok_s": median, "ratios": ratios, "goals": GOALS,
              "met": {k: ratios[k] >= GOALS[k] for k in GOALS},
              "engine": health.get("engine")}
    for c, v in median.items():
        print(f"{c}: {v:.1f} tok/s (median of {a.rounds})")
    print(f"memory: RSS {rss[0]:.0f} MB serving the live adapter; each named adapter loaded "
          f"added {', '.join(f'{x:+.0f}' for x in memory['per_adapter_mb'])} MB (its LoRA "
          f"weights: {lora_mb:.1f} MB); after the rounds {rss[-1]:.0f} MB")
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x (goal >= {GOALS[k]}x: {'met' if result['met'][k] else 'NOT met'})")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
