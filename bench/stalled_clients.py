"""Stalled streaming readers versus normal traffic (issue 24, row 3).

`python bench/stalled_clients.py [--stalled 0 4 16] [--normal 4] [--rounds 5] [--max-tokens 64]
[--serve-arg=--stall-timeout-s=30] [--out bench/results/stalled_clients.json]`

Starts `rlproxy serve --model tiny` as a subprocess (default --max-batch 16 and
--stall-timeout-s 30). For each count of stalled readers it opens that many raw sockets with a
tiny SO_RCVBUF, sends each a streamed chat request with EOS banned (logit_bias) and a huge
max_tokens, and never reads. Then it measures:

- entering: the TTFT of one normal request sent 0.5 s after the stalled ones (they still hold
  the batch then), and how long until the engine has no active sequence left (the stalled
  ones left the batch: `completions.MAX_BACKLOG` steps behind, or the write timeout);
- steady: `--rounds` rounds of `--normal` concurrent streamed requests (`--max-tokens`, EOS
  banned, so every one decodes the same length) while the stalled sockets stay open: TTFT
  (first content chunk) and decode tokens/s per request, medians; the goal is within 1.5x of
  the figures with 0 stalled;
- the server's RSS before the stalled readers, after they left, and at the end.

It owns nothing the server uses; `common.py` gives the environment block and the report.
"""

import rlproxy  # noqa: F401,I001  (first: preloads OpenBLAS before anything imports mlx)

import argparse
import json
import os
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import requests

from common import environment, proc_memory_mb, report
from rlproxy.ops.served import Served

PROMPT = [{"role": "user", "content": "Tell me a long story about the sea."}]
BAN_EOS = {"0": -100, "2": -100}  # the tiny model's end tokens


def stalled_reader(port: int) -> socket.socket:
    """A streamed request that never ends, from a client that never reads its answer."""
    body = json.dumps({"model": "m", "messages": PROMPT, "max_tokens": 100_000, "stream": True,
                       "logit_bias": BAN_EOS}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    s.connect(("127.0.0.1", port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\n"
              b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    return s


def normal_stream(url: str, max_tokens: int) -> dict:
    """One streamed request read as a client does: TTFT and decode tokens/s."""
    t0 = time.perf_counter()
    first, tokens = None, 0
    body = {"model": "m", "messages": PROMPT, "max_tokens": max_tokens, "stream": True,
            "logit_bias": BAN_EOS, "stream_options": {"include_usage": True}}
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
                first = time.perf_counter()
    end = time.perf_counter()
    return {"ttft_s": first - t0, "tokens": tokens,
            "tok_s": (tokens - 1) / (end - first) if end > first else None}


def concurrent(url: str, n: int, max_tokens: int) -> list[dict]:
    out: list[dict] = []
    threads = [threading.Thread(target=lambda: out.append(normal_stream(url, max_tokens)))
               for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def active(url: str) -> int:
    return requests.get(url + "/healthz", timeout=10).json()["engine"]["active"]


def condition(url: str, port: int, pid: int, k: int, args) -> dict:
    rss_before = proc_memory_mb(pid)
    socks = [stalled_reader(port) for _ in range(k)]
    t_open = time.perf_counter()
    time.sleep(0.5)
    entering = normal_stream(url, 16)
    left = None
    while time.perf_counter() - t_open < 120:
        if active(url) == 0:
            left = time.perf_counter() - t_open
            break
        time.sleep(0.1)
    rss_left = proc_memory_mb(pid)
    runs = [r for _ in range(args.rounds) for r in concurrent(url, args.normal, args.max_tokens)]
    for s in socks:
        s.close()
    return {"stalled": k, "entering_ttft_s": entering["ttft_s"], "stalled_left_batch_s": left,
            "ttft_s": statistics.median(r["ttft_s"] for r in runs),
            "tok_s": statistics.median(r["tok_s"] for r in runs),
            "rss_mb": {"before": rss_before, "after_stalled_left": rss_left,
                       "end": proc_memory_mb(pid)}, "runs": runs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stalled", type=int, nargs="+", default=[0, 4, 16])
    p.add_argument("--normal", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--serve-arg", action="append", default=[])
    p.add_argument("--out", type=Path, default=Path("bench/results/stalled_clients.json"))
    args = p.parse_args()
    load_before = os.getloadavg()[0]
    data_dir = Path(tempfile.mkdtemp(prefix="rlproxy-stalled-")) / "data"
    server = Served(data_dir, "--no-judge", *args.serve_arg, log=data_dir / "server.log",
                    memory_gb=8, wait_s=180)
    try:
        concurrent(server.url, args.normal, 8)  # warm up
        results = []
        for k in args.stalled:
            results.append(condition(server.url, server.port, server.proc.pid, k, args))
            print(f"{k:3d} stalled: TTFT {results[-1]['ttft_s'] * 1000:.0f} ms, "
                  f"{results[-1]['tok_s']:.0f} tok/s", flush=True)
    finally:
        exit_code = server.stop(timeout_s=120)
    base = next((r for r in results if r["stalled"] == 0), results[0])
    lines = []
    for r in results:
        ttft_x, toks_x = r["ttft_s"] / base["ttft_s"], base["tok_s"] / r["tok_s"]
        r["vs_0_stalled"] = {"ttft": ttft_x, "tok_s_slowdown": toks_x,
                             "within_1_5x": ttft_x <= 1.5 and toks_x <= 1.5}
        left = r["stalled_left_batch_s"]
        lines.append(
            f"{r['stalled']:3d} stalled: normal TTFT {r['ttft_s'] * 1000:.0f} ms ({ttft_x:.2f}x), "
            f"{r['tok_s']:.0f} tok/s ({toks_x:.2f}x slower); a request sent as they start: "
            f"TTFT {r['entering_ttft_s']:.2f} s; they left the batch after "
            + (f"{left:.1f} s" if left is not None else "never (120 s)")
            + f"; RSS {r['rss_mb']['before']['rss_mb']:.0f} -> "
              f"{r['rss_mb']['end']['rss_mb']:.0f} MB")
    lines.append(f"server exit code after SIGTERM: {exit_code}")
    result = {**environment("tiny", load_before, settings={"serve_args": args.serve_arg}),
              "normal": args.normal, "rounds": args.rounds, "max_tokens": args.max_tokens,
              "conditions": results, "server_exit_code": exit_code}
    report(lines, result, args.out)


if __name__ == "__main__":
    main()
