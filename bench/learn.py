"""Learning curve: does the served adapter get better at a verifiable task on a real model?

The task (bench/learn_task.py) is adding two numbers from 2 to 20 ("What is 7 + 12? Answer with
just the number."), which SmolLM2-135M-Instruct, the default model, gets right in about a third
of its greedy replies. A fixed held-out set of sums (and their swaps) is never trained on.

Per mode, one `rlproxy serve` subprocess trains on the task's traffic:
- `reward`: the score comes from outside over HTTP, as a reward function (`learn_task:reward_fn`,
  copied into a temp dir that is put on the server's PYTHONPATH), with `--no-judge`. Each
  session is one request with `X-Session-Id` and `X-Session-Done: 1`, so the turn closes and is
  scored at once; `--n` > 1 asks for a group of choices per request (GRPO: each choice's
  advantage is its reward minus the group's mean).
- `prm`: no reward function anywhere in the server; the server's local PRM judge (the base
  model itself, `--method rl`, log-prob verdicts: the default) reads each turn's next state.
  Each session is the task request, then a simulated user's reply sent as a second request
  with `X-RL-Train: 0` (the reply's own turn is not trained) and `X-Session-Done: 1`. The user
  answers in natural language, drawn at random from 40 phrasings per polarity
  (bench/data/user_replies.json; none appears in the judge's few-shot examples): a positive
  one when the rule below calls the reply correct, else a negative one. The judge scores only
  the choice the conversation continued from, so this mode always uses n = 1.
  `--serve-arg=--judge-url=...` points it at a stronger judge.
- `prm-votes`: the same with the older judge: one sampled 32-token `\boxed{}` vote of
  prm_prompts/judge.txt per turn (`--prm-verdict votes`), the judge before log-prob verdicts.
- `opd`: the same traffic, on-policy distillation (`--method opd`): the local base model writes
  a hint from the next state (one 48-token answer) and scores the turn's tokens under the
  hinted prompt as the teacher.
All run with `--no-at-least-one` (a session's only turn would otherwise be released with +1
whatever its answer). The held-out evaluation is always the verifier below, outside the loop.
`--mode` takes one mode, `both` (reward, then prm) or a comma list; `--side-by-side` runs the
modes at once (each server gets about one of the two cores) instead of one after the other.

`--concurrency` sessions run at once (sampled at temperature 1); a new one starts only while
fewer than `--max-backlog` turns wait to be scored or trained (/healthz), so every step trains
on replies of the last adapter or two (near on-policy) instead of a queue that grows. Every
`--eval-every` optimizer steps (read off /healthz) training is paused (POST /v1/training/pause;
the step in progress finishes and is served), the traffic stops, and the held-out sums are asked
with `X-RL-Opt-Out: 1` (never recorded, never trained): once greedily and `--eval-samples` times
at temperature 1 with seeds fixed per item, the same at every evaluation. The same rule scores
them. Then training resumes. The training budget (`--minutes`) counts the training phases only,
not the evaluations.

It prints the curve: each point's mean held-out reward with a 95% normal interval across items
(an item's sampled reward is the mean of its samples) and its accuracy (greedy: Wilson interval;
sampled: normal across items),
then each optimizer step's time (training.jsonl `step_time_s`, which includes the rests it takes
while requests decode) and the server's peak RSS (/proc VmHWM). It writes JSON (--out) and a PNG
(two panels: against optimizer steps and against training minutes; --plot).

    python bench/learn.py [--mode reward|prm|both] [--minutes 20] [--lr 2e-5] [--n 1]
                          [--eval-every 10] [--held-out 48] [--out bench/results/learn.json]
"""

import rlproxy  # noqa: F401, I001  (first: preloads OpenBLAS before anything imports mlx)

import argparse
import json
import math
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import mean, median, stdev

import learn_task as task
from common import environment, proc_memory_mb, report
from learn_report import plot, point_line, summary_lines
from rlproxy.ops.served import Served
from rlproxy.records import read_jsonl

Z95 = 1.959964  # two-sided 95% normal quantile
USER_REPLIES = json.loads((Path(__file__).with_name("data") / "user_replies.json").read_text())
SCORING = {  # each mode's scoring flags; --serve-arg comes after them, so it can override
    "reward": ["--no-judge", "--reward-function", "learn_task:reward_fn"],
    "prm": ["--judge", "--method", "rl", "--prm-verdict", "logprob"],
    # One short vote per turn: the local judge decodes one vote at a time on its own thread,
    # and 3 votes of 256 tokens would take longer per turn than a training step of 8.
    "prm-votes": ["--judge", "--method", "rl", "--prm-verdict", "votes", "--prm-m", "1",
                  "--prm-max-tokens", "32"],
    "opd": ["--method", "opd", "--prm-m", "1", "--prm-max-tokens", "48"],
}


class Server(Served):
    """One training `rlproxy serve` subprocess (rlproxy/ops/served.py's): requests,
    pause/resume, steps and memory."""

    def __init__(self, mode: str, root: Path, args: argparse.Namespace):
        super().__init__(
            root / mode, "--no-at-least-one", "--batch-size", str(args.batch_size),
            "--learning-rate", str(args.lr), "--baseline", args.baseline, "--save-interval",
            "1000000", "--no-fsync", "--log-level", "WARNING", *SCORING[mode], *args.serve_arg,
            model=args.model, log=root / mode / "server.log", python_path=(root,),
            memory_gb=args.server_memory_gb, wait_s=None)
        self.timeout = args.request_timeout
        self.hwm_mb = 0.0  # the kernel's own peak (VmHWM), read while the process lives
        self.rss: list[tuple[float, float]] = []  # (s since start, MB)
        self.started = time.monotonic()

    def alive_or_raise(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited with {self.proc.returncode}: "
                               f"{self.log.read_text()[-2000:]}")

    def post(self, path: str, body: dict | None = None, headers: dict | None = None) -> dict:
        req = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
        with urllib.request.urlopen(req, timeout=self.timeout) as r:
            return json.loads(r.read())

    def chat(self, messages: list[dict], headers: dict, **params) -> dict:
        return self.post("/v1/chat/completions",
                            {"model": "learn", "messages": messages, **params}, headers)

    def steps(self) -> list[dict]:
        return [x for x in read_jsonl(self.data_dir / "training.jsonl") if x.get("kind") == "step"]

    def sample_memory(self) -> None:
        mem = proc_memory_mb(self.proc.pid) if self.proc.poll() is None else None
        if mem is not None:
            self.rss.append((time.monotonic() - self.started, mem["rss_mb"]))
            self.hwm_mb = max(self.hwm_mb, mem["hwm_mb"])

    def settle(self, timeout_s: float = 900) -> dict:
        """After a pause: wait until no step is running (train_journal.jsonl: every step_start
        has its step_end) and the engine serves the newest step's adapter."""
        time.sleep(0.5)  # a step that began as the pause arrived has journaled its start
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.alive_or_raise()
            self.sample_memory()
            journal = list(read_jsonl(self.data_dir / "train_journal.jsonl"))
            started = {x["n"] for x in journal if x.get("kind") == "step_start"}
            ended = {x["n"] for x in journal if x.get("kind") == "step_end"}
            steps, h = self.steps(), self.health()
            newest = steps[-1]["adapter_version"] if steps else 0
            if h is not None and started <= ended and h["adapter_version"] >= newest:
                return h
            time.sleep(0.5)
        raise RuntimeError(f"the trainer did not settle in {timeout_s:.0f} s")


class Traffic:
    """`concurrency` threads, each running task sessions back to back until stopped."""

    def __init__(self, server: Server, pairs: list[tuple[int, int]], mode: str,
                 args: argparse.Namespace, seed: int):
        self.server, self.pairs, self.mode, self.args = server, pairs, mode, args
        self.stopping = threading.Event()
        self.room = threading.Event()  # set while the trainer's backlog is short (on-policy)
        self.room.set()
        self.lock = threading.Lock()
        self.sessions, self.errors = 0, []
        self.threads = [threading.Thread(target=self._work, args=(seed * 1000 + k,), daemon=True)
                        for k in range(args.concurrency)]
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        """Stop starting sessions; wait for those in flight."""
        self.stopping.set()
        for t in self.threads:
            t.join()

    def _work(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stopping.is_set():
            if not self.room.wait(0.5):
                continue
            a, b = rng.choice(self.pairs)
            sid = f"learn-{self.mode}-{seed}-{rng.getrandbits(40):x}"
            try:
                self._session(sid, a, b)
                with self.lock:
                    self.sessions += 1
            except (OSError, ValueError, KeyError) as e:  # counted; the traffic goes on
                with self.lock:
                    self.errors.append(f"{type(e).__name__}: {e}"[:300])
                time.sleep(1.0)

    def _session(self, sid: str, a: int, b: int) -> None:
        messages, args = task.messages(a, b), self.args
        if self.mode == "reward":
            self.server.chat(messages, {"X-Session-Id": sid, "X-Session-Done": "1"},
                             max_tokens=args.max_tokens, temperature=1.0, n=args.n)
            return
        out = self.server.chat(messages, {"X-Session-Id": sid}, max_tokens=args.max_tokens,
                               temperature=1.0)
        c = out["choices"][0]
        text = c["message"]["content"] or ""
        pool = USER_REPLIES["positive" if task.correct(text, c["finish_reason"], a, b)
                            else "negative"]
        verdict = random.Random(f"{sid}").choice(pool)
        self.server.chat(messages + [{"role": "assistant", "content": text},
                                     {"role": "user", "content": verdict}],
                         # X-Turn-Type: main, or a 1-token request is taken for a probe
                         {"X-Session-Id": sid, "X-Session-Done": "1", "X-RL-Train": "0",
                          "X-Turn-Type": "main"}, max_tokens=1, temperature=0.0)


# ---- held-out evaluation ----

def normal_interval(xs: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): mean ± 1.96 standard errors across items."""
    m = mean(xs)
    half = Z95 * stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")
    return m, m - half, m + half


def wilson(k: int, n: int) -> tuple[float, float, float]:
    """(share, low, high): the Wilson score interval of k successes in n trials."""
    p, z2 = k / n, Z95 * Z95
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return p, centre - half, centre + half


def evaluate(server: Server, held: list[tuple[int, int]], args: argparse.Namespace) -> dict:
    """Every held-out sum once greedily and `eval_samples` times at temperature 1 (seeds fixed
    per item and sample, the same at every evaluation), opted out of recording."""
    jobs = [(i, s) for i in range(len(held)) for s in [None, *range(args.eval_samples)]]

    def one(job):
        i, s = job
        a, b = held[i]
        params = {"temperature": 0.0} if s is None else {"temperature": 1.0,
                                                         "seed": 7919 * i + s}
        c = server.chat(task.messages(a, b), {"X-RL-Opt-Out": "1"},
                        max_tokens=args.max_tokens, **params)["choices"][0]
        text = c["message"]["content"] or ""
        return (i, s, task.reward(text, c["finish_reason"], a, b),
                task.correct(text, c["finish_reason"], a, b), text)

    tic = time.monotonic()
    with ThreadPoolExecutor(args.eval_concurrency) as pool:
        results = list(pool.map(one, jobs))
    greedy = sorted((r for r in results if r[1] is None), key=lambda r: r[0])
    sampled = [[r for r in results if r[0] == i and r[1] is not None] for i in range(len(held))]
    g_mean, g_lo, g_hi = normal_interval([r[2] for r in greedy])
    s_mean, s_lo, s_hi = normal_interval([mean(r[2] for r in rs) for rs in sampled])
    g_acc = wilson(sum(r[3] for r in greedy), len(greedy))
    s_acc = normal_interval([mean(r[3] for r in rs) for rs in sampled])
    return {
        "greedy": {"reward": g_mean, "low": g_lo, "high": g_hi, "accuracy": g_acc[0],
                   "accuracy_low": g_acc[1], "accuracy_high": g_acc[2],
                   "correct": sum(r[3] for r in greedy), "n": len(greedy)},
        "sampled": {"reward": s_mean, "low": s_lo, "high": s_hi, "accuracy": s_acc[0],
                    "accuracy_low": max(0.0, s_acc[1]), "accuracy_high": min(1.0, s_acc[2]),
                    "correct": sum(r[3] for rs in sampled for r in rs),
                    "n": sum(len(rs) for rs in sampled)},
        "eval_s": time.monotonic() - tic,
        "greedy_replies": [{"sum": f"{held[r[0]][0]} + {held[r[0]][1]}", "reward": r[2],
                            "text": r[4]} for r in greedy[:args.show_replies]],
    }


# ---- one mode's run ----

def train_until(server: Server, traffic: Traffic, step: int, budget_s: float,
                max_backlog: int) -> None:
    """Train until the trainer reaches STEP or BUDGET_S has passed, then pause training.
    Sessions start only while fewer than MAX_BACKLOG turns wait to be scored or trained."""
    tic = time.monotonic()
    while time.monotonic() - tic < budget_s:
        server.alive_or_raise()
        server.sample_memory()
        h = server.health()
        if h is not None:
            if h["trainer"]["step"] >= step:
                break
            if h["scoring"]["pending"] + h["trainer"]["queued"] < max_backlog:
                traffic.room.set()
            else:
                traffic.room.clear()
        time.sleep(0.5)
    server.post("/v1/training/pause")  # before the traffic stops: its last turns train later


def run_mode(mode: str, root: Path, held: list, train: list, args) -> dict:
    server = Server(mode, root, args)
    curve, traffic_totals, train_s, t0 = [], {"sessions": 0, "errors": []}, 0.0, None
    end_health = None
    try:
        server.wait_healthy(600)
        t0 = time.monotonic()
        server.post("/v1/training/pause")
        phase = 0
        while True:
            h = server.settle()
            point = {"step": h["trainer"]["step"], "adapter_version": h["adapter_version"],
                     "train_s": train_s, "wall_s": time.monotonic() - t0,
                     **evaluate(server, held, args)}
            curve.append(point)
            print(point_line(mode, point), flush=True)
            left = args.minutes * 60 - train_s
            if left <= 0:
                break
            tic = time.monotonic()
            server.post("/v1/training/resume")
            traffic = Traffic(server, train, mode, args, seed=phase)
            phase += 1
            try:
                train_until(server, traffic, point["step"] + args.eval_every, left,
                            args.max_backlog)
            finally:
                traffic.stop()
            traffic_totals["sessions"] += traffic.sessions
            traffic_totals["errors"] += traffic.errors
            train_s += time.monotonic() - tic  # the phase, up to its traffic's last reply
        server.sample_memory()
        end_health = server.health()
    finally:
        server.stop()
    # Only the steps the last evaluation saw: stopping a paused server trains its held batch.
    steps = [s for s in server.steps() if not curve or s["step"] <= curve[-1]["step"]]
    others = [x for x in read_jsonl(server.data_dir / "training.jsonl")
              if x.get("kind") in ("skipped", "quarantined")]
    times = [s["step_time_s"] for s in steps]
    compute = [s["step_time_s"] - s.get("yielded_s", 0.0) for s in steps]
    result = {
        "mode": mode, "serve_cmd": server.command[2:], "curve": curve,
        "train_minutes": train_s / 60, "wall_minutes": (time.monotonic() - t0) / 60 if t0 else None,
        "steps": len(steps),
        "skipped_batches": sum(x.get("kind") == "skipped" and "advantage" in x.get("reason", "")
                               for x in others),
        "sessions": traffic_totals["sessions"],
        "failed_requests": len(traffic_totals["errors"]),
        "errors": traffic_totals["errors"][:5], "not_trained": others[:20],
        "step_time_s": {"median": median(times), "mean": mean(times), "max": max(times),
                        "median_without_rests": median(compute)} if times else None,
        "peak_rss_mb": server.hwm_mb,
        "rss_series": [(round(t), round(mb)) for t, mb in server.rss[::10]],
        "end_health_trainer": (end_health or {}).get("trainer"),
        "train_steps": [{k: s.get(k) for k in ("step", "reward_mean", "reward_std", "loss", "kl",
                                               "grad_norm", "tokens", "step_time_s",
                                               "yielded_s", "time")} for s in steps],
    }
    if args.keep_data:
        result["data_dir"] = str(server.data_dir)
    return result


# ---- output ----

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="reward",
                        help="reward | prm | prm-votes | opd | both (reward,prm) | a comma list")
    parser.add_argument("--side-by-side", action="store_true",
                        help="run the modes at once rather than one after the other")
    parser.add_argument("--minutes", type=float, default=20.0,
                        help="training budget per mode, evaluations excluded")
    parser.add_argument("--lr", type=float, default=2e-5, help="the server's --learning-rate")
    parser.add_argument("--batch-size", type=int, default=8, help="turns per optimizer step")
    parser.add_argument("--baseline", default="mean", help="the server's --baseline")
    parser.add_argument("--n", type=int, default=1,
                        help="choices per request in reward mode (> 1: GRPO groups)")
    parser.add_argument("--concurrency", type=int,
                        help="sessions in flight at once (default 8 // n, at least 1)")
    parser.add_argument("--max-backlog", type=int,
                        help="start no session while this many turns wait to be scored or "
                        "trained (default: --batch-size), so training stays near on-policy")
    parser.add_argument("--max-tokens", type=int, default=20, help="reply budget")
    parser.add_argument("--eval-every", type=int, default=10, help="optimizer steps between "
                        "evaluations")
    parser.add_argument("--held-out", type=int, default=48, help="held-out sums")
    parser.add_argument("--eval-samples", type=int, default=2,
                        help="temperature-1 samples per held-out sum (besides the greedy one)")
    parser.add_argument("--eval-concurrency", type=int, default=16,
                        help="evaluation requests in flight (the engine batches up to 16)")
    parser.add_argument("--show-replies", type=int, default=4,
                        help="greedy replies kept per evaluation in the JSON")
    parser.add_argument("--seed", type=int, default=0, help="which sums are held out")
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="the server's --model (tiny: a fast plumbing check)")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="extra `rlproxy serve` flag, e.g. --serve-arg=--loss-fn=cispo "
                        "(repeatable; comes last, so it overrides the bench's own)")
    parser.add_argument("--server-memory-gb", type=float, default=12.0,
                        help="address-space limit of the server process")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--keep-data", action="store_true", help="keep the data directories")
    parser.add_argument("--out", type=Path, default=Path("bench/results/learn.json"))
    parser.add_argument("--plot", type=Path, help="PNG path (default: --out with .png)")
    args = parser.parse_args()
    modes = ["reward", "prm"] if args.mode == "both" else args.mode.split(",")
    if any(m not in SCORING for m in modes):
        parser.error(f"--mode: each of {modes} must be one of {', '.join(SCORING)} (or both)")
    if args.held_out < 2 or args.eval_samples < 1:
        parser.error("the intervals need --held-out of at least 2 and --eval-samples of at least 1")
    if args.concurrency is None:
        args.concurrency = max(1, 8 // args.n)
    if args.max_backlog is None:
        args.max_backlog = args.batch_size
    load_before = os.getloadavg()[0]
    held, train = task.split_items(args.held_out, args.seed)
    root = Path(tempfile.mkdtemp(prefix="rlproxy-learn-"))
    shutil.copy(Path(__file__).with_name("learn_task.py"), root / "learn_task.py")
    runs = {}
    try:
        if args.side_by_side:
            with ThreadPoolExecutor(len(modes)) as pool:
                done = pool.map(lambda m: run_mode(m, root, held, train, args), modes)
                runs = dict(zip(modes, done))
        else:
            for mode in modes:
                runs[mode] = run_mode(mode, root, held, train, args)
    finally:
        if not args.keep_data:
            shutil.rmtree(root, ignore_errors=True)
    result = {**environment(args.model, load_before, model_id=args.model),
              "argv": sys.argv[1:], "task": task.__doc__.splitlines()[0],
              "held_out": [f"{a} + {b}" for a, b in held], "train_items": len(train),
              "settings": {k: (str(v) if isinstance(v, Path) else v)
                           for k, v in vars(args).items()},
              "runs": runs}
    plot_path = args.plot or args.out.with_suffix(".png")
    plot(result, plot_path)
    report(summary_lines(result), result, args.out)
    print(f"wrote {plot_path}")


if __name__ == "__main__":
    main()
