"""Where a served token's CPU goes: rlproxy against mlx_lm.server, the same adapter, one run.

Starts `rlproxy serve` and `mlx_lm.server` on the same model directory with the same LoRA adapter
(bench/vs_peers.py's `write_adapter`; OpenBLAS in both), then, for each server in turn, streams
`--concurrency` greedy completions of `--max-tokens` tokens at once and reads each of the server's
threads' CPU time from /proc/<pid>/task before and after. It prints CPU microseconds per token:
the whole process, its main thread (rlproxy's event loop: HTTP, text, SSE; mlx_lm.server's
accept loop) and the rest (the engine or generation thread, MLX's and OpenBLAS's threads), and
the round's tokens/s. On a machine whose cores the servers saturate, CPU per token is what bounds
throughput. Linux only (/proc).

    python bench/cpu_account.py [--model tiny] [--concurrency 1 8] [--max-tokens 400]
        [--rounds 2] [--out bench/results/cpu_account.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import requests

from vs_mlx_lm import start, stop_all, wait_ready  # noqa: I001  (bench/: the script dir)
from vs_peers import write_adapter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from rlproxy.ops.served import free_port  # noqa: E402
from rlproxy.serving.blas import blas_in_use  # noqa: E402
from rlproxy.serving.model import resolve_source  # noqa: E402

from common import report  # noqa: E402


def cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of PID, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def stream(url: str, model: str, text: str, max_tokens: int) -> int:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": text}]}
    tokens = 0
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: {") and b'"completion_tokens"' in line:
                tokens = (json.loads(line[6:]).get("usage") or {}).get("completion_tokens", 0)
    return tokens


def account(pid: int, url: str, model: str, concurrency: int, max_tokens: int) -> dict:
    counts = [0] * concurrency

    def one(i: int) -> None:
        counts[i] = stream(url, model, f"Tell me a long story about the sea, number {i}.",
                           max_tokens)
    before, tic = cpu_s(pid), time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, after = time.perf_counter() - tic, cpu_s(pid)
    used = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    tokens = sum(counts)
    main = used.get(pid, 0.0)
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "cpu_us_per_token": sum(used.values()) / tokens * 1e6,
            "main_thread_us_per_token": main / tokens * 1e6,
            "other_threads_us_per_token": (sum(used.values()) - main) / tokens * 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench/results/cpu_account.json"))
    a = p.parse_args()
    model_dir = resolve_source(a.model, "auto").path
    blas = blas_in_use()
    if not blas.startswith("openblas"):
        raise SystemExit(f"OpenBLAS is not loaded ({blas}): install libopenblas0-pthread")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    adapter = write_adapter(a.model, a.out.parent / "cpu_account_adapter")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLPROXY_")}
    env["LD_PRELOAD"] = blas.split("(", 1)[1].rstrip(")")
    ports = {"rlproxy": free_port(), "mlx_lm": free_port()}
    commands = {
        "rlproxy": [sys.executable, "-m", "rlproxy.cli", "serve", "--model", model_dir,
                    "--port", str(ports["rlproxy"]), "--no-train", "--no-judge", "--adapter",
                    str(adapter), "--data-dir", str(a.out.parent / "cpu_account_data"),
                    "--log-level", "WARNING"],
        "mlx_lm": [sys.executable, "-m", "mlx_lm.server", "--model", model_dir, "--port",
                   str(ports["mlx_lm"]), "--adapter-path", str(adapter), "--log-level",
                   "WARNING"]}
    # mlx_lm.server applies --adapter-path only to the model it calls "default_model"
    names = {"rlproxy": model_dir, "mlx_lm": "default_model"}
    logs = {n: a.out.parent / f"cpu_account_{n}.log" for n in commands}
    procs = {n: start(c, env, logs[n]) for n, c in commands.items()}
    urls = {n: f"http://127.0.0.1:{ports[n]}" for n in procs}
    runs: dict = {n: {c: [] for c in a.concurrency} for n in procs}
    try:
        for n in procs:
            wait_ready(urls[n], procs[n], logs[n])
            stream(urls[n], names[n], "warm up", 8)
        for c in a.concurrency:
            for _ in range(a.rounds):  # alternate the servers
                for n in procs:
                    runs[n][c].append(account(procs[n].pid, urls[n], names[n], c,
                                              a.max_tokens))
    finally:
        stop_all(procs.values())
    lines, figures = [], {}
    for c in a.concurrency:
        for n in procs:
            rs = runs[n][c]
            f = {k: sum(r[k] for r in rs) / len(rs) for k in
                 ("tok_s", "cpu_us_per_token", "main_thread_us_per_token",
                  "other_threads_us_per_token")}
            figures[f"{n}_x{c}"] = f
            lines.append(f"{n:8s} x{c:<3d} {f['tok_s']:7.1f} tok/s  CPU a token "
                         f"{f['cpu_us_per_token']:6.0f} us: main thread "
                         f"{f['main_thread_us_per_token']:5.0f} us, the rest "
                         f"{f['other_threads_us_per_token']:6.0f} us")
    result = {"model": a.model, "dir": model_dir, "blas": blas, "cores": os.cpu_count(),
              "max_tokens": a.max_tokens, "rounds": a.rounds, "figures": figures, "runs": runs}
    report(lines, result, a.out)


if __name__ == "__main__":
    main()
