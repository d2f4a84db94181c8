"""Soak benchmark: minutes of mixed traffic from 16 clients against a `rlproxy serve` subprocess.

The traffic (issue 13's "must show"), all through real HTTP with aiohttp:
- short sessions that are never ended (1,000 a minute: 10,000 in the default 10 minutes), left
  to the idle timeout and the open-session cap;
- agent sessions: 2-5 streamed turns sharing a long system prompt, each turn continuing the last
  reply, `X-Session-Done` on the last;
- dropped streams: a long streamed request with an `X-Request-Id`, dropped after a few chunks,
  then retried to its end with the same id;
- replays: three concurrent requests with one `X-Request-Id` (one must run, two must be replays
  with the same text), then a fourth after them;
- inferred sessions: two turns without a session header.

Training is on (a reward function written to a temp dir, no judge, `--batch-size` 2), fsync on.
Settings go to the server as `RLPROXY_*` environment variables, which every version reads, so
`--repo` can point the same script at another checkout (e.g. an older commit unpacked with
`git archive`) for a before/after comparison; `--serve-arg` passes extra `rlproxy serve` flags.

Figures: the server's RSS over time (sampled every second; goal: flat, within the configured
cache budgets), request latency p50/p99 per kind and over all completed requests, /healthz
response time p50/p99/max sampled every ~100 ms from its own thread and connection (the event
loop's latency under load), errors (goal 0), idempotency violations (goal 0), turns recorded
twice (goal 0), and whether every data file parses with no torn line. Writes JSON to
bench/results/soak.json.

    python bench/soak.py [--minutes 10] [--clients 16] [--repo PATH] [--out ...]
"""

import rlproxy  # noqa: F401, I001  (first: preloads OpenBLAS before anything imports mlx)

import argparse
import asyncio
import http.client
import json
import os
import random
import shutil
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

import aiohttp

from common import environment, percentile, proc_memory_mb, report
from rlproxy.ops.served import Served
from rlproxy.paths import CONVERSATIONS, PENDING
from rlproxy.records import load_pending, read_jsonl

REWARD_MODULE = '''\
"""bench/soak.py's reward: share of even token ids in the reply, mapped to [-1, 1]."""


def reward(turn, next_state):
    ids = turn["choices"][turn.get("chosen_choice", 0)]["completion_ids"]
    return 2.0 * sum(i % 2 == 0 for i in ids) / len(ids) - 1.0 if ids else -1.0
'''
SYSTEM = ("You are a careful assistant working inside a long-running agent. Follow the rules. "
          * 24)
KINDS = ("short", "agent", "drop", "replay", "inferred")
WEIGHTS = {"agent": 4, "drop": 1, "replay": 2, "inferred": 1}  # short sessions: paced apart


def serve(args: argparse.Namespace, root: Path) -> Served:
    """`rlproxy serve` from the checkout at --repo, its settings given as RLPROXY_* variables;
    not waited for."""
    repo = Path(args.repo).resolve()
    env = {"RLPROXY_JUDGE": "false", "RLPROXY_REWARD_FUNCTIONS": "soak_reward:reward",
           "RLPROXY_TRAIN": "false" if args.no_train else "true",
           "RLPROXY_BATCH_SIZE": str(args.batch_size), "RLPROXY_FSYNC": "true",
           "RLPROXY_SAVE_INTERVAL": "1000000",
           "RLPROXY_SESSION_IDLE_TIMEOUT_S": str(args.idle_timeout_s),
           "RLPROXY_MAX_OPEN_SESSIONS": str(args.max_open_sessions),
           "RLPROXY_PREFIX_CACHE_MEMORY_MB": str(args.prefix_cache_memory_mb)}
    return Served(root / "data", "--log-level", "WARNING", *args.serve_arg, model=args.size,
                  log=root / "server.log", env=env, python_path=(root, repo), cwd=repo,
                  wait_s=None)


class Sampler(threading.Thread):
    """/healthz every ~100 ms over its own keep-alive connection, and RSS every second."""

    def __init__(self, server: Served, t0: float):
        super().__init__(daemon=True)
        self.server, self.t0, self.stop = server, t0, threading.Event()
        self.health: list[tuple[float, float, int]] = []  # (t, seconds, status)
        self.rss: list[tuple[float, float]] = []
        self.hwm_mb = 0.0
        self.last: dict = {}

    def run(self) -> None:
        conn, next_rss = None, 0.0
        while not self.stop.wait(0.1):
            now = time.monotonic() - self.t0
            if now >= next_rss:
                mem = proc_memory_mb(self.server.proc.pid)
                if mem is not None:
                    self.rss.append((now, mem["rss_mb"]))
                    self.hwm_mb = max(self.hwm_mb, mem["hwm_mb"])
                next_rss = now + 1.0
            tic = time.perf_counter()
            try:
                conn = conn or http.client.HTTPConnection("127.0.0.1", self.server.port,
                                                          timeout=30)
                conn.request("GET", "/healthz")
                r = conn.getresponse()
                body, status = r.read(), r.status
                self.last = json.loads(body) if status == 200 else self.last
            except (OSError, http.client.HTTPException, ValueError):
                conn, status = None, 0
            self.health.append((now, time.perf_counter() - tic, status))


class Traffic:
    """The clients' shared state: what ran, how long it took, what went wrong."""

    def __init__(self, args: argparse.Namespace, url: str, deadline: float, t0: float):
        self.args, self.url, self.deadline, self.t0 = args, url + "/v1", deadline, t0
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.ttft: list[float] = []
        self.counts: Counter = Counter()
        self.errors: list[str] = []
        self.violations: list[str] = []
        self.short_target = round(args.short_sessions if args.short_sessions is not None
                                  else 1000 * args.minutes)

    def error(self, kind: str, what: str) -> None:
        self.counts[f"{kind}_errors"] += 1
        if len(self.errors) < 50:
            self.errors.append(f"{kind}: {what}"[:300])

    async def chat(self, http, kind: str, messages: list[dict], headers: dict, *,
                   stream: bool, max_tokens: int, drop_after: int | None = None) -> dict | None:
        """One request: {"text", "replay", "dropped"}; None (an error recorded) if it failed."""
        body = {"model": "soak", "messages": messages, "max_tokens": max_tokens,
                "stream": stream, "temperature": 1.0}
        tic = time.perf_counter()
        try:
            async with http.post(self.url + "/chat/completions", json=body,
                                 headers=headers) as r:
                replay = r.headers.get("X-Idempotent-Replay") == "true"
                if r.status != 200:
                    self.error(kind, f"HTTP {r.status}: {(await r.text())[:200]}")
                    return None
                if not stream:
                    text = (await r.json())["choices"][0]["message"]["content"]
                else:
                    text, chunks, done, first = "", 0, False, True
                    async for line in r.content:
                        if not line.startswith(b"data: "):
                            continue
                        if line.strip() == b"data: [DONE]":
                            done = True
                            break
                        data = json.loads(line[6:])
                        if "error" in data:
                            self.error(kind, f"stream error: {data['error']}")
                            return None
                        for c in data["choices"]:
                            if first and c["delta"].get("content"):
                                self.ttft.append(time.perf_counter() - tic)
                                first = False
                            text += c["delta"].get("content") or ""
                        chunks += 1
                        if drop_after is not None and chunks >= drop_after:
                            r.close()  # the client goes away part way through
                            self.counts["dropped_streams"] += 1
                            return {"text": text, "replay": replay, "dropped": True}
                    if not done:
                        self.error(kind, "stream ended without [DONE]")
                        return None
        except (aiohttp.ClientError, TimeoutError) as e:
            self.error(kind, f"{type(e).__name__}: {e}")
            return None
        self.latency[kind].append(time.perf_counter() - tic)
        return {"text": text, "replay": replay, "dropped": False}

    # ---- the kinds of traffic ----

    async def short(self, http, rng: random.Random) -> None:
        sid = f"short-{uuid.uuid4().hex[:12]}"
        self.counts["short_sessions"] += 1
        await self.chat(http, "short", [{"role": "user", "content": f"ping {sid}"}],
                        {"X-Session-Id": sid}, stream=False, max_tokens=6)

    async def agent(self, http, rng: random.Random) -> None:
        sid, turns = f"agent-{uuid.uuid4().hex[:12]}", rng.randint(2, 5)
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"task {rng.randint(0, 10**6)}: plan it"}]
        for k in range(turns):
            headers = {"X-Session-Id": sid, "X-Turn-Id": f"{sid}-t", "X-Step-Index": str(k)}
            if k == turns - 1:
                headers["X-Session-Done"] = "1"
            r = await self.chat(http, "agent", messages, headers, stream=True, max_tokens=24)
            if r is None:
                return
            messages = messages + [{"role": "assistant", "content": r["text"]},
                                   {"role": "user", "content": f"step {k} done; go on"}]
        self.counts["agent_sessions"] += 1

    async def drop(self, http, rng: random.Random) -> None:
        sid, rid = f"drop-{uuid.uuid4().hex[:12]}", uuid.uuid4().hex
        messages = [{"role": "user", "content": f"write a long story {rid}"}]
        headers = {"X-Session-Id": sid, "X-Request-Id": rid}
        await self.chat(http, "drop", messages, headers, stream=True, max_tokens=400,
                        drop_after=rng.randint(1, 4))
        await asyncio.sleep(0.05)
        # the retry: the first attempt failed (nothing kept), or it was filed just before the
        # drop (then it is replayed): either way one turn for this id
        await self.chat(http, "drop_retry", messages, headers, stream=rng.random() < 0.5,
                        max_tokens=48)

    async def replay(self, http, rng: random.Random) -> None:
        sid, rid = f"replay-{uuid.uuid4().hex[:12]}", uuid.uuid4().hex
        messages = [{"role": "user", "content": f"say something {rid}"}]
        headers = {"X-Session-Id": sid, "X-Request-Id": rid}
        streams = [rng.random() < 0.5 for _ in range(3)]
        first = await asyncio.gather(*[self.chat(http, "replay", messages, headers, stream=s,
                                                 max_tokens=16) for s in streams])
        again = await self.chat(http, "replay", messages, headers, stream=False, max_tokens=16)
        done = [r for r in first + [again] if r is not None]
        if len(done) == 4:
            ran = sum(not r["replay"] for r in done)
            if ran != 1 or len({r["text"] for r in done}) != 1:
                self.violations.append(f"{rid}: {ran} of 4 ran, "
                                       f"{len({r['text'] for r in done})} different texts")
        self.counts["replay_groups"] += 1

    async def inferred(self, http, rng: random.Random) -> None:
        messages = [{"role": "user", "content": f"no header {uuid.uuid4().hex}"}]
        r = await self.chat(http, "inferred", messages, {}, stream=False, max_tokens=12)
        if r is not None:
            messages = messages + [{"role": "assistant", "content": r["text"]},
                                   {"role": "user", "content": "and then?"}]
            await self.chat(http, "inferred", messages, {}, stream=True, max_tokens=12)

    async def client(self, i: int) -> None:
        rng = random.Random(self.args.seed * 1000 + i)
        kinds = [k for k in self.args.kinds if k != "short"]
        timeout = aiohttp.ClientTimeout(total=self.args.request_timeout)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while time.monotonic() < self.deadline:
                elapsed = (time.monotonic() - self.t0) / (self.deadline - self.t0)
                behind = self.counts["short_sessions"] < self.short_target * elapsed
                if "short" in self.args.kinds and (behind or not kinds):
                    await self.short(http, rng)
                else:
                    kind = rng.choices(kinds, [WEIGHTS[k] for k in kinds])[0]
                    await getattr(self, kind)(http, rng)


def check_files(data_dir: Path) -> dict:
    """Every JSONL file parses line by line and ends with a newline; turns recorded twice (in
    conversations.jsonl, or still pending in the journal)."""
    files, bad = {}, []
    for path in sorted(data_dir.rglob("*.jsonl")):
        data, lines = path.read_bytes(), 0
        if data and not data.endswith(b"\n"):
            bad.append(f"{path.name}: torn last line")
        for n, line in enumerate(data.splitlines()):
            try:
                json.loads(line)
                lines += 1
            except ValueError:
                bad.append(f"{path.name} line {n + 1} does not parse")
        files[str(path.relative_to(data_dir))] = lines
    records = list(read_jsonl(data_dir / CONVERSATIONS))
    uids = Counter(r["uid"] for r in records)
    by_request: dict[str, set] = defaultdict(set)
    for r in records + load_pending(data_dir / PENDING):
        if r.get("request_id"):
            by_request[r["request_id"]].add(r["uid"])
    ends = Counter(r.get("end") for r in records)
    return {"lines": files, "problems": bad[:20], "all_parse": not bad,
            "turns_recorded": len(records),
            "uids_recorded_twice": sum(n > 1 for n in uids.values()),
            "request_ids_with_two_turns": sum(len(u) > 1 for u in by_request.values()),
            "ends": dict(ends)}


def dist(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "p50_ms": round(percentile(xs, 50) * 1000, 1),
            "p99_ms": round(percentile(xs, 99) * 1000, 1), "max_ms": round(max(xs) * 1000, 1)}


def rss_figures(samples: list[tuple[float, float]], hwm: float) -> dict:
    xs = [mb for _, mb in samples]
    if not xs:
        return {}
    warm = xs[len(xs) // 10:] or xs  # after the first tenth: model loaded, caches filling
    half = len(warm) // 2
    first, second = max(warm[:half] or warm), max(warm[half:] or warm)
    step = max(1, len(samples) // 120)
    return {"start_mb": round(xs[0]), "end_mb": round(xs[-1]), "peak_hwm_mb": round(hwm),
            "max_first_half_mb": round(first), "max_second_half_mb": round(second),
            "growth": round(second / first, 3) if first else None,
            "series": [(round(t), round(mb)) for t, mb in samples[::step]]}


def run(args: argparse.Namespace) -> dict:
    load_before = os.getloadavg()[0]
    root = Path(tempfile.mkdtemp(prefix="rlproxy-soak-"))
    (root / "soak_reward.py").write_text(REWARD_MODULE)
    server = serve(args, root)
    exit_code = None
    try:
        server.wait_healthy(300)
        t0 = time.monotonic()
        sampler = Sampler(server, t0)
        sampler.start()
        traffic = Traffic(args, server.url, t0 + args.minutes * 60, t0)

        async def clients():
            await asyncio.gather(*[traffic.client(i) for i in range(args.clients)])

        asyncio.run(clients())
        wall = time.monotonic() - t0
        time.sleep(1.0)  # a last few health samples after the traffic
        sampler.stop.set()
        sampler.join()
        alive = server.proc.poll() is None
        end_health = sampler.last
        exit_code = server.stop()
        files = check_files(server.data_dir)
    finally:
        server.stop()
        if not args.keep_data:
            shutil.rmtree(root, ignore_errors=True)
    health_ok = [s for _, s, status in sampler.health if status == 200]
    done = [x for xs in traffic.latency.values() for x in xs]
    errors = sum(v for k, v in traffic.counts.items() if k.endswith("_errors"))
    return {
        **environment(args.size, load_before, settings={
            "clients": args.clients, "minutes": args.minutes, "batch_size": args.batch_size,
            "train": not args.no_train, "idle_timeout_s": args.idle_timeout_s,
            "max_open_sessions": args.max_open_sessions,
            "prefix_cache_memory_mb": args.prefix_cache_memory_mb, "kinds": args.kinds,
            "repo": str(Path(args.repo).resolve()), "serve_args": args.serve_arg}),
        "wall_s": round(wall, 1),
        "counts": dict(traffic.counts),
        "short_sessions_target": traffic.short_target,
        "latency": {"all": dist(done), **{k: dist(v) for k, v in sorted(traffic.latency.items())},
                    "ttft_stream": dist(traffic.ttft)},
        "healthz": {**dist(health_ok), "failed": len(sampler.health) - len(health_ok)},
        "rss": rss_figures(sampler.rss, sampler.hwm_mb),
        "errors": errors, "error_examples": traffic.errors[:10],
        "idempotency_violations": len(traffic.violations),
        "violation_examples": traffic.violations[:10],
        "files": files,
        "server_alive_at_end": alive, "exit_code": exit_code,
        "end_health": {k: end_health.get(k) for k in ("sessions_open", "scoring", "trainer",
                                                      "prefix_cache", "engine")},
    }


def summary_lines(r: dict) -> list[str]:
    lat, hz, rss, f = r["latency"], r["healthz"], r["rss"], r["files"]
    trainer = r["end_health"].get("trainer") or {}
    return [
        f"{r['settings']['clients']} clients for {r['wall_s']:.0f} s against "
        f"{r['settings']['repo']} (load {r['machine']['load_average_1m']['before']:.2f} -> "
        f"{r['machine']['load_average_1m']['after']:.2f})",
        "requests: " + ", ".join(f"{k} {v['n']}" for k, v in lat.items()
                                 if k not in ("all", "ttft_stream")) +
        f"; short sessions {r['counts'].get('short_sessions', 0)} "
        f"(target {r['short_sessions_target']}), dropped streams "
        f"{r['counts'].get('dropped_streams', 0)}",
        f"latency all: p50 {lat['all'].get('p50_ms')} ms, p99 {lat['all'].get('p99_ms')} ms; "
        f"stream TTFT p99 {lat['ttft_stream'].get('p99_ms')} ms",
        f"/healthz every 100 ms: p50 {hz.get('p50_ms')} ms, p99 {hz.get('p99_ms')} ms, "
        f"max {hz.get('max_ms')} ms, failed {hz['failed']}",
        f"RSS: start {rss.get('start_mb')} MB, max first/second half {rss.get('max_first_half_mb')}"
        f"/{rss.get('max_second_half_mb')} MB (growth {rss.get('growth')}), "
        f"peak {rss.get('peak_hwm_mb')} MB",
        f"errors {r['errors']} (goal 0), idempotency violations {r['idempotency_violations']} "
        f"(goal 0), turns recorded twice {f['uids_recorded_twice']} / request ids with two "
        f"turns {f['request_ids_with_two_turns']} (goal 0)",
        f"data files parse: {f['all_parse']} ({sum(f['lines'].values())} lines in "
        f"{len(f['lines'])} files; {f['turns_recorded']} turns, ends {f['ends']})",
        f"trainer: step {trainer.get('step')}, error {trainer.get('error')}; sessions open at "
        f"the end {r['end_health'].get('sessions_open')}; server alive {r['server_alive_at_end']}",
    ] + [f"  e.g. {e}" for e in r["error_examples"][:3] + r["violation_examples"][:3]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--short-sessions", type=int,
                        help="short sessions never ended (default 1,000 per minute)")
    parser.add_argument("--kinds", type=lambda s: s.split(","), default=list(KINDS),
                        help=f"traffic kinds, comma-separated (default {','.join(KINDS)})")
    parser.add_argument("--batch-size", type=int, default=2, help="the trainer's")
    parser.add_argument("--no-train", action="store_true", help="serve and record only")
    parser.add_argument("--idle-timeout-s", type=float, default=60.0)
    parser.add_argument("--max-open-sessions", type=int, default=2048)
    parser.add_argument("--prefix-cache-memory-mb", type=float, default=128.0)
    parser.add_argument("--size", default="tiny",
                        help="the served model: tiny or small (generated), or any --model")
    parser.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]),
                        help="the checkout whose `rlproxy serve` runs (default: this one)")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="extra `rlproxy serve` flag (repeatable)")
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-data", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench/results/soak.json"))
    args = parser.parse_args()
    unknown = set(args.kinds) - set(KINDS)
    if unknown:
        parser.error(f"unknown kinds {sorted(unknown)}; choose from {','.join(KINDS)}")
    result = run(args)
    report(summary_lines(result), result, args.out)


if __name__ == "__main__":
    main()
