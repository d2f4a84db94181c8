"""Data-parallel training on 1 and 2 ranks (mlx.launch --backend ring), side by side in one run.

    python bench/distributed.py [--turns 8] [--tokens 15000] [--reps 2] [--model tiny]
                                [--link-gbps 10 40 80] [--out bench/results/distributed.json]

Each configuration is the real learner: one process with training/learner.py's LocalLearner,
then `mlx.launch -n 2` with rank 0's ParallelLearner and rank 1 running training/distributed.py's
`work`, the code `rlproxy serve` and `rlproxy train --from` run under a launch. The batch is
TURNS agent-shaped turns of TOKENS tokens each (the bench's agent workload, bench/
agent_workload.py: system prompt, 20 tool schemas, tool calls and results; the last 256 tokens
trained as the completion with advantages of +-1). Reported per configuration: step time
(forward_backward + optim_step, median of REPS after one warm-up step) and tokens/s; for 2 ranks
the bytes all-reduced per step (the gradient sum), the bytes of messages rank 0 sent (the
shard, over TCP), and the time of a bare all_sum of the gradient's size between the two ranks,
as a share of the step.

On a 2-core machine two ranks share the cores, so they cannot be faster; the projection to two
Macs takes the measured 1-rank compute, halves it (each Mac computes half the tokens), and adds
the bytes that cross the link at each stated speed (a 2-rank ring sum moves each gradient byte
once each way; the shard goes once) plus a stated latency per step.
"""

import rlproxy  # noqa: I001  (first: preloads OpenBLAS before anything imports mlx)

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from agent_workload import SYSTEM_PROMPT, TOOLS, tool_call, tool_result
from common import environment, report
from rlproxy.ops.served import free_ports

COMPLETION = 256


def agent_ids(tokenizer, n: int, seed: int) -> list[int]:
    """N token ids of an agent-shaped conversation (different per SEED)."""
    rng = random.Random(seed)
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"task {seed}: fix the pagination bug"}]
    text = json.dumps(TOOLS)
    ids: list[int] = []
    step = 0
    while len(ids) < n:
        call = tool_call(step, f"call_{seed}_{step}", rng)
        messages += [{"role": "assistant", "content": json.dumps(call)},
                     {"role": "tool", "content": tool_result(step, rng)}]
        step += 1
        ids = tokenizer.encode(text + "\n".join(str(m["content"]) for m in messages))
    return ids[:n]


def examples(tokenizer, turns: int, tokens: int) -> list[dict]:
    out = []
    for i in range(turns):
        ids = agent_ids(tokenizer, tokens, i)
        lo = tokens - COMPLETION - 1
        pad = [0.0] * lo
        out.append({"ids": ids, "old": pad + [-1.0] * COMPLETION,
                    "adv": pad + [1.0 if i % 2 else -1.0] * COMPLETION,
                    "mask": pad + [1.0] * COMPLETION, "tokens": COMPLETION,
                    "uids": [f"t{i}"], "rewards": [0.0], "staleness": [0]})
    return out


def run_rank(args) -> None:
    """One configuration's ranks (this process is one of them): time the steps on rank 0."""
    from mlx.utils import tree_flatten

    from rlproxy.serving.model import load_serving_model
    from rlproxy.settings import load_settings
    from rlproxy.training import distributed
    from rlproxy.training.learner import LocalLearner, training_copy

    settings = load_settings({"model": args.model, "train_seed": 0, "data_dir": tempfile.mkdtemp(),
                              "distributed_timeout_s": 3600}, environ={})
    group = distributed.group()
    loaded = load_serving_model(settings.model, lora_seed=0)
    model = training_copy(loaded)
    n_params = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    bare = link = None
    if group is not None:  # a bare all_sum of the gradient's size, before the learner's protocol
        x = mx.zeros((n_params,))  # the gradient
        times = []
        for _ in range(5):
            tic = time.perf_counter()
            mx.eval(mx.distributed.all_sum(x, group=group))
            times.append(time.perf_counter() - tic)
        bare = statistics.median(times[1:])
        if group.rank() != 0:
            distributed.work(settings, distributed.Link(group, None))
            return
        link = distributed.join(settings)
    path = Path(settings.records.data_dir) / "checkpoints"
    learner = (LocalLearner(settings, model, loaded.lora_config, path) if link is None else
               distributed.ParallelLearner(settings, model, loaded.lora_config, path, None, link))
    batch = examples(loaded.tokenizer, args.turns, args.tokens)
    steps = []
    for rep in range(args.reps + 1):
        before = (link.reduced_bytes, link.sent_bytes) if link else (0, 0)
        tic = time.perf_counter()
        learner.forward_backward(batch, between=lambda _s: None)
        learner.optim_step(1e-5)
        steps.append({"s": time.perf_counter() - tic,
                      "reduced_bytes": (link.reduced_bytes - before[0]) if link else 0,
                      "sent_bytes": (link.sent_bytes - before[1]) if link else 0})
    if link is not None:
        distributed.leave(link)
    timed = steps[1:]  # the first compiles and warms the caches
    step_s = statistics.median(s["s"] for s in timed)
    tokens = args.turns * args.tokens
    print("RESULT " + json.dumps({
        "ranks": group.size() if group else 1, "step_s": step_s, "tokens_per_s": tokens / step_s,
        "steps_s": [s["s"] for s in steps], "lora_parameters": n_params,
        "gradient_bytes": n_params * 4, "reduced_bytes_per_step": timed[-1]["reduced_bytes"],
        "sent_bytes_per_step": timed[-1]["sent_bytes"],
        "bare_all_sum_s": bare}), flush=True)


def measure(args, ranks: int) -> dict:
    me = [sys.executable, str(Path(__file__).resolve()), "--rank", "--turns", str(args.turns),
          "--tokens", str(args.tokens), "--reps", str(args.reps), "--model", args.model]
    if ranks > 1:
        me = [shutil.which("mlx.launch"), "--backend", "ring", "-n", str(ranks),
              "--starting-port", str(free_ports(ranks)), "--", *me]
    out = subprocess.run(me, capture_output=True, text=True, timeout=3600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{ranks} rank(s) gave no result:\n{out.stdout[-3000:]}\n"
                         f"{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--tokens", type=int, default=15000)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--model", default="tiny")
    p.add_argument("--link-gbps", type=float, nargs="+", default=[10.0, 40.0, 80.0])
    p.add_argument("--link-latency-ms", type=float, default=1.0,
                   help="added per step to the projection (the sum and the messages' round trips)")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=Path("bench/results/distributed.json"))
    args = p.parse_args()
    if args.rank:
        return run_rank(args)
    load = os.getloadavg()[0]
    one, two = measure(args, 1), measure(args, 2)
    grad = two["gradient_bytes"]
    share = two["bare_all_sum_s"] / two["step_s"]
    projected = {}
    moved = grad + two["sent_bytes_per_step"]  # the sum crosses each way once; the shard once
    for gbps in args.link_gbps:  # compute halves
        comm = moved / (gbps * 1e9 / 8) + args.link_latency_ms / 1e3
        step = one["step_s"] / 2 + comm
        projected[f"{gbps:g} Gb/s"] = {"step_s": step, "communication_share": comm / step,
                                       "speedup_vs_1_rank": one["step_s"] / step}
    lines = [
        f"batch: {args.turns} turns x {args.tokens} tokens, model {args.model}, "
        f"{one['lora_parameters']:,} LoRA parameters",
        f"1 rank : step {one['step_s']:.2f} s, {one['tokens_per_s']:.0f} tokens/s",
        f"2 ranks: step {two['step_s']:.2f} s, {two['tokens_per_s']:.0f} tokens/s "
        f"({one['step_s'] / two['step_s']:.2f}x; both ranks share this machine's cores)",
        f"per step: {two['reduced_bytes_per_step']:,} bytes all-reduced (the gradient), "
        f"{two['sent_bytes_per_step']:,} bytes of messages from rank 0 (rank 1's shard: token "
        f"ids and per-token lists)",
        f"bare all_sum of the gradient between the 2 local ranks: "
        f"{two['bare_all_sum_s'] * 1e3:.2f} ms = {share:.4%} of the 2-rank step",
        *[f"projected, two such machines over {k}: step {v['step_s']:.2f} s, communication "
          f"{v['communication_share']:.4%}, {v['speedup_vs_1_rank']:.2f}x one"
          for k, v in projected.items()],
    ]
    report(lines, {**environment(args.model, load), "one_rank": one, "two_ranks": two,
                   "projected": projected, "turns": args.turns, "tokens": args.tokens,
                   "link_latency_ms": args.link_latency_ms},
           args.out)


if __name__ == "__main__":
    main()
