"""Training benchmark: what a hot-swap and a training thread cost live decoding, and PPO vs SFT.

Runs, in one process on one machine, against the embedded model, with the real Engine and
Trainer threads (no HTTP; no prefix cache except where said):

1. Swap pause: a few requests decode continuously while this thread publishes new adapter
   versions (evaluated in advance) every 100 ms. Per swap: the engine's own time around
   `model.update` (stats.last_swap_ms), and the extra pause it causes: the gap between the
   engine step that applied it and the step before, minus the median gap of the 10 clean steps
   on either side. p50/p99 of both. Twice: without the prefix cache, and with it (the server's
   default), where a swap also digests the new adapter on the engine thread.
2. Decode while training: aggregate tok/s of 4 clients, each keeping one 256-token request in
   flight (end token suppressed, so every request has the same length and the KV lengths are
   the same whatever the speed), with no training, then with the Trainer thread training
   continuously on scored turns (and publishing each step to the engine), at duty_cycle 0.5
   (the default) and 1.0, timed from the end of one step to the end of a later one (whole
   train + pause cycles). Conditions alternate in rounds; medians and ratios to idle.
3. PPO vs SFT step: `Trainer.train_step` (ppo loss) on a batch of turns versus a plain
   mlx-lm-style LoRA SFT step on the same tokens: same base weights and LoRA layers
   (`training_copy`), AdamW with the same settings, the same padding-free per-sequence
   forward/backward with gradients summed and evaluated per sequence, cross-entropy over the
   same completion tokens, then the optimizer update and `mx.eval`. The Trainer's step also
   clips the gradient norm and writes its training.jsonl line (the SFT step does neither).
   Alternated A B A B ...; medians and their ratio.

The training turns are real engine generations at temperature 1: their completion ids and
behaviour log-probs come from the engine (end token suppressed, so lengths are fixed).
Checkpoints are off (save_interval 10^9): the figures time steps, not disk.

Prints one line per figure and writes everything to a JSON file. It measures; it changes
nothing in rlproxy.

    python bench/swap.py [--size tiny|small|smollm2-135m-instruct] [--out bench/results/swap.json]
"""

import rlproxy  # noqa: F401, I001  (first: preloads OpenBLAS before anything imports mlx)

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_map

from common import environment, percentile, report
from rlproxy.kv.blobs import adapter_fingerprint
from rlproxy.kv.prefix_cache import open_prefix_cache
from rlproxy.paths import TRAINING
from rlproxy.records import read_jsonl
from rlproxy.serving.engine import Engine, Job, SamplingParams
from rlproxy.serving.model import LoadedModel, load_serving_model, lora_weights
from rlproxy.settings import Settings, load_settings
from rlproxy.training.learner import training_copy
from rlproxy.training.loop import Trainer

PAUSE_GOAL_MS = 5.0  # extra decode pause caused by one swap, p50 and p99, at most
DECODE_GOAL = 0.5  # decode tok/s while training at the default duty cycle / idle, at least
STEP_GOAL = 1.3  # PPO step time / SFT step time on the same tokens, at most
NEIGHBOURS = 10  # clean steps on each side of a swap that give its typical gap

SYSTEM_PROMPT = """\
You are an autonomous software engineering agent running inside a developer's terminal. You
read, write, test and debug code in their repository with a shell and a file editor. Work in
small, verifiable steps, run the tests after every change, and keep answers short.
"""
USER_MESSAGE = (
    "The endpoint GET /items?page=2 returns the same items as page 1. Find out why, fix it, "
    "and add a test that would have caught it."
)


# ---- load on the engine: clients that keep requests decoding ----


class Clients:
    """`n` clients, each keeping one request decoding; one trace entry per engine step."""

    def __init__(self, engine: Engine, prompt_ids: list[int], n: int, max_tokens: int,
                 eos_ids: list[int]):
        self.engine, self.prompt_ids, self.n, self.max_tokens = engine, prompt_ids, n, max_tokens
        self.no_eos = {t: -1e9 for t in eos_ids}
        self.trace: list[tuple] = []  # (time, engine step, swaps applied, last swap ms)
        self.tokens = 0
        self.errors: list[str] = []
        self._jobs: dict[int, Job] = {}
        self._seed = 0
        self._running = False

    def start(self) -> None:
        self._running = True
        for i in range(self.n):
            self._submit(i)

    def stop(self) -> None:
        self._running = False
        for job in list(self._jobs.values()):
            self.engine.cancel(job)
        deadline = time.perf_counter() + 10
        while self.engine.stats.active and time.perf_counter() < deadline:
            time.sleep(0.01)
        if self.errors:
            raise RuntimeError(f"{len(self.errors)} requests failed, e.g. {self.errors[0]}")

    def _submit(self, i: int) -> None:
        self._seed += 1
        params = SamplingParams(max_tokens=self.max_tokens, temperature=1.0, seed=self._seed,
                                logit_bias=self.no_eos)
        self._jobs[i] = self.engine.submit(
            Job(self.prompt_ids, params, deliver=lambda step, i=i: self._deliver(i, step)))

    def _deliver(self, i: int, step) -> None:  # on the engine thread
        s = self.engine.stats
        if not self.trace or self.trace[-1][1] != s.steps:
            self.trace.append((time.perf_counter(), s.steps, s.swaps, s.last_swap_ms))
        if step.token is not None:
            self.tokens += 1
        if step.error is not None:
            self.errors.append(step.error)
        if step.finish_reason is not None and self._running:
            self._submit(i)  # submit only queues a message: safe on the engine thread


def generate(engine: Engine, prompt_ids: list[int], n: int, max_tokens: int,
             eos_ids: list[int]) -> list[tuple[list[int], list[float]]]:
    """n sampled completions (ids, behaviour log-probs) of exactly max_tokens tokens."""
    out = [([], []) for _ in range(n)]
    errors = []
    done = threading.Semaphore(0)

    def deliver(i, step):  # on the engine thread: never raise here
        if step.token is not None:
            out[i][0].append(step.token.id)
            out[i][1].append(step.token.logprob)
        if step.error is not None:
            errors.append(step.error)
        if step.finish_reason is not None:
            done.release()

    for i in range(n):
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1000 + i,
                                logit_bias={t: -1e9 for t in eos_ids})
        engine.submit(Job(prompt_ids, params, deliver=lambda step, i=i: deliver(i, step)))
    for _ in range(n):
        if not done.acquire(timeout=120):
            raise RuntimeError("the engine did not finish the behaviour generations")
    if errors:
        raise RuntimeError(f"a behaviour generation failed: {errors[0]}")
    return out


def scored_turn(prompt_ids: list[int], completion: tuple[list[int], list[float]], k: int) -> dict:
    """What the scorer hands the trainer, with a fresh uid (the trainer skips uids it has seen)."""
    ids, logprobs = completion
    reward = float(k % 2)  # alternating, so the running-mean baseline leaves nonzero advantages
    return {"turn": {"uid": f"bench-{k}", "prompt_ids": prompt_ids,
                     "choices": [{"completion_ids": ids, "logprobs": logprobs}]},
            "reward": reward, "advantages": [reward] * len(ids)}


def bench_settings(size: str, data_dir: Path, duty_cycle: float = 0.5) -> Settings:
    # environ={}: the benchmark must not pick up a user's RLPROXY_* variables.
    return load_settings({"model": size, "data_dir": data_dir, "save_interval": 10**9,
                          "duty_cycle": duty_cycle}, environ={})


# ---- 1. the swap pause ----


def measure_swap_pause(engine: Engine, loaded: LoadedModel, clients: Clients, swaps: int,
                       interval: float) -> dict:
    original = lora_weights(loaded.model)
    # Every version new arrays for every adapter parameter, as the trainer publishes them.
    versions = [{k: v + 1e-3 * mx.random.normal(v.shape) for k, v in original.items()}
                for _ in range(swaps)]
    mx.eval(versions)  # concrete: the engine thread must never evaluate a graph made here
    first = engine.adapter_version + 1
    clients.trace.clear()
    clients.start()
    time.sleep(1.0)  # past the prefill, into steady decoding
    for i, weights in enumerate(versions):
        engine.publish_adapter(weights, first + i)
        time.sleep(interval)
    time.sleep(0.5)
    clients.stop()
    engine.publish_adapter(original, first + swaps)  # back to the weights the trainers copy

    trace = clients.trace
    gap = {i: (trace[i][0] - trace[i - 1][0]) * 1000 for i in range(1, len(trace))
           if trace[i][1] == trace[i - 1][1] + 1}  # ms, between consecutive engine steps only
    at_swap = [i for i in range(1, len(trace)) if trace[i][2] != trace[i - 1][2]]
    touched = {j for i in at_swap for j in (i, i + 1)}
    clean = sorted(i for i in gap if i not in touched)

    def typical(i: int) -> float:
        before = [gap[j] for j in clean if j < i][-NEIGHBOURS:]
        after = [gap[j] for j in clean if i < j][:NEIGHBOURS]
        return statistics.median(before + after)

    # A step can apply several swaps when the process was starved for longer than the interval.
    per_swap = [{"engine_swap_ms": trace[i][3], "gap_ms": gap[i], "typical_gap_ms": typical(i),
                 "next_gap_ms": gap.get(i + 1), "swaps": trace[i][2] - trace[i - 1][2]}
                for i in at_swap if i in gap]
    if not per_swap:
        raise RuntimeError("no swap landed between two consecutive decode steps")
    extra = [x["gap_ms"] - x["typical_gap_ms"] for x in per_swap]
    extra_next = [x["next_gap_ms"] - x["typical_gap_ms"] for x in per_swap
                  if x["next_gap_ms"] is not None]
    # The same statistic at steps without a swap: the machine's own jitter, for comparison.
    control = [gap[i] - typical(i) for i in clean[NEIGHBOURS:-NEIGHBOURS]]
    swap_ms = [x["engine_swap_ms"] for x in per_swap]
    clean_gaps = [gap[j] for j in clean]
    return {
        "prefix_cache": engine.prefix_cache is not None,
        "clients": clients.n, "swaps_published": swaps, "swap_steps_measured": len(per_swap),
        "swaps_applied_while_decoding": trace[-1][2] - trace[0][2],
        "steps_with_several_swaps": sum(x["swaps"] > 1 for x in per_swap),
        "interval_s": interval,
        "adapter_parameters": sum(v.size for v in original.values()),
        "adapter_arrays": len(original),
        "engine_swap_ms": {"p50": percentile(swap_ms, 50), "p99": percentile(swap_ms, 99),
                           "max": max(swap_ms)},
        "extra_pause_ms": {"p50": percentile(extra, 50), "p99": percentile(extra, 99),
                           "max": max(extra)},
        "extra_pause_next_step_ms": {"p50": percentile(extra_next, 50),
                                     "p99": percentile(extra_next, 99)},
        "no_swap_control_ms": {"p50": percentile(control, 50), "p99": percentile(control, 99),
                               "steps": len(control)},
        "step_gap_ms": {"p50": percentile(clean_gaps, 50), "p99": percentile(clean_gaps, 99),
                        "steps": len(clean_gaps)},
        "goal_ms_at_most": PAUSE_GOAL_MS,
        "met": percentile(extra, 50) <= PAUSE_GOAL_MS and percentile(extra, 99) <= PAUSE_GOAL_MS,
        "per_swap": per_swap,
    }


def measure_swap_with_prefix_cache(loaded: LoadedModel, settings: Settings,
                                   prompt_ids: list[int], eos: list[int],
                                   args: argparse.Namespace, tmp: Path) -> dict:
    """The same, on an engine with the prefix cache (the server's default): there a swap also
    digests the new adapter (`adapter_fingerprint`) on the engine thread."""
    cache = open_prefix_cache(tmp / "prefix_cache", settings.cache, loaded.model,
                              loaded.model_id)
    fingerprint_ms = []
    for _ in range(5):  # the digest alone, here, while no engine thread runs it
        tic = time.perf_counter()
        adapter_fingerprint(loaded.model)
        fingerprint_ms.append((time.perf_counter() - tic) * 1000)
    engine = Engine(loaded.model, eos, max_batch=settings.engine.max_batch,
                    prefill_step_size=settings.engine.prefill_step_size, prefix_cache=cache)
    engine.start()
    try:
        result = measure_swap_pause(
            engine, loaded, Clients(engine, prompt_ids, args.clients, 100_000, eos),
            args.swaps, args.swap_interval)
    finally:
        engine.stop()
        cache.close()
    if engine.error:
        raise RuntimeError(f"the engine thread died: {engine.error}")
    result["adapter_fingerprint_ms_median"] = statistics.median(fingerprint_ms)
    return result


# ---- 2. decode tok/s while training ----


def decode_window(engine: Engine, loaded: LoadedModel, clients: Clients, turns: list,
                  prompt_ids: list[int], size: str, duty: float | None, window: float,
                  warm: float, data_dir: Path, uids: list[int]) -> dict:
    """Aggregate decode tok/s over at least `window` seconds, with a training thread when duty
    is set (then over whole train + pause cycles)."""
    trainer = None
    clients.trace.clear()
    clients.start()
    try:
        if duty is not None:
            settings = bench_settings(size, data_dir, duty)
            trainer = Trainer(settings, training_copy(loaded), loaded.lora_config, engine)

            def top_up():  # keep two batches queued: the trainer never waits for data
                while trainer.books.inbox.qsize() < 2 * settings.trainer.batch_size:
                    uids[0] += 1
                    trainer.submit(scored_turn(prompt_ids, turns[uids[0] % len(turns)], uids[0]))

            top_up()
            trainer.start()

        def wait(until) -> None:
            deadline = time.perf_counter() + 600
            while not until():
                if trainer is not None:
                    top_up()
                if time.perf_counter() > deadline:
                    raise RuntimeError("the trainer made no step in 600 s")
                time.sleep(0.01)

        time.sleep(warm)
        if trainer is not None:
            # From the end of one step to the end of another: whole train + pause cycles, so
            # the window holds the duty cycle's share exactly. Step 1 (graph building) and the
            # pause after it, which is as long, are left out.
            wait(lambda: trainer.step >= 2)
        tok0, t0, swaps0 = clients.tokens, time.perf_counter(), engine.stats.swaps
        step0 = trainer.step if trainer else 0
        wait(lambda: time.perf_counter() - t0 >= window)
        if trainer is not None:
            reached = trainer.step
            wait(lambda: trainer.step > reached)
        tok1, t1, swaps1 = clients.tokens, time.perf_counter(), engine.stats.swaps
        step1 = trainer.step if trainer else 0
    finally:
        if trainer is not None:
            trainer.stop()
        clients.stop()
    trace = clients.trace
    result = {"duty_cycle": duty, "seconds": t1 - t0, "tokens": tok1 - tok0,
              "tok_per_s": (tok1 - tok0) / (t1 - t0), "swaps": swaps1 - swaps0,
              "engine_swap_ms": [trace[i][3] for i in range(1, len(trace))
                                 if trace[i][2] != trace[i - 1][2]]}
    if trainer is not None:
        if trainer.error:
            raise RuntimeError(f"the trainer thread died: {trainer.error}")
        lines = [x for x in read_jsonl(data_dir / TRAINING) if step0 < x["step"] <= step1]
        result.update(train_steps=step1 - step0,
                      train_steps_per_s=(step1 - step0) / (t1 - t0),
                      train_step_s_median=statistics.median(x["step_time_s"] for x in lines)
                      if lines else None,
                      train_share=sum(x["step_time_s"] for x in lines) / (t1 - t0))
    return result


def measure_decode(engine: Engine, loaded: LoadedModel, clients: Clients, turns: list,
                   prompt_ids: list[int], size: str, rounds: int, window: float, warm: float,
                   tmp: Path) -> dict:
    duties = [None, 0.5, 1.0]
    runs = {d: [] for d in duties}
    uids = [0]
    for r in range(rounds):  # alternated, so drift hits every condition alike
        for d in duties:
            data_dir = tmp / f"decode-{r}-{d}"
            runs[d].append(decode_window(engine, loaded, clients, turns, prompt_ids, size, d,
                                         window, warm, data_dir, uids))
    idle = statistics.median(x["tok_per_s"] for x in runs[None])
    out = {"clients": clients.n, "max_tokens_per_request": clients.max_tokens,
           "window_s": window, "rounds": rounds,
           "idle_tok_per_s_median": idle, "idle_runs": runs[None]}
    for d in duties[1:]:
        rate = statistics.median(x["tok_per_s"] for x in runs[d])
        swap_ms = [ms for x in runs[d] for ms in x["engine_swap_ms"]]
        out[f"duty_{d}"] = {"tok_per_s_median": rate, "ratio": rate / idle,
                            # each window against the idle window of its own round
                            "paired_ratio_median": statistics.median(
                                x["tok_per_s"] / i["tok_per_s"] for x, i in zip(runs[d],
                                                                               runs[None])),
                            "engine_swap_ms_max": max(swap_ms, default=None),
                            "train_steps_per_s_median":
                                statistics.median(x["train_steps_per_s"] for x in runs[d]),
                            "runs": runs[d]}
    out["goal_ratio_at_least"] = DECODE_GOAL
    out["met"] = out["duty_0.5"]["ratio"] >= DECODE_GOAL
    return out


# ---- 3. PPO step vs plain LoRA SFT step ----


def sft_loss(model, inputs, targets, mask, n_tokens):
    # mlx-lm's default_loss, over one unpadded sequence: cross-entropy on completion tokens.
    ce = nn.losses.cross_entropy(model(inputs), targets) * mask
    return ce.astype(mx.float32).sum() / n_tokens


def sft_step(model, optimizer, grad_fn, examples: list[dict]) -> float:
    tic = time.perf_counter()
    n_tokens = sum(e["tokens"] for e in examples)
    grads = None
    for ex in examples:  # the trainer's example: position t predicts ids[t + 1]
        ids = ex["ids"]
        inputs, targets = mx.array(ids[:-1])[None], mx.array(ids[1:])[None]
        loss, g = grad_fn(model, inputs, targets, mx.array(ex["mask"])[None], n_tokens)
        grads = g if grads is None else tree_map(mx.add, grads, g)
        mx.eval(loss, grads)
    optimizer.update(model, grads)
    mx.eval(model.parameters(), optimizer.state)
    return time.perf_counter() - tic


def measure_steps(loaded: LoadedModel, turns: list, prompt_ids: list[int], size: str,
                  repeats: int, warmup: int, tmp: Path) -> dict:
    settings = bench_settings(size, tmp / "steps")
    t = settings.trainer
    trainer = Trainer(settings, training_copy(loaded), loaded.lora_config)  # no engine: no swaps
    batch = [scored_turn(prompt_ids, turns[k % len(turns)], k) for k in range(t.batch_size)]
    examples = [trainer.runner.example(s) for s in batch]  # the trainer's own conversion, once
    model = training_copy(loaded)  # same base arrays, same LoRA layers and initial values
    optimizer = optim.AdamW(learning_rate=t.learning_rate, weight_decay=t.weight_decay)
    optimizer.init(model.trainable_parameters())
    grad_fn = nn.value_and_grad(model, sft_loss)
    ppo_s, sft_s = [], []
    for i in range(warmup + repeats):
        tic = time.perf_counter()
        trainer.runner.train_step(examples)
        p = time.perf_counter() - tic
        s = sft_step(model, optimizer, grad_fn, examples)
        if i >= warmup:
            ppo_s.append(p)
            sft_s.append(s)
    trainer.stop()
    ppo, sft = statistics.median(ppo_s), statistics.median(sft_s)
    return {
        "loss_fn": t.loss_fn, "turns": len(examples),
        "tokens_per_turn": [len(e["ids"]) - 1 for e in examples],
        "completion_tokens": sum(e["tokens"] for e in examples),
        "lora": loaded.lora_config, "learning_rate": t.learning_rate, "grad_clip": t.grad_clip,
        "ppo_median_s": ppo, "sft_median_s": sft, "ratio": ppo / sft,
        "paired_ratio_median": statistics.median(p / s for p, s in zip(ppo_s, sft_s)),
        "min_ratio": min(ppo_s) / min(sft_s),  # the least disturbed run of each
        "goal_ratio_at_most": STEP_GOAL, "met": ppo / sft <= STEP_GOAL,
        "ppo_s": ppo_s, "sft_s": sft_s,
    }


# ---- report ----


def summary_lines(result: dict) -> list[str]:
    verdict = {True: "met", False: "NOT met"}
    load = result["machine"]["load_average_1m"]
    d, s = result["decode"], result["steps"]
    lines = [
        f"machine: {result['machine']['cpus']} CPUs, 1-min load average {load['before']:.2f} "
        f"before, {load['after']:.2f} after (other processes on the CPUs skew every figure)",
        f"model: embedded {result['size']} ({result['model_id']}), BLAS: {result['blas']}, "
        f"mlx {result['mlx_version']}, mlx-lm {result['mlx_lm_version']}; prompt "
        f"{result['prompt_tokens']} tokens, training completions {result['completion_tokens']} "
        f"tokens",
    ]
    for p in (result["swap_pause"], result["swap_pause_prefix_cache"]):
        name = "swap, prefix cache on" if p["prefix_cache"] else "swap, no prefix cache"
        lines += [
            f"{name}: engine's stats.last_swap_ms p50 {p['engine_swap_ms']['p50']:.2f} ms, "
            f"p99 {p['engine_swap_ms']['p99']:.2f} ms ({p['swap_steps_measured']} steps applying "
            f"{p['swaps_applied_while_decoding']} swaps of {p['adapter_arrays']} arrays / "
            f"{p['adapter_parameters']} parameters, {p['clients']} requests decoding)"
            + (f"; adapter_fingerprint alone {p['adapter_fingerprint_ms_median']:.2f} ms"
               if p["prefix_cache"] else ""),
            f"{name}: extra decode pause p50 {p['extra_pause_ms']['p50']:+.2f} ms, p99 "
            f"{p['extra_pause_ms']['p99']:+.2f} ms (next step p50 "
            f"{p['extra_pause_next_step_ms']['p50']:+.2f} ms); the same at steps without a "
            f"swap: p50 {p['no_swap_control_ms']['p50']:+.2f} ms, p99 "
            f"{p['no_swap_control_ms']['p99']:+.2f} ms; step gap p50 "
            f"{p['step_gap_ms']['p50']:.2f} ms (goal <= {PAUSE_GOAL_MS} ms: {verdict[p['met']]})",
        ]
    if d is None:  # --swap-only
        return lines
    for duty in (0.5, 1.0):
        x = d[f"duty_{duty}"]
        lines.append(
            f"decode while training, duty_cycle {duty}: {x['tok_per_s_median']:.0f} tok/s vs "
            f"idle {d['idle_tok_per_s_median']:.0f} tok/s ({d['clients']} requests, median of "
            f"{d['rounds']} windows of >= {d['window_s']:.0f} s) -> {x['ratio']:.2f}x, paired "
            f"ratios' median {x['paired_ratio_median']:.2f}x; trainer "
            f"{x['train_steps_per_s_median']:.2f} steps/s, swaps up to "
            f"{x['engine_swap_ms_max'] or 0:.2f} ms"
            + (f" (goal >= {DECODE_GOAL}x: {verdict[d['met']]})" if duty == 0.5 else ""))
    lines.append(
        f"step: PPO Trainer.train_step {s['ppo_median_s'] * 1000:.1f} ms vs LoRA SFT "
        f"{s['sft_median_s'] * 1000:.1f} ms ({s['turns']} turns, {s['completion_tokens']} "
        f"completion tokens, median of {len(s['ppo_s'])}) -> {s['ratio']:.2f}x; paired ratios' "
        f"median {s['paired_ratio_median']:.2f}x, minima's {s['min_ratio']:.2f}x "
        f"(goal <= {STEP_GOAL}x: {verdict[s['met']]})")
    return lines


def run(args: argparse.Namespace) -> dict:
    load_before = os.getloadavg()[0]
    mx.random.seed(0)
    settings = bench_settings(args.size, Path(tempfile.gettempdir()))
    loaded = load_serving_model(settings.model)  # this (main) thread: see server.engine_context
    eos = sorted(loaded.tokenizer.eos_token_ids)
    prompt_ids = list(loaded.tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": USER_MESSAGE}],
        add_generation_prompt=True))
    engine = Engine(loaded.model, eos, max_batch=settings.engine.max_batch,
                    prefill_step_size=settings.engine.prefill_step_size)
    with tempfile.TemporaryDirectory(prefix="rlproxy-bench-swap-") as tmp:
        engine.start()
        try:
            turns = generate(engine, prompt_ids, 8, args.completion_tokens, eos)
            swap = measure_swap_pause(
                engine, loaded, Clients(engine, prompt_ids, args.clients, 100_000, eos),
                args.swaps, args.swap_interval)
            swap_cached = measure_swap_with_prefix_cache(
                loaded, settings, prompt_ids, eos, args, Path(tmp))
            decode = None if args.swap_only else measure_decode(
                engine, loaded, Clients(engine, prompt_ids, args.clients, 256, eos), turns,
                prompt_ids, args.size, args.rounds, args.window, args.warm, Path(tmp))
        finally:
            # Here, not at exit: the steps below want the CPUs to themselves, and a thread that
            # ran MLX work must be long gone when the interpreter exits (it can abort otherwise).
            engine.stop()
        if engine.error:
            raise RuntimeError(f"the engine thread died: {engine.error}")
        steps = None if args.swap_only else measure_steps(
            loaded, turns, prompt_ids, args.size, args.repeats, args.warmup, Path(tmp))
    return {
        **environment(args.size, load_before, loaded.model_id, settings.model_dump(mode="json")),
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": args.completion_tokens,
        "swap_pause": swap,
        "swap_pause_prefix_cache": swap_cached,
        "decode": decode,
        "steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny",
                        choices=["tiny", "small", "smollm2-135m-instruct"])
    parser.add_argument("--clients", type=int, default=4, help="requests decoding at once")
    parser.add_argument("--swaps", type=int, default=50, help="swap pause: adapter versions")
    parser.add_argument("--swap-interval", type=float, default=0.1, help="seconds between swaps")
    parser.add_argument("--rounds", type=int, default=3, help="decode: rounds of conditions")
    parser.add_argument("--window", type=float, default=6.0, help="decode: seconds measured")
    parser.add_argument("--warm", type=float, default=1.0, help="decode: seconds before that")
    parser.add_argument("--completion-tokens", type=int, default=128,
                        help="tokens per training completion")
    parser.add_argument("--repeats", type=int, default=11, help="steps: timed PPO/SFT pairs")
    parser.add_argument("--warmup", type=int, default=2, help="steps: untimed PPO/SFT pairs")
    parser.add_argument("--swap-only", action="store_true",
                        help="measure the swap pause only (part 1), not decode or steps")
    parser.add_argument("--out", type=Path, default=Path("bench/results/swap.json"))
    args = parser.parse_args()
    result = run(args)
    report(summary_lines(result), result, args.out)


if __name__ == "__main__":
    main()
