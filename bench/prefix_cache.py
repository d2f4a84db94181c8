"""Prefix cache benchmark: time to first token of a session's turn N, cold and warm.

One multi-turn session whose turn N prompt is ~2,000 tokens (a long system prompt, then N-1
turns of user messages and the model's own replies), served by the real aiohttp app over HTTP on
127.0.0.1, streaming. Time to first token (TTFT) = from sending the request to the first chunk
that carries a token. Three ways, each on a fresh app over the same data directory:

1. cold: `--no-prefix-cache`: the whole prompt is prefilled;
2. warm in memory: the server that just served turns 1..N-1: turn N restores turn N-1's prompt
   + reply from the in-memory LRU and prefills only the new user message;
3. warm from disk: a new app (empty memory LRU) per measurement over the same data directory:
   the same restore, read from the diskcache files (the OS page cache may hold them).

Every measurement has a last user message of its own, so it restores turn N-1's entry (prompt +
reply), not an earlier measurement's. Requests opt out of recording (X-RL-Opt-Out), so no judge runs
meanwhile. Medians; the ratio cold / warm-from-disk is checked against the goal.

    python bench/prefix_cache.py [--size tiny|small] [--turn 4] [--prompt-tokens 2000]
                                 [--repeats 5] [--out bench/results/prefix_cache.json]
"""

import rlproxy  # noqa: F401, I001  (first: preloads OpenBLAS before anything imports mlx)

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from common import environment, report, start_server
from rlproxy.serving.model import LoadedModel, load_serving_model
from rlproxy.settings import load_settings

GOAL = 10.0  # cold TTFT / warm-from-disk TTFT, at least
HEADERS = {"X-Session-Id": "bench-prefix-cache", "X-RL-Opt-Out": "1"}

PARAGRAPH = """\
You are Hermes, an autonomous software engineering agent running inside a developer's terminal.
Read the code before you change it, keep the style of the file you edit, run the tests after
every change, and say what you changed and why. Never delete files or push without being asked.
"""
USER_TURNS = [
    "The endpoint GET /items?page=2 returns the same items as page 1. Find out why.",
    "Show me the handler and the SQL query it runs.",
    "Fix the offset computation and add a test that would have caught it.",
    "Run the whole test suite and tell me what failed.",
    "Now update the changelog and summarise the change in two sentences.",
    "Check the other paginated endpoints for the same mistake.",
]


async def ttft(http: aiohttp.ClientSession, url: str, messages: list[dict],
               max_tokens: int) -> dict:
    """Stream one request: seconds to the first token, its reply text and usage."""
    body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "logprobs": True, "stream_options": {"include_usage": True}}
    tic = time.perf_counter()
    first, text, usage = None, "", None
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=HEADERS) as resp:
        if resp.status != 200:
            raise RuntimeError(f"proxy answered {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                if first is None and (choice["delta"].get("content") or choice.get("logprobs")):
                    first = time.perf_counter() - tic  # the first chunk carrying a token
                text += choice["delta"].get("content") or ""
    return {"ttft_s": first, "text": text, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


async def health(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(f"{url}/healthz") as resp:
        return (await resp.json())["prefix_cache"]


def system_prompt(loaded: LoadedModel, turn: int, target: int) -> str:
    """A system prompt long enough that turn `turn`'s templated prompt is ~target tokens."""
    history = [{"role": "user", "content": USER_TURNS[0]}, {"role": "assistant", "content": "x"}]
    per_turn = len(loaded.tokenizer.apply_chat_template(history)) + 48  # + a reply's tokens
    para = len(loaded.tokenizer.encode(PARAGRAPH, add_special_tokens=False))
    return PARAGRAPH * max(1, (target - per_turn * turn) // para)


async def warm_up(http: aiohttp.ClientSession, url: str) -> None:
    # A short, unrelated request: first-request costs land here, not in a measurement.
    await ttft(http, url, [{"role": "user", "content": "hello"}], 2)


async def run(args: argparse.Namespace) -> dict:
    load_before = os.getloadavg()[0]
    data_dir = Path(args.data_dir or tempfile.mkdtemp(prefix="rlproxy-bench-"))
    flags = {"model": args.size, "data_dir": str(data_dir)}
    settings = load_settings(flags, environ={})
    cold_settings = load_settings({**flags, "prefix_cache": False,
                                   "data_dir": str(data_dir / "cold")}, environ={})
    loaded = load_serving_model(settings.model)
    system = system_prompt(loaded, args.turn, args.prompt_tokens)
    messages = [{"role": "system", "content": system}]

    def turn_n(i: int) -> list[dict]:  # measurement i's own variant of turn N
        return messages + [{"role": "user", "content": f"({i + 1}) {USER_TURNS[args.turn - 1]}"}]

    async with aiohttp.ClientSession() as http:
        # Turns 1..N-1 for real, then warm-in-memory turn N on that same server.
        runner, url = await start_server(settings, loaded)
        try:
            await warm_up(http, url)
            for t in range(args.turn - 1):
                messages.append({"role": "user", "content": USER_TURNS[t]})
                reply = await ttft(http, url, messages, args.reply_tokens)
                messages.append({"role": "assistant", "content": reply["text"]})
            memory = [await ttft(http, url, turn_n(i), 1) for i in range(args.repeats)]
            stats_memory = await health(http, url)
        finally:
            await runner.cleanup()  # flushes the store to disk
        disk, stats_disk = [], []
        for i in range(args.repeats):  # a new app each time: empty memory, same directory
            runner, url = await start_server(settings, loaded)
            try:
                await warm_up(http, url)
                before = await health(http, url)
                disk.append(await ttft(http, url, turn_n(args.repeats + i), 1))
                after = await health(http, url)
                stats_disk.append({k: after[k] - before[k] for k in ("disk_hits", "memory_hits")})
            finally:
                await runner.cleanup()
        runner, url = await start_server(cold_settings, loaded)
        try:
            await warm_up(http, url)
            cold = [await ttft(http, url, turn_n(2 * args.repeats + i), 1)
                    for i in range(args.repeats)]
        finally:
            await runner.cleanup()

    def summary(runs: list[dict]) -> dict:
        return {"ttft_median_s": statistics.median(r["ttft_s"] for r in runs),
                "ttft_min_s": min(r["ttft_s"] for r in runs),
                "prompt_tokens": runs[0]["prompt_tokens"],
                "cached_tokens": [r["cached_tokens"] for r in runs],
                "runs_s": [r["ttft_s"] for r in runs]}

    result = {"cold": summary(cold), "warm_memory": summary(memory), "warm_disk": summary(disk)}
    if any(s["disk_hits"] != 1 or s["memory_hits"] != 0 for s in stats_disk):
        raise RuntimeError(f"a warm-from-disk measurement was not one disk hit: {stats_disk}")
    if any(r["cached_tokens"] == 0 for r in memory + disk) or any(r["cached_tokens"] for r in cold):
        raise RuntimeError("cached_tokens says a measurement did not run as labelled")
    cold_s = result["cold"]["ttft_median_s"]
    return {
        **environment(args.size, load_before, loaded.model_id),
        "turn": args.turn,
        "data_dir": str(data_dir),
        **result,
        "ratio_cold_over_warm_memory": cold_s / result["warm_memory"]["ttft_median_s"],
        "ratio_cold_over_warm_disk": cold_s / result["warm_disk"]["ttft_median_s"],
        "goal_ratio_at_least": GOAL,
        "met": cold_s / result["warm_disk"]["ttft_median_s"] >= GOAL,
        "store_after_session": stats_memory,
    }


def summary_lines(r: dict) -> list[str]:
    load = r["machine"]["load_average_1m"]
    lines = [
        f"machine: {r['machine']['cpus']} CPUs, 1-min load average {load['before']:.2f} before, "
        f"{load['after']:.2f} after; model: embedded {r['size']} ({r['model_id']}), "
        f"BLAS: {r['blas']}, mlx {r['mlx_version']}, mlx-lm {r['mlx_lm_version']}",
        f"turn {r['turn']} of a session: {r['cold']['prompt_tokens']} prompt tokens",
    ]
    for name in ("cold", "warm_memory", "warm_disk"):
        s = r[name]
        lines.append(f"  {name:12s} TTFT median {s['ttft_median_s'] * 1000:8.1f} ms "
                     f"(min {s['ttft_min_s'] * 1000:.1f}, {len(s['runs_s'])} runs), "
                     f"cached tokens {s['cached_tokens'][0]}")
    verdict = "met" if r["met"] else "NOT met"
    lines.append(f"cold / warm in memory: {r['ratio_cold_over_warm_memory']:.1f}x; cold / warm "
                 f"from disk: {r['ratio_cold_over_warm_disk']:.1f}x (goal >= {GOAL:.0f}x: "
                 f"{verdict})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--turn", type=int, default=4, choices=range(2, len(USER_TURNS) + 1),
                        help="the turn measured (N)")
    parser.add_argument("--prompt-tokens", type=int, default=2000, help="turn N's prompt, about")
    parser.add_argument("--reply-tokens", type=int, default=48, help="earlier turns' replies")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--data-dir", help="default: a fresh temporary directory")
    parser.add_argument("--out", type=Path, default=Path("bench/results/prefix_cache.json"))
    args = parser.parse_args()
    result = asyncio.run(run(args))
    report(summary_lines(result), result, args.out)


if __name__ == "__main__":
    main()
