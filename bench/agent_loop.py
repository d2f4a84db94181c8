"""Agent-loop benchmark: a long-prompt tool-using agent against `rlproxy serve`, training off vs on.

The workload (bench/agent_workload.py) is shaped like Hermes Agent's: a ~5.9k-character system
prompt and 20 tool schemas, ~15,000 prompt tokens with the embedded tokenizer on every request,
streaming through the openai SDK with `stream_options.include_usage`. A session is one task: each
turn the agent sends the conversation so far, appends the model's reply (gibberish, from the
embedded model) as an assistant message with a synthetic tool call, then that tool's synthetic
result, so the prompt grows the way a real agent's does. Sessions send `X-Session-Id`, one
`X-Turn-Id` with `X-Step-Index` per step, and `X-Session-Done: 1` on their last turn.

Two `rlproxy serve` subprocesses run side by side, each with its own port and data directory:
`--no-train`, and training on (a reward function written to a temp dir and put on PYTHONPATH,
`--no-judge`, `--batch-size 1` by default, `--no-at-least-one` so every turn is released as soon
as it is scored). Sessions alternate between them, off first then on first, so drift hits both
conditions alike. While an "off" session runs, the training server is frozen with SIGSTOP, so its
trainer cannot slow the baseline; before it is frozen, the bench waits (at most --train-wait s)
for its trainer to go idle, and any part of a step that still spans a freeze is subtracted from
that step's time. Each server first gets one opted-out request with the system prompt and
tools, which stores the shared prefix (its cold prefill time is reported too).

Figures: TTFT p50/p95 on vs off; the share of prompt tokens served from the prefix cache with
training on (`usage.prompt_tokens_details.cached_tokens`); each optimizer step's time (from
training.jsonl) over a cold prefill of that step's turns (t(L) = a·L + b·L² through two cold
prefills measured back to back at the end on the off server, with a nonce in front: the first
turn's system prompt and tools, and the longest prompt); peak RSS (/proc VmRSS sampled every
0.5 s, and VmHWM); failed requests; /healthz at the end; steps, adapter versions, wall time.
Servers run under an address-space limit (--server-memory-gb) so a runaway training step kills
only its server, not a shared machine.

`--adapter NAME` sends the training server's traffic to personal adapter NAME (X-RL-Adapter):
the same figures for an adapter that learns from its own sessions, its KV in its own lineage.

    python bench/agent_loop.py [--quick] [--batch-size 1] [--serve-arg=--prompt-grad=none ...]
                               [--adapter NAME]
                               [--out bench/results/agent_loop.json]
"""

import rlproxy  # noqa: F401, I001  (first: preloads OpenBLAS before anything imports mlx)

import argparse
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from openai import OpenAI

import agent_workload as work
from common import environment, percentile, proc_memory_mb, report
from rlproxy.ops.served import Served
from rlproxy.records import prompt_length, read_jsonl

TTFT_GOAL = 2.0  # TTFT with training on / off, p50 and p95, at most
CACHED_GOAL = 0.9  # share of prompt tokens served from the cache with training on, at least
STEP_GOAL = 2.0  # train step time / cold prefill time of its turns, median, at most
# RSS growth (max over the run's second half / over its first half) of the training server,
# minus the same of the serving-only one, at most: "flat". Both fill the same prefix-cache LRU,
# so the serving-only server is the control; what is left is what training adds over time.
RSS_GOAL = 0.2

REWARD_MODULE = '''\
"""bench/agent_loop.py's reward: share of even token ids in the reply, mapped to [-1, 1]."""


def reward(turn, next_state):
    ids = turn["choices"][turn.get("chosen_choice", 0)]["completion_ids"]
    return 2.0 * sum(i % 2 == 0 for i in ids) / len(ids) - 1.0 if ids else -1.0
'''


class Server(Served):
    """One `rlproxy serve` subprocess (its URL, data dir, freeze and thaw: rlproxy/ops/served.py),
    its client, and what this bench samples of it: RSS and when each step's line appeared."""

    def __init__(self, name: str, train: bool, root: Path, args: argparse.Namespace):
        self.name, self.train = name, train
        super().__init__(
            root / name, "--no-judge", "--no-at-least-one", "--reward-function",
            "bench_reward:reward", "--batch-size", str(args.batch_size), "--save-interval",
            "1000000", "--no-fsync", "--log-level", "WARNING", *([] if train else ["--no-train"]),
            *args.serve_arg, model=args.model, log=root / name / "server.log",
            python_path=(root,), memory_gb=args.server_memory_gb, wait_s=None)
        self.client = OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0,
                             timeout=args.request_timeout)
        # --adapter NAME: the training server's traffic goes to that personal adapter (its
        # records in its own folder, its KV in a lineage of its own)
        self.adapter = args.adapter if train else None
        self.records = self.data_dir / "adapters" / self.adapter if self.adapter else \
            self.data_dir
        self.train_batch = args.batch_size
        self.rss: list[tuple[float, float]] = []  # (seconds since start, MB)
        self.hwm_mb = 0.0  # VmHWM: the kernel's own peak, between samples too
        self.step_seen: dict[int, float] = {}  # step -> when its training.jsonl line appeared

    def trainer_idle(self) -> bool:
        """No released turn left untrained (or the trainer is gone)."""
        h = self.health(timeout_s=5)
        if h is not None and self.adapter:
            t = (h["adapters"]["adapters"].get(self.adapter) or {}).get("trainer") or {}
            return not t.get("alive") or t.get("untrained", 0) < self.train_batch
        if h is None or not h["trainer"].get("enabled") or not h["trainer"].get("alive"):
            return True
        t, released = h["trainer"], h["scoring"].get("released", 0)
        done = t.get("turns_trained", 0) + t.get("skipped", 0) + t.get("quarantined", 0)
        return t.get("queued", 0) == 0 and released - done < self.train_batch

    def wait_trainer(self, budget_s: float) -> float:
        tic = time.monotonic()
        while time.monotonic() - tic < budget_s and not self.trainer_idle():
            time.sleep(1.0)
        return time.monotonic() - tic

    def sample(self, t0: float) -> None:
        """RSS now, and the time each new training.jsonl step line appears (every 0.5 s)."""
        mem = proc_memory_mb(self.proc.pid) if self.proc.poll() is None else None
        if mem is not None:
            self.rss.append((time.time() - t0, mem["rss_mb"]))
            self.hwm_mb = max(self.hwm_mb, mem["hwm_mb"])
        for line in read_jsonl(self.records / "training.jsonl"):
            if line.get("kind") == "step":
                self.step_seen.setdefault(line["step"], time.time())


def stream_turn(server: Server, messages: list[dict], tools: list[dict], headers: dict,
                seed: int, max_tokens: int) -> dict:
    """One streamed request: time to first token, total time, reply text, usage; or the error."""
    tic = time.perf_counter()
    out = {"ttft_s": None, "text": "", "prompt_tokens": None, "cached_tokens": None}
    try:
        stream = server.client.chat.completions.create(
            model="bench", messages=messages, tools=tools, max_tokens=max_tokens,
            temperature=1.0, seed=seed, logprobs=True, stream=True,
            stream_options={"include_usage": True},
            extra_headers={**headers, **({"X-RL-Adapter": server.adapter}
                                         if server.adapter else {})})
        for chunk in stream:
            if chunk.usage is not None:
                out["prompt_tokens"] = chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                out["cached_tokens"] = details.cached_tokens if details else 0
            for c in chunk.choices:
                if out["ttft_s"] is None and (c.delta.content or c.delta.tool_calls or c.logprobs):
                    out["ttft_s"] = time.perf_counter() - tic
                out["text"] += c.delta.content or ""
        if out["ttft_s"] is None or out["prompt_tokens"] is None:
            raise RuntimeError("the stream ended without a token or without usage")
    except Exception as e:  # counted as a failed request; the agent carries on
        out["error"] = f"{type(e).__name__}: {e}"[:300]
    out["total_s"] = time.perf_counter() - tic
    return out


def run_session(server: Server, k: int, turns: int, tools: list[dict],
                args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """Session k: `turns` tool-using steps of one task. Returns (per-request results, the last
    prompt's messages)."""
    rng = random.Random(k)  # the same tool calls and results in both conditions
    messages = [{"role": "system", "content": work.SYSTEM_PROMPT},
                {"role": "user", "content": work.TASKS[k % len(work.TASKS)]}]
    sid, results = f"bench-{server.name}-{k}", []
    for step in range(turns):
        headers = {"X-Session-Id": sid, "X-Turn-Id": f"{sid}-task", "X-Step-Index": str(step)}
        if step == turns - 1:
            headers["X-Session-Done"] = "1"
        r = stream_turn(server, messages, tools, headers, seed=1000 * k + step,
                        max_tokens=args.max_tokens)
        results.append({"condition": server.name, "session": k, "step": step,
                        **{key: v for key, v in r.items() if key != "text"}})
        if step < turns - 1:
            call = work.tool_call(step, f"call_{k}_{step}", rng)
            result = work.tool_result(step, rng)
            messages = messages + [
                {"role": "assistant", "content": r["text"], "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": result}]
    return results, messages


def cold_prefill(server: Server, messages: list[dict], tools: list[dict],
                 nonce: bool = True) -> dict:
    """TTFT of one opted-out request that nothing cached can serve: a nonce in front, or
    (nonce=False) a fresh server's first request, which then stores the shared prefix."""
    if nonce:
        first = {**messages[0], "content": f"[{uuid.uuid4().hex}]\n{messages[0]['content']}"}
        messages = [first, *messages[1:]]
    r = stream_turn(server, messages, tools, {"X-RL-Opt-Out": "1"}, 0, 1)
    # The template's opening tokens before the nonce may still match (a handful): not a warm start.
    if r.get("error") or r["cached_tokens"] > 64:
        raise RuntimeError(f"the cold prefill was not cold or failed: {r}")
    return {"prompt_tokens": r["prompt_tokens"], "ttft_s": r["ttft_s"]}


def prefill_model(samples: list[dict]):
    """t(L) = a·L + b·L² through the two cold samples (linear work + quadratic attention)."""
    (l1, t1), (l2, t2) = sorted((s["prompt_tokens"], s["ttft_s"]) for s in samples)
    if l1 == l2:
        return lambda n: t1 * n / l1
    b = (t2 / l2 - t1 / l1) / (l2 - l1)
    a = t1 / l1 - b * l1
    return lambda n: a * n + b * n * n


def step_figures(on: Server, prefill) -> list[dict]:
    """Each optimizer step of the training server: its time (minus any freeze it spanned), its
    turns' lengths, and its time over a cold prefill of those turns."""
    turns = {t["uid"]: t for t in read_jsonl(on.records / "conversations.jsonl")}
    out = []
    for line in read_jsonl(on.records / "training.jsonl"):
        if line.get("kind") != "step":
            continue
        end = on.step_seen.get(line["step"], time.time())
        start = end - line["step_time_s"] - 0.5  # sampled every 0.5 s: seen up to 0.5 s late
        frozen = sum(max(0.0, min(end, b) - max(start, a)) for a, b in on.freezes)
        lengths = [prompt_length(turns[u]) for u in line["uids"] if u in turns]
        step_s = max(0.0, line["step_time_s"] - frozen)
        cold = sum(prefill(n) for n in lengths)
        out.append({"step": line["step"], "adapter_version": line["adapter_version"],
                    "step_time_s": step_s, "frozen_s": frozen, "prompt_tokens": lengths,
                    "completion_tokens": line["tokens"], "cold_prefill_s": cold,
                    "ratio": step_s / cold if cold else None})
    return out


def rss_figures(server: Server) -> dict:
    xs = [mb for _, mb in server.rss]
    half = len(xs) // 2
    first, second = max(xs[:half] or xs or [0]), max(xs[half:] or [0])
    return {"after_start_mb": xs[0] if xs else None, "end_mb": xs[-1] if xs else None,
            "max_first_half_mb": first, "max_second_half_mb": second,
            "peak_hwm_mb": server.hwm_mb,
            "growth": second / first if first else None,
            "series": [(round(t, 1), round(mb)) for t, mb in server.rss[::4]]}


def run(args: argparse.Namespace) -> dict:
    load_before, t0 = os.getloadavg()[0], time.time()
    tools = work.TOOLS[:args.tools]
    root = Path(tempfile.mkdtemp(prefix="rlproxy-agent-loop-"))
    (root / "bench_reward.py").write_text(REWARD_MODULE)
    off, on = Server("off", False, root, args), Server("on", True, root, args)
    stop_sampling = threading.Event()

    def sampler():
        while not stop_sampling.wait(0.5):
            off.sample(t0)
            on.sample(t0)

    threading.Thread(target=sampler, daemon=True).start()
    requests, last_messages, waits, end, cold, warmup = [], [], [], {}, [], None
    try:
        off.wait_healthy(180)
        on.wait_healthy(180)
        warm = [{"role": "system", "content": work.SYSTEM_PROMPT},
                {"role": "user", "content": "hello"}]
        on.freeze()  # nothing else on the CPUs while the baseline prefill is timed
        warmup = cold_prefill(off, warm, tools, nonce=False)  # stores the shared prefix
        on.thaw()
        cold_prefill(on, warm, tools, nonce=False)  # on the training server too
        for k in range(args.sessions):
            for server in ((off, on) if k % 2 == 0 else (on, off)):
                if server is off:
                    waits.append(on.wait_trainer(args.train_wait))
                    on.freeze()
                else:
                    on.thaw()
                results, msgs = run_session(server, k, args.turns, tools, args)
                requests += results
                if server is off:
                    last_messages.append(msgs)
                print(f"session {k} {server.name}: TTFT "
                      + " ".join(f"{r['ttft_s']:.2f}" if r["ttft_s"] else "fail"
                                 for r in results), flush=True)
            on.thaw()
        waits.append(on.wait_trainer(args.final_wait))
        end = {s.name: s.health(timeout_s=5) for s in (off, on)}
        on.freeze()
        # Both samples back to back, so the machine's load (shared here) is the same for both.
        cold = [cold_prefill(off, warm, tools), cold_prefill(off, max(last_messages, key=len),
                                                             tools)]
        on.thaw()
        time.sleep(1.0)  # one more sample of each
    finally:
        stop_sampling.set()
        exit_codes = {s.name: (s.proc.returncode if s.proc.poll() is not None else None)
                      for s in (off, on)}
        for s in (off, on):
            s.stop(timeout_s=30)  # a long step holds the shutdown: not our figure
    steps = step_figures(on, prefill_model(cold))
    not_trained = [x for x in read_jsonl(on.records / "training.jsonl")
                   if x.get("kind") in ("skipped", "quarantined")]
    versions = sorted({v for t in read_jsonl(on.records / "conversations.jsonl")
                       for c in t["choices"] for v in c["adapter_versions"]})
    result = {
        **environment("tiny", load_before),
        "argv": sys.argv[1:], "serve_args": args.serve_arg, "batch_size": args.batch_size,
        "sessions": args.sessions, "turns": args.turns, "tools": len(tools),
        "max_tokens": args.max_tokens, "server_memory_gb": args.server_memory_gb,
        "data_dir": str(root) if args.keep_data else None,
        "figures": figures(requests, steps, off, on, end, exit_codes),
        "not_trained": not_trained, "cold_prefill": cold, "warmup_prefill": warmup,
        "trainer_waits_s": waits,
        "adapter_versions_seen": versions,
        "wall_s": time.time() - t0, "end_health": end, "steps": steps, "requests": requests,
        "rss": {s.name: rss_figures(s) for s in (off, on)},
    }
    if not args.keep_data:
        shutil.rmtree(root, ignore_errors=True)
    return result


def figures(requests: list[dict], steps: list[dict], off: Server, on: Server, end: dict,
            exit_codes: dict) -> dict:
    by = {c: [r for r in requests if r["condition"] == c] for c in ("off", "on")}
    ttft = {c: [r["ttft_s"] for r in rs if r["ttft_s"] is not None] for c, rs in by.items()}
    f = {}
    for q in (50, 95):
        p = {c: percentile(xs, q) if xs else None for c, xs in ttft.items()}
        ratio = p["on"] / p["off"] if p["on"] and p["off"] else None
        f[f"ttft_p{q}"] = {"off_s": p["off"], "on_s": p["on"], "ratio": ratio,
                           "goal": f"<= {TTFT_GOAL}x", "met": ratio is not None
                           and ratio <= TTFT_GOAL}
    ok_on = [r for r in by["on"] if r["prompt_tokens"]]
    share = (sum(r["cached_tokens"] for r in ok_on) / sum(r["prompt_tokens"] for r in ok_on)
             if ok_on else None)
    f["cached_share_on"] = {"value": share, "goal": f">= {CACHED_GOAL:.0%}",
                            "met": share is not None and share >= CACHED_GOAL}
    ratios = [s["ratio"] for s in steps if s["ratio"] is not None]
    f["step_over_prefill"] = {"median": percentile(ratios, 50) if ratios else None,
                              "max": max(ratios, default=None), "steps": len(steps),
                              "goal": f"<= {STEP_GOAL}x (median)",
                              "met": bool(ratios) and percentile(ratios, 50) <= STEP_GOAL}
    rss = rss_figures(on)
    control = rss_figures(off)["growth"]
    excess = rss["growth"] - control if rss["growth"] and control else None
    f["rss_on"] = {"peak_mb": rss["peak_hwm_mb"], "growth": rss["growth"],
                   "off_peak_mb": off.hwm_mb, "off_growth": control,
                   "goal": f"flat: growth - off's <= {RSS_GOAL}",
                   "met": excess is not None and excess <= RSS_GOAL}
    failed = [r for r in requests if r.get("error")]
    f["failed_requests"] = {"off": sum(r["condition"] == "off" for r in failed),
                            "on": sum(r["condition"] == "on" for r in failed),
                            "examples": [r["error"] for r in failed[:3]], "goal": "0",
                            "met": not failed}
    alive = {n: h is not None and h.get("status") == "ok" for n, h in end.items()}
    f["alive_at_end"] = {**alive, "exit_codes_before_stop": exit_codes,
                         "trainer_error": (end.get("on") or {}).get("trainer", {}).get("error"),
                         "goal": "yes", "met": all(alive.values()) and len(alive) == 2}
    f["train_steps"] = len(steps)
    return f


def summary_lines(r: dict) -> list[str]:
    f, load = r["figures"], r["machine"]["load_average_1m"]
    verdict = {True: "met", False: "NOT met"}
    fmt = lambda x, spec=".2f": "n/a" if x is None else format(x, spec)  # noqa: E731
    p50, p95, c, s = f["ttft_p50"], f["ttft_p95"], f["cached_share_on"], f["step_over_prefill"]
    a = f["alive_at_end"]
    rows = [
        ("TTFT p50 on / off", f"{fmt(p50['on_s'])} s / {fmt(p50['off_s'])} s = "
         f"{fmt(p50['ratio'])}x", p50),
        ("TTFT p95 on / off", f"{fmt(p95['on_s'])} s / {fmt(p95['off_s'])} s = "
         f"{fmt(p95['ratio'])}x", p95),
        ("prompt tokens from cache, training on", fmt(c["value"], ".1%"), c),
        ("train step / cold prefill of its turns", f"median {fmt(s['median'])}x, max "
         f"{fmt(s['max'])}x over {s['steps']} steps", s),
        ("peak RSS on (off); growth on (off)", f"{fmt(f['rss_on']['peak_mb'], '.0f')} MB "
         f"({fmt(f['rss_on']['off_peak_mb'], '.0f')} MB); {fmt(f['rss_on']['growth'])}x "
         f"({fmt(f['rss_on']['off_growth'])}x)", f["rss_on"]),
        ("failed requests off / on", f"{f['failed_requests']['off']} / "
         f"{f['failed_requests']['on']}", f["failed_requests"]),
        ("servers alive at the end", f"off {a['off']}, on {a['on']}" + "".join(
            f"; {n} exited {code}" for n, code in a["exit_codes_before_stop"].items()
            if code is not None), a),
    ]
    lines = [f"machine: {r['machine']['cpus']} CPUs, 1-min load {load['before']:.2f} before, "
             f"{load['after']:.2f} after; BLAS {r['blas']}; serve args {r['serve_args']}",
             f"{r['sessions']} sessions x {r['turns']} turns per condition, {r['tools']} tools, "
             f"cold prefill " + ", ".join(f"{x['prompt_tokens']} tok {x['ttft_s']:.1f} s"
                                          for x in r["cold_prefill"]),
             f"{'figure':40s} {'value':44s} {'goal':24s}"]
    lines += [f"{name:40s} {value:44s} {row['goal']:24s} {verdict[row['met']]}"
              for name, value, row in rows]
    waits = [round(w) for w in r["trainer_waits_s"]]
    kinds = [x["kind"] for x in r["not_trained"]]
    lines.append(f"turns skipped {kinds.count('skipped')}, quarantined "
                 f"{kinds.count('quarantined')}" + "".join(
                     f"; e.g. {x['kind']}: {x.get('reason')}" for x in r["not_trained"][:1]))
    scoring = (r["end_health"].get("on") or {}).get("scoring", {})
    lines.append(f"turns released to the trainer {scoring.get('released')}, train steps "
                 f"{f['train_steps']}, adapter versions seen "
                 f"{r['adapter_versions_seen']}, trainer waits {waits} s, wall "
                 f"{r['wall_s']:.0f} s; trainer error: {f['alive_at_end']['trainer_error']}")
    cache = (r["end_health"].get("on") or {}).get("prefix_cache", {})
    lines.append("training server's prefix cache: " + ", ".join(
        f"{k} {cache[k]}" for k in ("hits", "misses", "hits_stale", "evicted_stale") if k in cache))
    if -11 in f["alive_at_end"]["exit_codes_before_stop"].values():
        lines.append("exit -11 (SIGSEGV): MLX does not check failed allocations, so this is most "
                     f"likely memory beyond --server-memory-gb {r['server_memory_gb']}")
    if f["failed_requests"]["examples"]:
        lines.append(f"failures, e.g.: {f['failed_requests']['examples'][0]}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 2 sessions x 3 turns, 4 tools, short budgets")
    parser.add_argument("--sessions", type=int, help="sessions per condition (4; quick 2)")
    parser.add_argument("--turns", type=int, help="turns per session (5; quick 3)")
    parser.add_argument("--tools", type=int, help="tool schemas sent (20; quick 4)")
    parser.add_argument("--max-tokens", type=int, default=48, help="reply length cap")
    parser.add_argument("--batch-size", type=int, default=1, help="the training server's")
    parser.add_argument("--model", default="tiny",
                        help="served model (default tiny: its 131,072-token window holds the "
                        "15,000-token prompts; SmolLM2's 8,192 does not)")
    parser.add_argument("--train-wait", type=float,
                        help="max s to wait for the trainer before each off session (45; quick 20)")
    parser.add_argument("--final-wait", type=float,
                        help="max s to wait for the trainer at the end (120; quick 30)")
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--server-memory-gb", type=float, default=10.0,
                        help="address-space limit of each server process")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="extra `rlproxy serve` flag for both servers, e.g. "
                        "--serve-arg=--kv-reuse-max-lag=2 (repeatable)")
    parser.add_argument("--keep-data", action="store_true", help="keep the data directories")
    parser.add_argument("--adapter", help="the training server's traffic on this personal "
                        "adapter (X-RL-Adapter) instead of the default one")
    parser.add_argument("--out", type=Path, default=Path("bench/results/agent_loop.json"))
    args = parser.parse_args()
    defaults = ({"sessions": 2, "turns": 3, "tools": 4, "train_wait": 20, "final_wait": 30}
                if args.quick else
                {"sessions": 4, "turns": 5, "tools": 20, "train_wait": 45, "final_wait": 120})
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    result = run(args)
    report(summary_lines(result), result, args.out)


if __name__ == "__main__":
    main()
