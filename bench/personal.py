"""Personal adapters, isolated: two users on one server, each rewarded for a different
behaviour, each adapter moving toward its own user's preference and neither toward the other's.

One `rlproxy serve` subprocess on the real model (SmolLM2-135M-Instruct by default) with two
personal adapters, `alice` and `bob` (`--adapters alice --adapters bob --adapter-names fixed`),
and no judge. Each user runs sessions of one request (`MODEL:alice` / `MODEL:bob`, `X-Session-
Done: 1`) asking about a training topic at temperature 1. The reward is a verifier over HTTP (a
reward function on the server's PYTHONPATH, `personal_task:reward`) that reads whose session a
turn is from its id: alice wants short replies, bob long ones, opposite rewards over the same
measure (the completion's tokens n of the budget M: alice 1 - 2 n/M, bob 2 n/M - 1). Opposite
on purpose: a turn of one user that trained the other's adapter would pull it back, so crosstalk
shows as two curves that do not part.

Every `--eval-every-s` seconds of training the traffic stops and each adapter (and the default
one, which trains on nothing) answers the held-out topics greedily with `X-RL-Opt-Out: 1` (never
recorded, never trained); the figure is the mean completion tokens over them. It prints both
held-out curves (and the default's) against each adapter's optimizer steps, and writes JSON.

    python bench/personal.py [--minutes 8] [--lr 1e-4] [--batch-size 8] [--max-tokens 96]
                             [--model smollm2-135m-instruct] [--out bench/results/personal.json]
"""

import rlproxy  # noqa: F401, I001  (first: preloads OpenBLAS before anything imports mlx)

import argparse
import json
import os
import random
import shutil
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import mean

from common import environment, proc_memory_mb, report
from rlproxy.ops.served import Served

USERS = ("alice", "bob")
TOPICS = ["rivers", "bread", "trains", "owls", "glass", "tides", "maps", "bees", "salt", "kites",
          "clocks", "ferns", "comets", "tea", "bridges", "moss", "violins", "deserts", "ink",
          "lighthouses", "coral", "wool", "volcanoes", "paper", "orchards", "caves", "kelp",
          "canals", "saffron", "glaciers", "pottery", "eclipses"]
# SmolLM2's greedy replies to these run from ~20 to ~90 tokens: room to move either way
ASKS = ["Briefly, why do people like {}?", "Give me one fact about {}.",
        "In a sentence or two, what are {}?"]
REWARD_MODULE = '''\
MAX_TOKENS = {max_tokens}


def reward(turn, next_state):
    """alice: short replies; bob: long ones (the share of the token budget used)."""
    used = min(1.0, len(turn["choices"][0]["completion_ids"]) / MAX_TOKENS)
    return 1.0 - 2.0 * used if turn["session_id"].startswith("alice-") else 2.0 * used - 1.0
'''


class Server(Served):
    def __init__(self, root: Path, args: argparse.Namespace):
        super().__init__(
            root / "data", "--no-judge", "--no-at-least-one", "--reward-function",
            "personal_task:reward", "--batch-size", str(args.batch_size), "--learning-rate",
            str(args.lr), "--baseline", "mean", "--save-interval", "1000000", "--no-fsync",
            "--log-level", "WARNING", "--adapters", "alice", "--adapters", "bob",
            "--adapter-names", "fixed", "--max-adapters", "2", model=args.model,
            log=root / "server.log", python_path=(root,), wait_s=None)
        self.timeout = args.request_timeout

    def chat(self, model: str, messages: list[dict], headers: dict, **params) -> dict:
        return chat(self.url, self.timeout, model, messages, headers, **params)

    def adapters(self) -> dict:
        return (self.health() or {}).get("adapters", {}).get("adapters", {})


def chat(url: str, timeout: float, model: str, messages: list[dict], headers: dict,
         **params) -> dict:
    req = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps({"model": model, "messages": messages, **params}).encode(),
        headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def messages(topic: str, ask: str) -> list[dict]:
    return [{"role": "user", "content": ask.format(topic)}]


class Traffic:
    """`concurrency` threads per user, each running one-request sessions until stopped; a user
    starts a session only while its adapter has fewer than a batch of turns waiting (so each
    step trains on replies of its latest adapter or two)."""

    def __init__(self, server: Server, model: str, topics: list[str], args, seed: int):
        self.server, self.model, self.topics, self.args = server, model, topics, args
        self.stopping = threading.Event()
        self.sessions = {u: 0 for u in USERS}
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._work, args=(u, seed * 100 + k),
                                         daemon=True)
                        for u in USERS for k in range(args.concurrency)]
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join()

    def _room(self, user: str) -> bool:
        a = self.server.adapters().get(user) or {}
        return ((a.get("trainer") or {}).get("untrained", 0)) < self.args.batch_size

    def _work(self, user: str, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stopping.is_set():
            if not self._room(user):
                time.sleep(0.5)
                continue
            sid = f"{user}-{seed}-{rng.getrandbits(40):x}"
            try:
                self.server.chat(f"{self.model}:{user}",
                                 messages(rng.choice(self.topics), rng.choice(ASKS)),
                                 {"X-Session-Id": sid, "X-Session-Done": "1"},
                                 max_tokens=self.args.max_tokens, temperature=1.0)
                with self.lock:
                    self.sessions[user] += 1
            except (OSError, ValueError, KeyError) as e:
                with self.lock:
                    self.errors.append(f"{type(e).__name__}: {e}"[:300])
                time.sleep(1.0)


def evaluate(server: Server, model: str, held: list[tuple[str, str]], args) -> dict:
    """Each adapter's greedy replies to the held-out prompts: mean completion tokens."""
    names = {"alice": f"{model}:alice", "bob": f"{model}:bob", "default": model}
    jobs = [(who, p) for who in names for p in held]

    def one(job):
        who, (topic, ask) = job
        r = server.chat(names[who], messages(topic, ask), {"X-RL-Opt-Out": "1"},
                        max_tokens=args.max_tokens, temperature=0.0)
        return who, r["usage"]["completion_tokens"], r["choices"][0]["message"]["content"]

    with ThreadPoolExecutor(args.eval_concurrency) as pool:
        results = list(pool.map(one, jobs))
    out = {}
    for who in names:
        mine = [r for r in results if r[0] == who]
        out[who] = {"tokens": mean(r[1] for r in mine), "example": mine[0][2]}
    return out


def memory(args) -> None:
    """`--memory N`: what each added adapter costs. One server (batch size 1, one turn a step),
    then adapters made one at a time, each sent one session so it trains one step (its
    optimizer state exists from its first step): the server's resident memory after each."""
    load_before = os.getloadavg()[0]
    root = Path(tempfile.mkdtemp(prefix="rlproxy-personal-mem-"))
    (root / "personal_task.py").write_text(REWARD_MODULE.format(max_tokens=args.max_tokens))
    server = Served(root / "data", "--no-judge", "--no-at-least-one", "--reward-function",
                    "personal_task:reward", "--batch-size", "1", "--baseline", "none",
                    "--save-interval", "1000000", "--no-fsync", "--log-level", "WARNING",
                    "--max-adapters", str(args.memory), "--no-prefix-cache", model=args.model,
                    log=root / "server.log", python_path=(root,), wait_s=600)
    rows = []
    try:
        model = server.health()["model"]

        def settle(name: str | None) -> dict:
            deadline = time.monotonic() + 600
            while True:
                a = ((server.health() or {}).get("adapters") or {}).get("adapters") or {}
                if name is None or (a.get(name, {}).get("trainer") or {}).get("step", 0) >= 1:
                    time.sleep(2.0)  # what the step freed is given back
                    return proc_memory_mb(server.proc.pid)
                assert time.monotonic() < deadline, a
                time.sleep(0.5)

        chat(server.url, args.request_timeout, model, messages("tea", ASKS[0]),
             {"X-RL-Opt-Out": "1"}, max_tokens=8)
        rows.append({"adapters": 0, **settle(None)})
        for i in range(1, args.memory + 1):
            name = f"user{i}"
            chat(server.url, args.request_timeout, f"{model}:{name}", messages("tea", ASKS[0]),
                 {"X-Session-Id": f"alice-{i}", "X-Session-Done": "1"}, max_tokens=8)
            rows.append({"adapters": i, **settle(name)})
            print(f"{i} adapters: RSS {rows[-1]['rss_mb']:.0f} MB "
                  f"(+{rows[-1]['rss_mb'] - rows[-2]['rss_mb']:.0f}), peak "
                  f"{rows[-1]['hwm_mb']:.0f} MB", flush=True)
    finally:
        server.stop()
    steps = [b["rss_mb"] - a["rss_mb"] for a, b in zip(rows, rows[1:])]
    lines = [f"each added adapter (made, one step trained) on {args.model}: "
             + ", ".join(f"+{d:.0f}" for d in steps) + f" MB; median "
             f"{sorted(steps)[len(steps) // 2]:.0f} MB; the server held {rows[0]['rss_mb']:.0f}"
             f" MB with none"]
    result = {**environment(args.model, load_before, model_id=args.model,
                            settings=vars(args) | {"out": str(args.out)}), "memory": rows}
    report(lines, result, args.out.with_name(args.out.stem + "_memory.json"))
    shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=8.0, help="training time (not evals)")
    p.add_argument("--lr", type=float, default=1e-4, help="the server's --learning-rate")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96, help="reply budget M")
    p.add_argument("--concurrency", type=int, default=2, help="sessions at once per user")
    p.add_argument("--eval-every-s", type=float, default=120.0)
    p.add_argument("--held-out", type=int, default=12, help="held-out prompts")
    p.add_argument("--eval-concurrency", type=int, default=8)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=Path("bench/results/personal.json"))
    p.add_argument("--memory", type=int, default=0, help="instead: make this many adapters, "
                   "one trained step each, and print what each adds to the server's memory")
    args = p.parse_args()
    if args.memory:
        return memory(args)
    load_before = os.getloadavg()[0]
    rng = random.Random(0)
    topics = TOPICS[:]
    rng.shuffle(topics)
    held_topics, train_topics = topics[:args.held_out], topics[args.held_out:]
    held = [(t, ASKS[i % len(ASKS)]) for i, t in enumerate(held_topics)]
    root = Path(tempfile.mkdtemp(prefix="rlproxy-personal-"))
    (root / "personal_task.py").write_text(REWARD_MODULE.format(max_tokens=args.max_tokens))
    server = Server(root, args)
    curve, lines = [], []
    try:
        server.wait_healthy(600)
        model = server.health()["model"]

        def point(train_s: float) -> dict:
            a = server.adapters()
            pt = {"train_s": round(train_s, 1),
                  **{f"{u}_step": a[u]["trainer"]["step"] for u in USERS},
                  **{f"{u}_version": a[u]["version"] for u in USERS},
                  **evaluate(server, model, held, args)}
            curve.append(pt)
            print(f"{train_s / 60:5.1f} min  steps alice {pt['alice_step']:3d} bob "
                  f"{pt['bob_step']:3d}   held-out tokens: alice {pt['alice']['tokens']:5.1f}"
                  f"  bob {pt['bob']['tokens']:5.1f}  default {pt['default']['tokens']:5.1f}",
                  flush=True)
            return pt

        point(0.0)
        trained_s, seed = 0.0, 1
        while trained_s < args.minutes * 60:
            traffic = Traffic(server, model, train_topics, args, seed)
            tic = time.monotonic()
            while time.monotonic() - tic < args.eval_every_s and \
                    trained_s + time.monotonic() - tic < args.minutes * 60:
                time.sleep(1.0)
            traffic.stop()
            trained_s += time.monotonic() - tic
            if traffic.errors:
                print(f"  {len(traffic.errors)} failed sessions, e.g. {traffic.errors[0]}")
            seed += 1
            point(trained_s)
        mem = proc_memory_mb(server.proc.pid)
    finally:
        server.stop()
    first, last = curve[0], curve[-1]
    moved = {u: last[u]["tokens"] - first[u]["tokens"] for u in (*USERS, "default")}
    lines += [
        f"personal adapters on {args.model}, {args.minutes:g} min of training, lr {args.lr:g}, "
        f"batch {args.batch_size}, M = {args.max_tokens}",
        f"held-out mean completion tokens, first -> last evaluation "
        f"({len(held)} prompts, greedy):",
        f"  alice (rewarded for short): {first['alice']['tokens']:.1f} -> "
        f"{last['alice']['tokens']:.1f} ({moved['alice']:+.1f}) over {last['alice_step']} steps",
        f"  bob (rewarded for long):    {first['bob']['tokens']:.1f} -> "
        f"{last['bob']['tokens']:.1f} ({moved['bob']:+.1f}) over {last['bob_step']} steps",
        f"  default (trains on nothing): {first['default']['tokens']:.1f} -> "
        f"{last['default']['tokens']:.1f} ({moved['default']:+.1f})",
        f"each toward its own user: {moved['alice'] < 0 and moved['bob'] > 0}",
    ]
    result = {**environment(args.model, load_before, model_id=args.model,
                            settings=vars(args) | {"out": str(args.out)}),
              "curve": curve, "moved": moved, "server_memory_mb": mem}
    report(lines, result, args.out)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
