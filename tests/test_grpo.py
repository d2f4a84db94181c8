"""GRPO through the real trainer on the tiny model: n = 4 choices per request with group-relative
advantages (r - mean of the group, `baselined`) against n = 1 with the running-mean baseline,
the same verifiable reward, the same number of sampled completions per optimizer step (8), over
several seeds. Also: the items of a group train their own choice under their own key.

The figure per run is the gain in the reward of the completions each step trained on (the
policy being trained sampled them: the trainer publishes every step), mean of the last 4 steps
less the first 4's. They are printed; `python3 tests/test_grpo.py SEED...` prints more seeds."""

from __future__ import annotations

import random
import statistics
import sys
import uuid

import rlproxy  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import pytest

from rlproxy.serving.engine import Engine
from rlproxy.serving.model import load_serving_model
from rlproxy.settings import ModelSettings
from rlproxy.training.loop import Trainer, training_copy
from conftest import make_settings, read_records
from test_guard import byte_reward, sample

TOPICS = ["rivers", "bread", "trains", "owls", "glass", "tides", "maps", "bees", "salt", "kites",
          "clocks", "ferns"]
TRAIN, HELD_OUT = TOPICS[:8], TOPICS[8:]
# How generous each topic's reward is, as real tasks differ in difficulty: what a group
# baseline removes and a running mean across prompts cannot.
EASE = dict(zip(TOPICS, [-0.6, -0.2, 0.2, 0.6] * 3))


def reward(topic: str, ids: list[int]) -> float:
    """Verifiable: the byte-token share of the reply (test_guard.byte_reward), shifted by the
    topic's EASE, in [-1, 1]."""
    return max(-1.0, min(1.0, byte_reward({"choices": [{"completion_ids": ids}]}, None)
                         + EASE[topic]))
STEPS, BATCH, LR = 20, 16, 1e-3
SEEDS = (1, 2, 3)


def messages(topic):
    return [{"role": "user", "content": f"Tell me about {topic}."}]


def group_items(prompt, topic, samples, baselined):
    """One request's choices as the scorer hands them over: choice i under key uid (i = 0)
    or uid/i, the advantage r - mean(group) when BASELINED (GRPO), r otherwise."""
    uid = uuid.uuid4().hex
    turn = {"uid": uid, "prompt_ids": prompt, "messages": messages(topic), "tools": None,
            "chosen_choice": 0,
            "choices": [{"completion_ids": ids, "logprobs": lps} for ids, lps in samples]}
    rewards = [reward(topic, c["completion_ids"]) for c in turn["choices"]]
    mean = statistics.mean(rewards) if baselined else 0.0
    return [{"turn": turn, "choice": i, "key": uid if i == 0 else f"{uid}/{i}",
             "reward": r, "advantages": [r - mean] * len(turn["choices"][i]["completion_ids"]),
             "baselined": baselined}
            for i, r in enumerate(rewards)]


def run(n: int, seed: int, tmp_path, steps: int = STEPS) -> list[float]:
    """Train STEPS steps on N choices per request; the byte share reward (unshifted) of each
    step's samples, which the policy being trained drew (the trainer publishes every step)."""
    mx.random.seed(seed)  # the same LoRA initialisation for both arms of a seed
    own = load_serving_model(ModelSettings(model="tiny"))
    settings = make_settings(tmp_path, train=True, batch_size=BATCH, learning_rate=LR,
                             save_interval=1000, baseline="group" if n > 1 else "mean")
    engine = Engine(own.model, own.tokenizer.eos_token_ids)
    engine.start()
    trainer = Trainer(settings, training_copy(own), own.lora_config, engine, data_dir=tmp_path)
    rng = random.Random(seed)
    curve = []
    try:
        for step in range(steps):
            batch = []
            for r in range(BATCH // n):
                topic = rng.choice(TRAIN)
                prompt = own.tokenizer.apply_chat_template(messages(topic),
                                                           add_generation_prompt=True)
                samples = sample(engine, prompt, n, seed * 10**5 + step * 100 + r * n)
                batch += group_items(prompt, topic, samples, baselined=n > 1)
            curve.append(statistics.mean(
                byte_reward({"choices": [s["turn"]["choices"][s["choice"]]]}, None)
                for s in batch))
            trainer.train_journaled(batch)
    finally:
        trainer.stop()
        engine.stop()
    return curve


def gain(curve: list[float], k: int = 4) -> float:
    """Mean of the last K steps' sample reward less the first K's."""
    return statistics.mean(curve[-k:]) - statistics.mean(curve[:k])


@pytest.mark.slow
def test_grpo_with_four_choices_learns_faster_per_step_than_one_with_a_mean_baseline(
        tmp_path):
    curves = {(n, seed): run(n, seed, tmp_path / f"n{n}-s{seed}") for seed in SEEDS
              for n in (4, 1)}
    gains = {k: gain(c) for k, c in curves.items()}
    for (n, seed), c in sorted(curves.items()):
        print(f"n={n} seed={seed}: gain {gains[(n, seed)]:+.3f}: "
              + " ".join(f"{x:+.2f}" for x in c))
    grpo = statistics.mean(gains[(4, s)] for s in SEEDS)
    mean = statistics.mean(gains[(1, s)] for s in SEEDS)
    print(f"mean gain over {STEPS} steps: n=4 group {grpo:+.3f}, n=1 mean baseline {mean:+.3f}")
    # every step trained its 16 completions, each choice under its own key; a batch whose
    # groups all got equal rewards (the policy saturated the reward) is skipped, as it must be
    records = read_records(tmp_path / f"n4-s{SEEDS[0]}", "training.jsonl")
    lines = [ln for ln in records if ln["kind"] == "step"]
    no_signal = [ln for ln in records if ln["kind"] == "skipped"
                 and "every advantage" in ln["reason"]]
    assert len(lines) + len(no_signal) == STEPS and len(lines) >= STEPS - 3
    assert all(ln["turns"] == BATCH for ln in lines)
    keys = [k for ln in lines for k in ln["uids"]]
    assert len(set(keys)) == len(keys) == len(lines) * BATCH
    assert sum("/" in k for k in keys) == len(lines) * BATCH * 3 // 4
    # Seen here over seeds 1-6: n=4 +1.51 +0.36 +0.17 +1.38 +1.47 +1.57 (mean +1.07), n=1
    # +0.30 +1.11 +0.02 -0.01 +0.72 +0.93 (mean +0.51): GRPO ahead in 5 of 6. The take-off is
    # sudden and its step varies, so one seed can go either way: asserted is that GRPO learns
    # and is not behind on average beyond that noise.
    assert grpo > 0.1, gains
    assert grpo > mean - 0.1, gains


if __name__ == "__main__":
    import tempfile
    from pathlib import Path

    seeds = [int(a) for a in sys.argv[1:]] or list(SEEDS)
    for seed in seeds:
        for n in (4, 1):
            c = run(n, seed, Path(tempfile.mkdtemp()))
            print(f"n={n} seed={seed}: gain {gain(c):+.3f}: " + " ".join(f"{x:+.2f}" for x in c),
                  flush=True)
