"""Judge benchmark: what a busy local judge costs live traffic, and what `judge_yield_ms` buys.

Starts two copies of the real proxy in one process on 127.0.0.1 (create_app, port 0), alike but
for `judge_yield_ms` (the default 20, and 0: no yielding), both with `train=False` and the local
judge (an adapter-free base model copy on its own thread). It measures one live request at a
time: the end-to-end time of a greedy non-streaming chat completion, and the time to first token
of the same request streamed. Three conditions, alternated round by round:

  idle      no turn waits to be scored (yield 20; the yield does nothing while the judge is idle)
  busy      the local judge is generating votes (prm_m=3, prm_max_tokens=256), yield 20
  busy-y0   the same with judge_yield_ms=0

The judge is kept busy by finished multi-turn header sessions (each a few short requests, the
last with X-Session-Done) fed *between* samples, never during one, so the only difference
between the conditions while a sample runs is the judge. /healthz proves the state of every
sample: backlog = feeder turns finished - turns scored must be 0 before and after an idle
sample (nothing scored meanwhile) and > 0 after a busy one (the backlog only shrinks while the
feeder rests, so it was > 0 throughout). Between blocks each server's backlog is drained, so the
other server's judge is idle too. Measured requests are ordinary session-less main turns: they
never get a next state during the run, so they add no judge work.

Prints p50/p95 per condition and the ratios busy/idle, and writes every sample to a JSON file.
It measures; it changes nothing in rlproxy.

    python bench/judge.py [--size tiny|small] [--out bench/results/judge.json]
"""

import rlproxy  # noqa: F401, I001  (first: preloads OpenBLAS before anything imports mlx)

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import aiohttp

from common import environment, percentile, report, start_server
from rlproxy.settings import load_settings
from serve import agent_messages, chat, chat_body, settle

YIELD_MS = 20.0  # the default judge_yield_ms
CONDITIONS = ("idle", "busy", "busy-y0")
FEED_TURNS = 3  # requests per feeder session: FEED_TURNS - 1 turns with a next state to judge
FEED_MAX_TOKENS = 8  # feeder requests are short: their engine time is not what is measured
FEED_REQUEST = "List the files in the repository and tell me which one defines the HTTP routes."
FEED_FOLLOW_UPS = [
    "Thanks. Now open that file and show me the handler for GET /items.",
    "That worked, the test passes now. Please also update the changelog.",
    "Good, that is all for today.",
]


# ---- one measured sample: the same request, non-streaming then streaming ----


async def first_token(http: aiohttp.ClientSession, url: str, body: dict) -> dict:
    """Stream `body`; seconds to the first chunk that carries a token, and to the end.

    The first chunk (role, empty content) goes out before any token is sampled, and text that
    may start a tool-call marker is held back, so the first *token* is found by its logprobs,
    which ride on the chunk of every sampled token."""
    tic = time.perf_counter()
    ttft, chunks = None, 0
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"proxy answered {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunks += 1
            choices = json.loads(line[6:])["choices"]
            if ttft is None and choices and choices[0].get("logprobs"):
                ttft = time.perf_counter() - tic
    if ttft is None:
        raise RuntimeError("the stream carried no token")
    return {"ttft_s": ttft, "stream_total_s": time.perf_counter() - tic, "chunks": chunks}


async def sample(http: aiohttp.ClientSession, url: str, max_tokens: int) -> dict:
    body = chat_body(agent_messages(), max_tokens, temperature=0.0)
    seconds, data = await chat(http, url, body)
    await settle()
    streamed = await first_token(http, url, {**body, "stream": True, "logprobs": True})
    await settle()
    return {"e2e_s": seconds, "completion_tokens": data["usage"]["completion_tokens"],
            "prompt_tokens": data["usage"]["prompt_tokens"], **streamed}


# ---- keeping the judge busy, and proving it via /healthz ----


class Server:
    """One running proxy, and how many turns the feeder has finished on it."""

    def __init__(self, name: str, runner, url: str, settings):
        self.name, self.runner, self.url, self.settings = name, runner, url, settings
        self.fed = 0  # feeder turns handed to the scorer (each session's turns, once it ends)
        self.sessions = 0

    async def scoring(self, http: aiohttp.ClientSession) -> dict:
        async with http.get(f"{self.url}/healthz") as resp:
            health = await resp.json()
        s = health["scoring"]
        if health["status"] != "ok" or s["outages"] or s["waiting"]:
            raise RuntimeError(f"{self.name}: the proxy or its judge is unwell: {health}")
        return {"scored": s["scored"], "backlog": self.fed - s["scored"],
                "engine_active": health["engine"]["active"]}

    async def feed_session(self, http: aiohttp.ClientSession) -> None:
        """One finished header session: FEED_TURNS main turns, all but the last with a next
        state (the next request's new user message)."""
        sid = f"bench-feed-{self.name}-{self.sessions}"
        self.sessions += 1
        messages = [{"role": "user", "content": FEED_REQUEST}]
        for i in range(FEED_TURNS):
            headers = {"X-Session-Id": sid}
            if i == FEED_TURNS - 1:
                headers["X-Session-Done"] = "true"
            body = chat_body(messages, FEED_MAX_TOKENS, temperature=1.0, seed=self.sessions)
            async with http.post(f"{self.url}/v1/chat/completions", json=body,
                                 headers=headers) as resp:
                data = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"feeder request answered {resp.status}: {data}")
            reply = data["choices"][0]["message"]
            messages += [{"role": "assistant", "content": reply["content"] or ""},
                         {"role": "user", "content": FEED_FOLLOW_UPS[i]}]
        self.fed += FEED_TURNS

    async def top_up(self, http: aiohttp.ClientSession, backlog: int) -> None:
        while (await self.scoring(http))["backlog"] < backlog:
            await self.feed_session(http)
        await settle()  # the feeder's last request has left the engine

    async def drain(self, http: aiohttp.ClientSession, timeout_s: float) -> float:
        tic = time.perf_counter()
        while (await self.scoring(http))["backlog"] > 0:
            if time.perf_counter() - tic > timeout_s:
                raise RuntimeError(f"{self.name}: the judge did not finish its backlog in "
                                   f"{timeout_s:.0f} s; lower --backlog")
            await asyncio.sleep(0.1)
        return time.perf_counter() - tic


async def measure(http, server: Server, condition: str, round_: int, args) -> dict:
    if condition != "idle":
        await server.top_up(http, args.backlog)
    before = await server.scoring(http)
    result = await sample(http, server.url, args.max_tokens)
    after = await server.scoring(http)
    if condition == "idle":
        ok = before["backlog"] == after["backlog"] == 0 and before["scored"] == after["scored"]
    else:  # no feeding during the sample: a backlog left at its end was there throughout
        ok = after["backlog"] > 0
    if not ok:
        raise RuntimeError(f"{condition} sample not in its condition: before {before}, after "
                           f"{after}; raise --backlog")
    return {"condition": condition, "server": server.name, "round": round_, **result,
            "backlog_before": before["backlog"], "backlog_after": after["backlog"],
            "scored_during": after["scored"] - before["scored"]}


# ---- the run ----


def summarize(samples: list[dict]) -> dict:
    out = {}
    for c in CONDITIONS:
        rows = [s for s in samples if s["condition"] == c]
        tokens = sorted({s["completion_tokens"] for s in rows})
        out[c] = {"n": len(rows), "completion_tokens": tokens}
        for key in ("e2e_s", "ttft_s"):
            xs = [s[key] for s in rows]
            out[c][key] = {"p50": percentile(xs, 50), "p95": percentile(xs, 95),
                           "min": min(xs), "max": max(xs)}
    for c in CONDITIONS[1:]:
        out[c]["ratio_to_idle"] = {
            key: {p: out[c][key][p] / out["idle"][key][p] for p in ("p50", "p95")}
            for key in ("e2e_s", "ttft_s")}
    return out


async def alternate(servers: dict[str, Server], args) -> tuple[list, list, list]:
    """Rounds of: idle block, busy block (yield), drain, busy block (no yield), drain."""
    plan = [("idle", servers["yield"]), ("busy", servers["yield"]),
            ("busy-y0", servers["no-yield"])]
    samples, drains, blocks = [], [], []
    async with aiohttp.ClientSession() as http:
        for server in servers.values():  # warm-up: compile, fill the prefix cache, judge once
            await sample(http, server.url, args.max_tokens)
            await server.feed_session(http)
            await server.drain(http, args.drain_timeout_s)
        for round_ in range(args.rounds):
            for condition, server in plan:
                start = (await server.scoring(http))["scored"]
                tic = time.perf_counter()
                for _ in range(args.samples):
                    samples.append(await measure(http, server, condition, round_, args))
                blocks.append({"condition": condition, "round": round_,
                               "seconds": time.perf_counter() - tic,
                               "turns_scored": (await server.scoring(http))["scored"] - start})
                if condition != "idle":
                    drains.append(await server.drain(http, args.drain_timeout_s))
    return samples, drains, blocks


async def run(args: argparse.Namespace) -> dict:
    load_before = os.getloadavg()[0]
    tic = time.perf_counter()
    servers = {}
    with tempfile.TemporaryDirectory(prefix="rlproxy-bench-judge-") as tmp:
        try:
            for name, yield_ms in (("yield", YIELD_MS), ("no-yield", 0.0)):
                # environ={}: the benchmark must not pick up a user's RLPROXY_* settings.
                settings = load_settings({
                    "model": args.size, "data_dir": Path(tmp) / name, "train": False,
                    "method": "rl", "prm_m": 3, "prm_max_tokens": args.prm_max_tokens,
                    "judge_yield_ms": yield_ms}, environ={})
                runner, url = await start_server(settings, None)
                servers[name] = Server(name, runner, url, settings)
            samples, drains, blocks = await alternate(servers, args)
        finally:
            for server in servers.values():  # stops the engine and judge threads
                await server.runner.cleanup()
    # The servers load their own model copies: no model_id here.
    settings = {n: s.settings.model_dump(mode="json") for n, s in servers.items()}
    return {
        **environment(args.size, load_before, settings=settings),
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "samples_per_block": args.samples,
        "backlog_target_turns": args.backlog,
        "feeder": {"turns_per_session": FEED_TURNS, "max_tokens": FEED_MAX_TOKENS,
                   "sessions": {n: s.sessions for n, s in servers.items()}},
        "wall_s": time.perf_counter() - tic,
        "summary": summarize(samples),
        "blocks": blocks,
        "drain_s": drains,
        "samples": samples,
    }


# ---- report ----


def summary_lines(result: dict) -> list[str]:
    s, load = result["summary"], result["machine"]["load_average_1m"]
    lines = [
        f"machine: {result['machine']['cpus']} CPUs, 1-min load average {load['before']:.2f} "
        f"before, {load['after']:.2f} after (other processes on the CPUs skew every figure)",
        f"model: embedded {result['size']}, BLAS: {result['blas']}, mlx {result['mlx_version']}, "
        f"mlx-lm {result['mlx_lm_version']}; live request: greedy, {result['max_tokens']} max "
        f"tokens, {result['samples'][0]['prompt_tokens']}-token agent prompt; judge: local, "
        f"prm_m=3, prm_max_tokens={result['settings']['yield']['scoring']['prm_max_tokens']}",
    ]
    for c in CONDITIONS:
        row = s[c]
        e, t = row["e2e_s"], row["ttft_s"]
        line = (f"{c:8s} (n={row['n']}, {row['completion_tokens']} tokens): end-to-end "
                f"p50 {e['p50'] * 1000:7.1f} ms  p95 {e['p95'] * 1000:7.1f} ms | first token "
                f"p50 {t['p50'] * 1000:6.1f} ms  p95 {t['p95'] * 1000:6.1f} ms")
        if c != "idle":
            r = row["ratio_to_idle"]
            line += (f" | busy/idle: e2e {r['e2e_s']['p50']:.2f}x/{r['e2e_s']['p95']:.2f}x, "
                     f"ttft {r['ttft_s']['p50']:.2f}x/{r['ttft_s']['p95']:.2f}x (p50/p95)")
        lines.append(line)
    for c in CONDITIONS[1:]:
        blocks = [b for b in result["blocks"] if b["condition"] == c]
        turns, secs = sum(b["turns_scored"] for b in blocks), sum(b["seconds"] for b in blocks)
        lines.append(f"judge progress during {c} blocks: {turns} turns scored in {secs:.1f} s "
                     f"(feeding included)")
    least = min(x["backlog_after"] for x in result["samples"] if x["condition"] != "idle")
    lines.append(
        f"verified via /healthz: every idle sample had backlog 0 and nothing scored; every busy "
        f"sample ended with a backlog > 0 (min {least} turns); wall {result['wall_s']:.0f} s")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--max-tokens", type=int, default=64, help="live requests' completion")
    parser.add_argument("--prm-max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--samples", type=int, default=6, help="samples per condition per round")
    parser.add_argument("--backlog", type=int, default=3,
                        help="busy: unscored feeder turns kept waiting before each sample")
    parser.add_argument("--drain-timeout-s", type=float, default=120.0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/judge.json"))
    args = parser.parse_args()
    result = asyncio.run(run(args))
    report(summary_lines(result), result, args.out)


if __name__ == "__main__":
    main()
