"""Remote learner benchmark: `--trainer tinker` (a replica training on an rlproxy learner over the
Tinker API) against the in-process trainer, on the same turns.

Two phases on the embedded model, each with its own `rlproxy serve` subprocesses and data dirs:
  local   one server that trains itself (the default `--trainer local`);
  remote  a learner (`--no-train`: it only answers the Tinker API) and a replica
          (`--trainer tinker --tinker-url LEARNER --tinker-run bench-...`).
Both train with a verifiable reward function (no judge), `--baseline none`, `--batch-size B`.
On a multi-core Linux box the learner is pinned to other cores than the serving process
(`taskset`), as if it were another machine; the serving process gets the same cores in both
phases.

Each round, on the serving process: TTFT of short streamed requests opted out of training
(`X-RL-Train: 0`) while idle; then B one-turn sessions with fixed prompts and seeds (the same
turns in both phases) are ended (released) and short requests keep coming until /healthz shows a
new adapter version: TTFT while the step and its sync/swap happen, and the time from the release
to the new version being served. From training.jsonl: each step's time and the swap pause the
engine reported (`previous_swap_pause_ms`). From the replica's /healthz: bytes and seconds of
each weights sync.

    python bench/remote_learner.py [--rounds 6] [--batch-size 2] [--model smollm2-135m-instruct]
                                   [--out bench/results/remote_learner.json]
"""

import rlproxy  # noqa: F401, I001  (first: preloads OpenBLAS before anything imports mlx)

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import openai
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, percentile, report  # noqa: E402
from rlproxy.ops.served import Served  # noqa: E402

REWARD = '''
def reward(turn, next_state):
    """Share of even token ids in the completion, less 0.317: verifiable, varied, never 0 (a
    batch whose rewards are all 0 takes no step under --baseline none)."""
    ids = turn["choices"][turn.get("chosen_choice", 0)]["completion_ids"]
    return sum(i % 2 == 0 for i in ids) / max(1, len(ids)) - 0.317
'''
KEY = "tml-bench"


def pinned(cores: str | None) -> list[str]:
    return ["taskset", "-c", cores] if cores and shutil.which("taskset") else []


def serve(root: Path, name: str, flags: list[str], cores: str | None, model: str) -> Served:
    """`rlproxy serve` NAME (its data dir ROOT/NAME; pinned to CORES), once healthy."""
    return Served(root / name, "--no-fsync", *flags, model=model, log=root / name / "server.log",
                  python_path=(root,), env={"TINKER_API_KEY": KEY, "TINKER_TELEMETRY": "0"},
                  memory_gb=12, wrap=pinned(cores), wait_s=600)


def ttft(client: openai.OpenAI, n: int) -> float:
    """Seconds to the first streamed token of a short request kept out of training."""
    tic = time.perf_counter()
    stream = client.chat.completions.create(
        model="m", max_tokens=4, stream=True, temperature=0.0,
        messages=[{"role": "user", "content": f"Say one word. ({n})"}],
        extra_headers={"X-RL-Train": "0"})
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - tic
    return first if first is not None else time.perf_counter() - tic


def release_batch(server: Served, rnd: int, batch: int) -> None:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    for i in range(batch):
        sid = f"round{rnd}-turn{i}"
        c.chat.completions.create(
            model="m", max_tokens=24, seed=1000 * rnd + i, temperature=1.0,
            messages=[{"role": "user", "content": f"Write a short list of numbers ({rnd}, {i})."}],
            extra_headers={"X-Session-Id": sid})
    for i in range(batch):  # ended together: released to the trainer now
        requests.post(f"{server.url}/v1/sessions/round{rnd}-turn{i}/end",
                      timeout=60).raise_for_status()


def phase(server: Served, replica: bool, rounds: int, batch: int) -> dict:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    for n in range(3):  # warm the path
        ttft(c, -1 - n)
    idle, busy, served, syncs = [], [], [], []
    for rnd in range(rounds):
        idle += [ttft(c, rnd * 100 + k) for k in range(5)]
        v0 = server.health(30)["adapter_version"]
        release_batch(server, rnd, batch)
        t0, k = time.perf_counter(), 0
        while server.health(30)["adapter_version"] == v0:
            busy.append(ttft(c, rnd * 100 + 50 + k))
            k += 1
            if time.perf_counter() - t0 > 300:
                raise RuntimeError(f"no new version in 300 s: {server.health(30)['trainer']}")
        served.append(time.perf_counter() - t0)
        if replica:
            t = server.health(30)["trainer"]
            syncs.append({"bytes": t["last_sync_bytes"], "seconds": t["last_sync_s"]})
    lines = [json.loads(x) for x in (server.data_dir / "training.jsonl").read_text().splitlines()]
    steps = [ln for ln in lines if ln["kind"] == "step"]
    pauses = [ln["previous_swap_pause_ms"] for ln in steps[1:]
              if ln.get("previous_swap_pause_ms") is not None]
    med = statistics.median
    return {
        "steps": len(steps), "step_time_s": [ln["step_time_s"] for ln in steps],
        "step_time_s_median": med(ln["step_time_s"] for ln in steps),
        "release_to_served_s": served, "release_to_served_s_median": med(served),
        "ttft_idle_s": idle, "ttft_idle_p50_s": med(idle),
        "ttft_training_s": busy, "ttft_training_p50_s": med(busy) if busy else None,
        "ttft_training_p95_s": percentile(busy, 95) if busy else None,
        "swap_pause_ms": pauses, "swap_pause_ms_max": max(pauses) if pauses else None,
        "syncs": syncs,
        "reward_mean": [ln["reward_mean"] for ln in steps],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", type=Path, default=Path("bench/results/remote_learner.json"))
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    cpus = os.cpu_count() or 1
    serve_cores = "0" if cpus >= 2 else None
    learner_cores = f"1-{cpus - 1}" if cpus >= 2 else None
    common = ["--no-judge", "--reward-function", "bench_reward:reward", "--baseline", "none",
              "--batch-size", str(args.batch_size), "--no-at-least-one", "--save-interval",
              "1000", "--learning-rate", "1e-4", "--no-prefix-cache"]
    root = Path(tempfile.mkdtemp(prefix="rlproxy-bench-remote-"))
    (root / "bench_reward.py").write_text(REWARD)
    result = {}
    try:
        local = serve(root, "local", common, serve_cores, args.model)
        try:
            result["local"] = phase(local, False, args.rounds, args.batch_size)
        finally:
            local.stop(timeout_s=120)
        learner = serve(root, "learner", ["--no-train"], learner_cores, args.model)
        try:
            replica = serve(root, "replica", [
                *common, "--trainer", "tinker", "--tinker-url", learner.url, "--tinker-run",
                f"bench-{int(time.time())}"], serve_cores, args.model)
            try:
                result["remote"] = phase(replica, True, args.rounds, args.batch_size)
            finally:
                replica.stop(timeout_s=120)
        finally:
            learner.stop(timeout_s=120)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    lo, re = result["local"], result["remote"]
    sync_s = [s["seconds"] for s in re["syncs"]]
    sync_b = [s["bytes"] for s in re["syncs"]]
    result["ratios"] = {
        "step_time_remote_over_local": re["step_time_s_median"] / lo["step_time_s_median"],
        "release_to_served_remote_over_local":
            re["release_to_served_s_median"] / lo["release_to_served_s_median"],
        "ttft_training_over_idle_local": lo["ttft_training_p50_s"] / lo["ttft_idle_p50_s"],
        "ttft_training_over_idle_remote": re["ttft_training_p50_s"] / re["ttft_idle_p50_s"],
    }
    result["environment"] = environment(args.model, load_before, settings={
        "rounds": args.rounds, "batch_size": args.batch_size, "serve_cores": serve_cores,
        "learner_cores": learner_cores})
    r = result["ratios"]
    lines = [
        f"step time (median): local {lo['step_time_s_median']:.3f} s, remote "
        f"{re['step_time_s_median']:.3f} s ({r['step_time_remote_over_local']:.2f}x)",
        f"release -> new version served (median): local {lo['release_to_served_s_median']:.3f}"
        f" s, remote {re['release_to_served_s_median']:.3f} s "
        f"({r['release_to_served_remote_over_local']:.2f}x)",
        f"weights sync: {statistics.median(sync_b) / 1e6:.2f} MB, median "
        f"{statistics.median(sync_s) * 1000:.0f} ms, max {max(sync_s) * 1000:.0f} ms",
        f"swap pause max: local {lo['swap_pause_ms_max']} ms, remote {re['swap_pause_ms_max']} ms",
        f"TTFT p50 idle -> during training: local {lo['ttft_idle_p50_s'] * 1000:.0f} -> "
        f"{lo['ttft_training_p50_s'] * 1000:.0f} ms ({r['ttft_training_over_idle_local']:.2f}x), "
        f"remote {re['ttft_idle_p50_s'] * 1000:.0f} -> {re['ttft_training_p50_s'] * 1000:.0f} ms "
        f"({r['ttft_training_over_idle_remote']:.2f}x)",
    ]
    report(lines, result, args.out)


if __name__ == "__main__":
    main()
