"""The trainer on the real tiny model: weights that change (and don't), checkpoints that mlx-lm
opens, resume, learning a verifiable reward, and hot-swaps under live streaming traffic."""

from __future__ import annotations

import asyncio
import math
import queue
import statistics
import time
import uuid

import mlx.core as mx
import mlx_lm
import pytest
import requests
from mlx.utils import tree_flatten

from rlproxy.checkpoints import complete_checkpoints, latest_checkpoint
from rlproxy.engine import Engine, Job, SamplingParams
from rlproxy.model import load_serving_model, lora_weights
from rlproxy.settings import ModelSettings
from rlproxy.trainer import Trainer, training_copy
from conftest import ServerThread, make_settings, read_records

PROMPT_MESSAGES = [{"role": "user", "content": "Say something."}]
TARGET = range(0, 256)  # the byte-level alphabet's ids: plenty of them, not favoured at start


def target_reward(turn, next_state):
    """A verifiable reward: 2 * (share of completion tokens in TARGET) - 1, in [-1, 1]."""
    ids = turn["choices"][turn.get("chosen_choice", 0)]["completion_ids"]
    return 2 * sum(i in TARGET for i in ids) / max(1, len(ids)) - 1


@pytest.fixture
def own():
    return load_serving_model(ModelSettings())  # weights change in these tests: a private copy


def sample(engine, prompt, n, seed0, max_tokens=12):
    queues = []
    for i in range(n):
        q = queue.Queue()
        engine.submit(Job(prompt, SamplingParams(max_tokens=max_tokens, temperature=1.0,
                                                 seed=seed0 + i), q.put))
        queues.append(q)
    out = []
    for q in queues:
        ids, lps = [], []
        while True:
            step = q.get(timeout=60)
            if step.token is not None:
                ids.append(step.token.id)
                lps.append(step.token.logprob)
            if step.finish_reason:
                assert step.error is None
                break
        out.append((ids, lps))
    return out


def scored(prompt, ids, lps):
    turn = {"uid": uuid.uuid4().hex, "prompt_ids": prompt,
            "choices": [{"completion_ids": ids, "logprobs": lps}]}
    r = target_reward(turn, None)
    return {"turn": turn, "reward": r, "advantages": [r] * len(ids)}


def setup(own, tmp_path, **flags):
    settings = make_settings(tmp_path, **{"learning_rate": 1e-3, "batch_size": 8,
                                          "train": True, "save_interval": 3, **flags})
    engine = Engine(own.model, own.tokenizer.eos_token_ids)
    engine.start()
    trainer = Trainer(settings, training_copy(own), own.lora_config, engine, data_dir=tmp_path)
    prompt = own.tokenizer.apply_chat_template(PROMPT_MESSAGES, add_generation_prompt=True)
    return settings, engine, trainer, prompt


def test_training_changes_lora_only_and_checkpoints_open_in_mlx_lm(own, tmp_path):
    settings, engine, trainer, prompt = setup(own, tmp_path)
    try:
        before = {k: mx.array(v) for k, v in tree_flatten(trainer.model.parameters())}
        for step in range(3):
            trainer.train_batch([scored(prompt, *s) for s in sample(engine, prompt, 8, step)])
        after = dict(tree_flatten(trainer.model.parameters()))
        lora = {k for k in before if "lora_" in k}
        assert lora and len(lora) < len(before)
        for k, v in before.items():
            same = mx.array_equal(v, after[k]).item()
            if k in lora:
                assert not same, f"{k} did not change"
            else:
                assert same, f"base parameter {k} changed"
        # the engine got every version, and uses the trainer's weights
        deadline = time.time() + 5
        while engine.adapter_version < 3 and time.time() < deadline:
            time.sleep(0.05)
        assert engine.adapter_version == 3 == trainer.version
        for k, v in lora_weights(trainer.model).items():
            assert mx.array_equal(v, lora_weights(own.model)[k]).item()
        # checkpoint at step 3 (save_interval=3): mlx-lm opens it and gives the same logits
        ckpt = latest_checkpoint(tmp_path / "checkpoints")
        assert ckpt is not None and ckpt.name == "step_000003"
        model, _ = mlx_lm.load(own.source, adapter_path=str(ckpt))
        ids = mx.array(prompt + [5, 17, 300])[None]
        trainer.model.eval()
        assert mx.allclose(model(ids), trainer.model(ids), atol=1e-4).item()
        lines = read_records(tmp_path, "training.jsonl")
        assert [ln["step"] for ln in lines] == [1, 2, 3]
        assert [ln["adapter_version"] for ln in lines] == [1, 2, 3]
        assert all(ln["tokens"] > 0 and ln["turns"] == 8 for ln in lines)
    finally:
        trainer.stop()
        engine.stop()


def test_resume_continues_at_the_same_step_with_the_same_optimizer_state(own, tmp_path):
    settings, engine, trainer, prompt = setup(own, tmp_path)
    try:
        for step in range(3):
            trainer.train_batch([scored(prompt, *s) for s in sample(engine, prompt, 8, step)])
        saved_opt = dict(tree_flatten(trainer.optimizer.state))
        saved_lora = lora_weights(trainer.model)
    finally:
        trainer.stop()
        engine.stop()
    fresh = load_serving_model(ModelSettings())
    engine = Engine(fresh.model, fresh.tokenizer.eos_token_ids)
    engine.start()
    resumed = Trainer(settings, training_copy(fresh), fresh.lora_config, engine,
                      data_dir=tmp_path)
    try:
        assert resumed.resume().name == "step_000003"
        assert (resumed.step, resumed.version) == (3, 3)
        opt = dict(tree_flatten(resumed.optimizer.state))
        assert set(opt) == set(saved_opt)
        for k, v in saved_opt.items():
            assert mx.allclose(v, opt[k]).item(), k
        for k, v in saved_lora.items():
            assert mx.array_equal(v, lora_weights(resumed.model)[k]).item(), k
        deadline = time.time() + 5
        while engine.adapter_version != 3 and time.time() < deadline:
            time.sleep(0.05)
        assert engine.adapter_version == 3  # the serving engine got the resumed adapter
        resumed.train_batch([scored(prompt, *s) for s in sample(engine, prompt, 8, 99)])
        assert resumed.step == 4
        assert read_records(tmp_path, "training.jsonl")[-1]["step"] == 4
        assert len(complete_checkpoints(tmp_path / "checkpoints")) == 1
    finally:
        resumed.stop()
        engine.stop()


def test_learning_a_verifiable_reward_beats_chance(own, tmp_path):
    """Mean reward of 64 fresh samples before vs after 30 PPO steps (batches of 16).
    Statistic: Welch's t on the two samples; we require t > 5 (one-sided p < 1e-5)."""
    settings, engine, trainer, prompt = setup(own, tmp_path, save_interval=1000,
                                              batch_size=16, learning_rate=5e-4)
    try:
        def fresh_rewards(seed):
            return [target_reward({"choices": [{"completion_ids": ids}]}, None)
                    for ids, _ in sample(engine, prompt, 64, seed)]

        before = fresh_rewards(10**6)
        for step in range(30):
            trainer.train_batch([scored(prompt, *s)
                                 for s in sample(engine, prompt, 16, 100 * step)])
        after = fresh_rewards(2 * 10**6)
    finally:
        trainer.stop()
        engine.stop()
    mb, ma = statistics.mean(before), statistics.mean(after)
    se = math.sqrt(statistics.variance(before) / 64 + statistics.variance(after) / 64)
    t = (ma - mb) / max(se, 1e-9)
    assert ma - mb > 0.3 and t > 5, (mb, ma, t)


def test_streaming_clients_survive_hot_swaps(tmp_path):
    own = load_serving_model(ModelSettings())
    settings = make_settings(tmp_path, train=True, judge=False, at_least_one=False,
                             batch_size=1, learning_rate=1e-3, save_interval=1000,
                             reward_functions=["test_trainer:target_reward"])
    with ServerThread(settings, own) as s:
        client = s.async_client()

        async def agent(i):
            done = []
            for k in range(4):
                stream = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": f"agent {i} turn {k}"}],
                    max_tokens=40, stream=True, seed=100 * i + k,
                    extra_headers={"X-Session-Id": f"a{i}-{k}", "X-Session-Done": "1"})
                finish = None
                async for chunk in stream:
                    if chunk.choices:
                        finish = chunk.choices[0].finish_reason or finish
                done.append(finish)
            return done

        async def run():
            return await asyncio.gather(*[agent(i) for i in range(4)])

        results = asyncio.run(run())
        assert all(f in ("length", "stop") for r in results for f in r)  # none failed
        deadline = time.time() + 30
        while time.time() < deadline:
            health = requests.get(s.url + "/healthz").json()
            if health["adapter_version"] >= 3 and health["trainer"]["queued"] == 0:
                break
            time.sleep(0.2)
        assert health["adapter_version"] >= 3, health
        assert health["engine"]["swaps"] >= 3
        # a request after the swaps is served by the new version
        r = s.client().chat.completions.create(
            model="m", messages=[{"role": "user", "content": "after"}], max_tokens=4,
            extra_headers={"X-Session-Id": "late", "X-Session-Done": "1"})
        assert r.choices[0].finish_reason in ("length", "stop")
    records = sorted(read_records(tmp_path), key=lambda r: r["timings"]["received"])
    versions = [max(r["choices"][0]["adapter_versions"]) for r in records]
    assert versions[0] == 0 and versions[-1] >= 3  # per-token versions recorded, increasing
    steps = read_records(tmp_path, "training.jsonl")
    assert [ln["adapter_version"] for ln in steps] == list(range(1, len(steps) + 1))


def test_qlora_trains_lora_over_a_quantized_frozen_base(tmp_path):
    from rlproxy.settings import load_settings

    settings = load_settings({"quantize_bits": 8}, environ={})
    own = load_serving_model(settings.model)
    assert type(own.model.layers[0].self_attn.q_proj.linear).__name__ == "QuantizedLinear"
    _, engine, trainer, prompt = setup(own, tmp_path, quantize_bits=8)
    try:
        before = {k: mx.array(v) for k, v in tree_flatten(trainer.model.parameters())}
        for step in range(3):
            trainer.train_batch([scored(prompt, *s) for s in sample(engine, prompt, 8, step)])
        after = dict(tree_flatten(trainer.model.parameters()))
        changed = {k for k in before if not mx.array_equal(before[k], after[k]).item()}
        lora = {k for k in before if "lora_" in k}
        assert changed == lora  # quantized weights, scales and biases untouched
        assert any(k.endswith(".scales") for k in before)
        deadline = time.time() + 5
        while engine.adapter_version < 3 and time.time() < deadline:
            time.sleep(0.05)
        assert engine.adapter_version == 3
        assert all(len(ids) for ids, _ in sample(engine, prompt, 2, 7))  # serves after swaps
    finally:
        trainer.stop()
        engine.stop()
