"""Learning behind a lagging eval gate: coupled PPO against decoupled PPO (--off-policy).

With `--eval-every K` the served adapter is the last one the gate passed, while the trainer
keeps stepping the candidate: turns are sampled up to K versions behind the weights they train.
Coupled PPO clips their ratio against the behaviour log-probs and drops most of their signal;
decoupled PPO clips against the step's own weights and weights each token by
min(pi / pi_behaviour, --behaviour-weight-cap) (training/losses.py).

The setup is tests/test_guard.py's honest-learning run: the embedded tiny model with its LoRA
seeded, one prompt, batches of 16 samples of 16 tokens at temperature 1, 30 steps at lr 5e-4,
the verifiable byte-alphabet reward (share of byte-level tokens, in [-1, 1]), the gate probing 8
prompts with the same reward. Each run's gain is the mean reward of 64 fresh samples from the
served adapter after the run minus before. Per off-policy mode and seed it runs eval_every 1
(the reference: at most one version behind) and the lagging gate, and prints each run's gain,
the ratio of the mean gains, and the staleness histogram of the trained turns.

    python bench/lagging_gate.py [--seeds 0 1 2] [--lag 5] [--rounds 30] [--cap 5]
                                               [--out bench/results/lagging_gate.json]
"""

import rlproxy  # noqa: F401, I001  (first: preloads OpenBLAS before anything imports mlx)

import argparse
import collections
import json
import queue
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import mlx.core as mx

from rlproxy.serving.engine import Engine
from rlproxy.serving.jobs import Job, SamplingParams
from rlproxy.serving.model import load_serving_model
from rlproxy.settings import ModelSettings, load_settings
from rlproxy.training.loop import Trainer, training_copy

TOPIC = "rivers"
PROBES = [f"Tell me about {t}." for t in ("rivers", "bread", "trains", "owls")]
BYTES = range(0, 256)  # the byte-level alphabet's ids in the tiny model's vocabulary


def byte_reward(turn, next_state):
    """Honest, verifiable: the share of byte-alphabet tokens, in [-1, 1]."""
    ids = turn["choices"][turn.get("chosen_choice", 0)]["completion_ids"]
    return 2 * sum(i in BYTES for i in ids) / max(1, len(ids)) - 1


def sample(engine, prompt, n, seed0, max_tokens=16):
    queues = []
    for i in range(n):
        q = queue.Queue()
        engine.submit(Job(prompt, SamplingParams(max_tokens=max_tokens, temperature=1.0,
                                                 seed=seed0 + i), q.put))
        queues.append(q)
    out = []
    for q in queues:
        ids, lps, versions = [], [], set()
        while True:
            step = q.get(timeout=120)
            if step.token is not None:
                ids.append(step.token.id)
                lps.append(step.token.logprob)
                versions.add(step.token.adapter_version)
            if step.finish_reason:
                break
        out.append((ids, lps, sorted(versions)))
    return out


def fresh_reward(engine, prompt, seed, n=64) -> float:
    return statistics.mean(byte_reward({"choices": [{"completion_ids": ids}]}, None)
                           for ids, _, _ in sample(engine, prompt, n, seed))


def run(seed: int, eval_every: int, off_policy: str, rounds: int, cap: float) -> dict:
    mx.random.seed(seed)  # the LoRA's initialisation: a run's dynamics repeat
    own = load_serving_model(ModelSettings(model="tiny"))
    with tempfile.TemporaryDirectory() as tmp:
        probes = Path(tmp) / "probes.jsonl"
        probes.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]})
                                  + "\n" for p in PROBES))
        settings = load_settings({
            "data_dir": tmp, "model": "tiny", "train": True, "batch_size": 16,
            "save_interval": 1000, "learning_rate": 5e-4, "eval_every": eval_every,
            "eval_probes": 8, "eval_max_tokens": 16, "eval_tolerance": 0.15,
            "eval_prompts": str(probes), "eval_reward_functions": ["lagging_gate:byte_reward"],
            "off_policy": off_policy, "behaviour_weight_cap": cap}, environ={})
        engine = Engine(own.model, own.tokenizer.eos_token_ids)
        engine.start()
        trainer = Trainer(settings, training_copy(own), own.lora_config, engine, data_dir=tmp,
                          tokenizer=own.tokenizer)
        messages = [{"role": "user", "content": f"Tell me about {TOPIC}."}]
        prompt = own.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        tic = time.perf_counter()
        try:
            before = fresh_reward(engine, prompt, 10**6 + seed)
            passed = evals = 0
            for r in range(rounds):
                batch = []
                for ids, lps, versions in sample(engine, prompt, 16, seed * 10**4 + r * 100):
                    turn = {"uid": uuid.uuid4().hex, "prompt_ids": prompt,
                            "messages": messages, "tools": None,
                            "choices": [{"completion_ids": ids, "logprobs": lps,
                                         "adapter_versions": versions}]}
                    reward = byte_reward(turn, None)
                    batch.append({"turn": turn, "reward": reward,
                                  "advantages": [reward] * len(ids)})
                for s in batch:
                    trainer.gate.observe(s["turn"])
                trainer.train_journaled(batch)
                trainer._done(batch)
                if trainer.gate.due:
                    line = trainer.evaluate()
                    evals += 1
                    passed += bool(line and line.get("passed"))
            after = fresh_reward(engine, prompt, 2 * 10**6 + seed)
        finally:
            trainer.stop()
            engine.stop()
        lines = [json.loads(x) for x in (Path(tmp) / "training.jsonl").read_text().splitlines()]
    stale = [s for ln in lines if ln["kind"] == "step" for s in ln["staleness"] if s is not None]
    return {"seed": seed, "eval_every": eval_every, "off_policy": off_policy,
            "before": before, "after": after, "gain": after - before,
            "evaluations": evals, "passed": passed,
            "staleness": dict(sorted(collections.Counter(stale).items())),
            "seconds": round(time.perf_counter() - tic, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--lag", type=int, default=5, help="the lagging gate's --eval-every")
    p.add_argument("--rounds", type=int, default=30, help="optimizer steps per run")
    p.add_argument("--cap", type=float, default=5.0, help="--behaviour-weight-cap")
    p.add_argument("--modes", nargs="+", default=["coupled", "decoupled"])
    p.add_argument("--no-reference", dest="reference", action="store_false",
                   help="skip the eval_every 1 runs (when sweeping the lagging gate's settings)")
    p.add_argument("--out", type=Path, default=Path("bench/results/lagging_gate.json"))
    a = p.parse_args()
    import sys
    sys.modules.setdefault("lagging_gate", sys.modules[__name__])  # the reward's import path
    runs = []
    for mode in a.modes:
        for seed in a.seeds:
            for every in ((1, a.lag) if a.reference else (a.lag,)):
                res = run(seed, every, mode, a.rounds, a.cap)
                runs.append(res)
                print(f"{mode:9} seed {seed} eval_every {every}: reward {res['before']:+.3f} -> "
                      f"{res['after']:+.3f} (gain {res['gain']:+.3f}), {res['passed']}/"
                      f"{res['evaluations']} passed, staleness {res['staleness']}, "
                      f"{res['seconds']} s", flush=True)
    summary = {}
    for mode in a.modes:
        ref = statistics.mean([r["gain"] for r in runs if r["off_policy"] == mode
                               and r["eval_every"] == 1] or [0.0])
        lag = statistics.mean(r["gain"] for r in runs if r["off_policy"] == mode
                              and r["eval_every"] == a.lag)
        hist = collections.Counter()
        for r in runs:
            if r["off_policy"] == mode and r["eval_every"] == a.lag:
                hist.update({int(k): v for k, v in r["staleness"].items()})
        summary[mode] = {"gain_eval_every_1": ref, f"gain_eval_every_{a.lag}": lag,
                         "ratio": lag / ref if ref else None,
                         "staleness_lagging": dict(sorted(hist.items()))}
        print(f"{mode}: mean gain eval_every 1 {ref:+.3f}, eval_every {a.lag} {lag:+.3f} "
              f"(ratio {lag / ref if ref else float('nan'):.2f}); staleness of trained turns "
              f"with the lagging gate: {dict(sorted(hist.items()))}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()},
                                 "runs": runs, "summary": summary}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
