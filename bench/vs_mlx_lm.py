"""rlproxy against mlx-lm's own server, on the same model directory, side by side in one run.

Starts `rlproxy serve --model DIR` (no training, no judge, no prefix cache) and
`python -m mlx_lm.server --model DIR`, both with OpenBLAS loaded (rlproxy preloads it itself;
mlx_lm.server gets it through LD_PRELOAD), and alternates between them:
- alone: one greedy chat completion at a time, median seconds and completion tok/s;
- concurrent: 8 at once, aggregate completion tok/s of the round.
Every request carries a distinct prompt, so neither server answers from a prompt cache. Ratios
are rlproxy / mlx-lm (above 1: rlproxy faster). Prints one line per figure, writes JSON.

    python bench/vs_mlx_lm.py [--model smollm2-135m-instruct] [--dequantize yes|no]
        [--max-tokens 64] [--rounds 3] [--concurrency 8] [--out bench/results/vs_mlx_lm.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import rlproxy  # noqa: E402,F401  (preloads OpenBLAS)
from rlproxy.ops.served import free_port  # noqa: E402
from rlproxy.serving.blas import blas_in_use  # noqa: E402
from rlproxy.serving.model import resolve_source  # noqa: E402

TOPICS = ["the sea", "a lighthouse", "winter", "a market", "a train", "the moon", "a library",
          "a garden", "a storm", "a bridge", "a river", "the desert", "a city at night"]


def start(command: list[str], env: dict, log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)


def stop_all(procs) -> None:
    """SIGTERM every server, then wait up to 60 s for each; one still running is killed."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_ready(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url} exited:\n{log.read_text()[-2000:]}")
        try:
            if requests.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not start")


def ask(url: str, i: int, max_tokens: int, model: str) -> tuple[float, int]:
    # the directory as the model name: mlx_lm.server would fetch any other name from the hub
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
            "messages": [{"role": "user", "content": f"Request {i}: write a long story about "
                          f"{TOPICS[i % len(TOPICS)]}, with many details."}]}
    t = time.perf_counter()
    r = requests.post(url + "/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - t, r.json()["usage"]["completion_tokens"]


def round_of(url: str, first: int, n: int, max_tokens: int, model: str) -> tuple[float, int]:
    t = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda i: ask(url, i, max_tokens, model),
                                range(first, first + n)))
    return time.perf_counter() - t, sum(tokens for _, tokens in results)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dequantize", default="auto", choices=["auto", "yes", "no"])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--out", default="bench/results/vs_mlx_lm.json")
    a = p.parse_args()
    model_dir = resolve_source(a.model, a.dequantize).path
    blas = blas_in_use()
    if not blas.startswith("openblas"):
        raise SystemExit(f"OpenBLAS is not loaded ({blas}): install libopenblas0-pthread")
    blas_path = blas.split("(", 1)[1].rstrip(")")
    out_dir = Path(a.out).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLPROXY_")}
    ports = {"rlproxy": free_port(), "mlx_lm": free_port()}
    procs = {
        "rlproxy": start([sys.executable, "-m", "rlproxy.cli", "serve", "--model", model_dir,
                          "--port", str(ports["rlproxy"]), "--no-train", "--no-judge",
                          "--no-prefix-cache", "--data-dir", str(out_dir / "vs_mlx_lm_data"),
                          "--log-level", "WARNING"], env, out_dir / "vs_rlproxy.log"),
        "mlx_lm": start([sys.executable, "-m", "mlx_lm.server", "--model", model_dir,
                         "--port", str(ports["mlx_lm"]), "--log-level", "WARNING"],
                        {**env, "LD_PRELOAD": blas_path}, out_dir / "vs_mlx_lm.log"),
    }
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    result = {"model": a.model, "dir": model_dir, "blas": blas, "max_tokens": a.max_tokens,
              "load_before": os.getloadavg()[0], "alone": {}, "concurrent": {}}
    try:
        for name in procs:
            wait_ready(urls[name], procs[name], out_dir / f"vs_{name}.log")
            ask(urls[name], 10_000, 8, model_dir)  # warm up: first-call compilation and allocation
        alone = {name: [] for name in procs}
        rounds = {name: [] for name in procs}
        i = 0
        for _ in range(a.rounds):  # alternate, so load on the machine hits both alike
            for name in procs:
                for _ in range(2):
                    i += 1
                    alone[name].append(ask(urls[name], i, a.max_tokens, model_dir))
            for name in procs:
                rounds[name].append(round_of(urls[name], i + 1, a.concurrency, a.max_tokens,
                                             model_dir))
                i += a.concurrency
        for name in procs:
            s = alone[name]
            result["alone"][name] = {"median_s": statistics.median(t for t, _ in s),
                                     "tok_s": sum(n for _, n in s) / sum(t for t, _ in s),
                                     "runs": s}
            r = rounds[name]
            result["concurrent"][name] = {"tok_s": sum(n for _, n in r) / sum(t for t, _ in r),
                                          "rounds": r}
    finally:
        stop_all(procs.values())
    result["load_after"] = os.getloadavg()[0]
    for kind in ("alone", "concurrent"):
        mine, theirs = result[kind]["rlproxy"]["tok_s"], result[kind]["mlx_lm"]["tok_s"]
        result[kind]["ratio"] = mine / theirs
        print(f"{kind:10s} rlproxy {mine:6.1f} tok/s  mlx_lm.server {theirs:6.1f} tok/s  "
              f"ratio {mine / theirs:.2f}x")
    print(f"model dir {model_dir}; BLAS {blas}; load {result['load_before']:.1f} -> "
          f"{result['load_after']:.1f}")
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
