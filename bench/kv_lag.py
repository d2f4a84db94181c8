"""What reusing prefix KV from older adapter versions costs in log-prob error and buys in hits.

Two parts, on the embedded model, in one run:

1. **Error.** The real Trainer takes `--steps` PPO steps (AdamW, batch of 2 agent-shaped turns,
   random +-1 rewards) at each learning rate in `--lrs`, and every step's adapter is kept. For
   `--eval-turns` held-out turns (a `--prompt-tokens` agent prompt + a 64-token completion) the
   completion's log-probs under the newest adapter v are computed twice: exact (the prompt
   prefilled under v) and stale (the prompt, all but its last token, prefilled under v - k, then
   the rest under v: what the engine does on a lagged hit). Reported per k: mean and max
   |stale - exact| per token, mean KL(exact || stale) of the next-token distribution, and for
   scale the policy's own move in those k steps (exact under v vs exact under v - k).
2. **Hit rate.** The real engine and prefix store serve `--sessions` sessions of `--turns` turns,
   round-robin, sharing a `--prompt-tokens` system prompt; each turn appends the model's reply
   and a new user message. An adapter from part 1 is published every `--swap-every` requests.
   Per lag N: share of prompt tokens served from the cache, lagged hits, time to first token.

The embedded model has seeded random weights, so absolute log-probs are not a trained model's;
the stale error relative to the policy's own move is the figure that carries over.

    python bench/kv_lag.py [--size tiny] [--prompt-tokens 4096] [--lrs 1e-5 1e-4 1e-3]
                           [--prompt-grad full|none] [--lags 0 1 2 4 8] [--swap-every 2]
                           [--out bench/results/kv_lag.json]
"""

import rlproxy  # noqa: F401, I001  (first: preloads OpenBLAS before anything imports mlx)

import argparse
import os
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_unflatten
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from common import environment, percentile, report
from rlproxy.kv.prefix_cache import open_prefix_cache
from rlproxy.serving.engine import Engine, Job, SamplingParams
from rlproxy.serving.model import load_serving_model, lora_weights
from rlproxy.settings import load_settings
from rlproxy.training.learner import training_copy
from rlproxy.training.loop import Trainer

KS = (1, 2, 4, 8)
WORDS = ("read the file run the tests fix the failing import check the schema call the tool "
         "search the repository summarise the diff open a pull request list the directory "
         "grep for the symbol edit the function explain the error").split()


def text_ids(tokenizer, rng: random.Random, n: int) -> list[int]:
    """About n tokens of agent-shaped text (instructions, JSON-ish tool talk)."""
    ids: list[int] = []
    while len(ids) < n:
        words = " ".join(rng.choice(WORDS) for _ in range(40))
        ids += tokenizer.encode(f'{{"tool": "{rng.choice(WORDS)}", "note": "{words}"}}\n',
                                add_special_tokens=False)
    return ids[:n]


def set_adapter(model, weights: dict) -> None:
    model.update(tree_unflatten(list(weights.items())))


def prefill(model, ids: list[int], chunk: int = 2048) -> list:
    cache = make_prompt_cache(model)
    for i in range(0, len(ids), chunk):
        model(mx.array(ids[i:i + chunk])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def tail_logprobs(model, cache, tail: list[int]) -> mx.array:
    """Log-softmax rows predicting tail[1:] from a cache holding what precedes tail[0]; the cache
    is trimmed back afterwards so it can be reused."""
    logits = model(mx.array(tail[:-1])[None], cache=cache)[0].astype(mx.float32)
    out = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(out)
    trim_prompt_cache(cache, len(tail) - 1)
    return out


def train_versions(loaded, settings, rng: random.Random, steps: int, prompt_tokens: int) -> list:
    """[adapter after 0 steps, after 1, ...] from the real Trainer on random-reward turns."""
    trainer = Trainer(settings, training_copy(loaded), loaded.lora_config, engine=None,
                      data_dir=settings.records.data_dir)
    versions = [dict(lora_weights(trainer.learner.model))]
    for step in range(steps):
        batch = []
        for i in range(settings.trainer.batch_size):
            prompt = text_ids(loaded.tokenizer, rng, prompt_tokens)
            completion = text_ids(loaded.tokenizer, rng, 32)
            logp = tail_logprobs(trainer.learner.model, prefill(trainer.learner.model, prompt[:-1]),
                                 prompt[-1:] + completion)  # behaviour = current policy
            behaviour = mx.take_along_axis(logp, mx.array(completion)[:, None], axis=1)[:, 0]
            reward = rng.choice([-1.0, 1.0])
            turn = {"uid": f"s{step}-{i}", "prompt_ids": prompt,
                    "choices": [{"completion_ids": completion, "logprobs": behaviour.tolist()}]}
            batch.append({"turn": turn, "reward": reward, "advantages": [reward] * 32})
        trainer.train_batch(batch)
        versions.append(dict(lora_weights(trainer.learner.model)))
        mx.eval(list(versions[-1].values()))
    trainer.writer.close()
    return versions


def stale_error(model, versions: list, turns: list) -> dict:
    """Per k: the completion's log-prob error with prompt KV from v - k, and the policy's move."""
    v = len(versions) - 1
    rows = {k: {"abs_err": [], "kl": [], "policy_abs": []} for k in KS if k <= v}
    for prompt, completion in turns:
        tail = prompt[-1:] + completion
        idx = mx.array(completion)[:, None]
        set_adapter(model, versions[v])
        exact_cache = prefill(model, prompt[:-1])
        exact = tail_logprobs(model, exact_cache, tail)
        for k in rows:
            set_adapter(model, versions[v - k])
            cache = prefill(model, prompt[:-1])
            old_policy = tail_logprobs(model, cache, tail)  # v - k all the way: the policy moved
            set_adapter(model, versions[v])
            stale = tail_logprobs(model, cache, tail)  # v - k prompt KV, v for the rest
            err = mx.abs(mx.take_along_axis(stale - exact, idx, axis=1))[:, 0]
            move = mx.abs(mx.take_along_axis(old_policy - exact, idx, axis=1))[:, 0]
            kl = (mx.exp(exact) * (exact - stale)).sum(axis=-1)
            rows[k]["abs_err"] += err.tolist()
            rows[k]["kl"] += kl.tolist()
            rows[k]["policy_abs"] += move.tolist()
    out = {}
    for k, r in rows.items():
        mean_err, mean_move = statistics.fmean(r["abs_err"]), statistics.fmean(r["policy_abs"])
        out[k] = {"mean_abs_logprob_err": mean_err, "max_abs_logprob_err": max(r["abs_err"]),
                  "p99_abs_logprob_err": percentile(r["abs_err"], 99),
                  "mean_kl": statistics.fmean(r["kl"]),
                  "mean_abs_policy_move": mean_move,
                  "err_over_policy_move": mean_err / mean_move if mean_move else None,
                  "tokens": len(r["abs_err"])}
    return out


def serve_sessions(loaded, versions: list, lag: int, args, directory: Path) -> dict:
    """The session workload on the real engine + store with --kv-reuse-max-lag `lag`."""
    set_adapter(loaded.model, versions[0])
    settings = load_settings({"kv_reuse_max_lag": lag}, environ={}).cache
    store = open_prefix_cache(directory, settings, loaded.model, loaded.model_id)
    engine = Engine(loaded.model, loaded.tokenizer.eos_token_ids, prefix_cache=store)
    engine.start()
    rng = random.Random(7)
    system = text_ids(loaded.tokenizer, rng, args.prompt_tokens)
    sessions = [system + text_ids(loaded.tokenizer, rng, 40) for _ in range(args.sessions)]
    version, served, rows = 0, 0, []
    try:
        for _turn in range(args.turns):
            for s, prompt in enumerate(sessions):
                if served and served % args.swap_every == 0 and version + 1 < len(versions):
                    version += 1
                    engine.publish_adapter(versions[version], version)
                    while engine.adapter_version != version:
                        time.sleep(0.005)
                done, steps = threading.Event(), []

                def deliver(step, steps=steps, done=done):
                    steps.append((time.perf_counter(), step))
                    if step.finish_reason is not None:
                        done.set()

                job = engine.submit(Job(list(prompt), SamplingParams(max_tokens=16, seed=s),
                                        deliver))
                assert done.wait(600) and steps[-1][1].error is None, "request failed"
                store.flush()
                served += 1
                reply = [st.token.id for _, st in steps]
                rows.append({"prompt": len(prompt), "cached": job.cached_tokens,
                             "kv_lag": (version - job.cached_version
                                        if job.cached_version is not None else None),
                             "ttft_s": steps[0][0] - job.submitted_at})
                sessions[s] = prompt + reply + text_ids(loaded.tokenizer, rng, 40)
        counters = store.health()
    finally:
        engine.stop()
        store.close()
    ttft = [r["ttft_s"] for r in rows]
    lags = [r["kv_lag"] for r in rows if r["kv_lag"]]
    return {"cached_share": sum(r["cached"] for r in rows) / sum(r["prompt"] for r in rows),
            "ttft_median_s": statistics.median(ttft), "ttft_p95_s": percentile(ttft, 95),
            "hits": counters["hits"], "hits_stale": counters["hits_stale"],
            "cached_tokens_stale": counters["cached_tokens_stale"],
            "mean_lag_of_stale_hits": statistics.fmean(lags) if lags else 0.0,
            "versions_served": version + 1, "requests": rows}


def run(args) -> dict:
    load_before = os.getloadavg()[0]
    tmp = Path(tempfile.mkdtemp(prefix="rlproxy-kvlag-"))
    flags = {"model": args.size, "data_dir": str(tmp), "batch_size": 2}
    if args.prompt_grad:  # the trainer's default otherwise
        flags["prompt_grad"] = args.prompt_grad
    loaded = load_serving_model(load_settings(flags, environ={}).model)
    rng = random.Random(0)
    turns = [(text_ids(loaded.tokenizer, rng, args.prompt_tokens),
              text_ids(loaded.tokenizer, rng, 64)) for _ in range(args.eval_turns)]
    error, trained = {}, {}
    for lr in args.lrs:
        settings = load_settings({**flags, "learning_rate": lr, "data_dir": str(tmp / str(lr))},
                                 environ={})
        tic = time.perf_counter()
        trained[lr] = train_versions(loaded, settings, random.Random(1), args.steps,
                                     args.train_prompt_tokens)
        error[lr] = stale_error(loaded.model, trained[lr], turns)
        error[lr]["train_s"] = time.perf_counter() - tic
        print(f"lr {lr:g}: " + "; ".join(
            f"k={k} err {e['mean_abs_logprob_err']:.2e} (max {e['max_abs_logprob_err']:.2e}) "
            f"vs policy move {e['mean_abs_policy_move']:.2e}"
            for k, e in error[lr].items() if k != "train_s"), flush=True)
    hits = {}
    for lag in args.lags:
        hits[lag] = serve_sessions(loaded, trained[args.lrs[len(args.lrs) // 2]], lag, args,
                                   tmp / f"pc{lag}")
        print(f"lag {lag}: cached share {hits[lag]['cached_share']:.1%}, "
              f"TTFT median {hits[lag]['ttft_median_s'] * 1000:.0f} ms", flush=True)
    trainer = load_settings(flags, environ={}).trainer
    return {**environment(args.size, load_before, loaded.model_id,
                          {**{k: v for k, v in vars(args).items() if k != "out"},
                           "trainer": trainer.model_dump(mode="json")}),
            "error_by_lr_and_k": {str(lr): {str(k): v for k, v in e.items()}
                                  for lr, e in error.items()},
            "sessions_by_lag": {str(lag): h for lag, h in hits.items()}}


def summary_lines(r: dict) -> list[str]:
    load = r["machine"]["load_average_1m"]
    a = r["settings"]
    lines = [f"machine: {r['machine']['cpus']} CPUs, load {load['before']:.2f} -> "
             f"{load['after']:.2f}; model: embedded {r['size']}; prompt {a['prompt_tokens']} "
             f"tokens, {a['steps']} {a['trainer']['loss_fn']} steps per lr, prompt_grad "
             f"{a['trainer'].get('prompt_grad', 'full')}",
             "stale prompt KV (k versions old): |log-prob error| mean / max per completion "
             "token, mean KL, vs the policy's own move in k steps"]
    for lr, by_k in r["error_by_lr_and_k"].items():
        for k, e in by_k.items():
            if k == "train_s":
                continue
            lines.append(f"  lr {float(lr):<6g} k={k}: err {e['mean_abs_logprob_err']:.2e} / "
                         f"{e['max_abs_logprob_err']:.2e}, KL {e['mean_kl']:.2e}, policy move "
                         f"{e['mean_abs_policy_move']:.2e} (err/move "
                         f"{e['err_over_policy_move']:.2f})")
    if r["sessions_by_lag"]:
        lines.append(f"sessions: {a['sessions']} x {a['turns']} turns, adapter swap every "
                     f"{a['swap_every']} requests")
    for lag, h in r["sessions_by_lag"].items():
        lines.append(f"  lag {lag}: {h['cached_share']:.1%} of prompt tokens cached, "
                     f"{h['hits_stale']} lagged hits (mean lag {h['mean_lag_of_stale_hits']:.1f})"
                     f", TTFT median {h['ttft_median_s'] * 1000:.0f} ms, p95 "
                     f"{h['ttft_p95_s'] * 1000:.0f} ms")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--prompt-tokens", type=int, default=4096,
                        help="the eval turns' and the sessions' shared prompt")
    parser.add_argument("--train-prompt-tokens", type=int, default=512)
    parser.add_argument("--eval-turns", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="PPO steps (adapter versions)")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-5, 1e-4, 1e-3])
    parser.add_argument("--lags", type=int, nargs="*", default=[0, 1, 2, 4, 8],
                        help="lags for the session part (none: skip it)")
    parser.add_argument("--prompt-grad", choices=["full", "none"],
                        help="the trainer's --prompt-grad (default: its own default)")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--swap-every", type=int, default=2, help="requests per adapter version")
    parser.add_argument("--out", type=Path, default=Path("bench/results/kv_lag.json"))
    args = parser.parse_args()
    result = run(args)
    report(summary_lines(result), result, args.out)


if __name__ == "__main__":
    main()
