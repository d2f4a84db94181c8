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

from rlproxy.paths import complete_checkpoints
from rlproxy.serving.engine import Engine, Job, SamplingParams
from rlproxy.serving.model import load_serving_model, lora_weights
from rlproxy.settings import ModelSettings
from rlproxy.training.checkpoints import latest_checkpoint
from rlproxy.training.loop import Trainer, training_copy
from conftest import ServerThread, make_settings, read_records

PROMPT_MESSAGES = [{"role": "user", "content": "Say something."}]
TARGET = range(0, 256)  # the byte-level alphabet's ids: plenty of them, not favoured at start


def target_reward(turn, next_state):
    """A verifiable reward: 2 * (share of completion tokens in TARGET) - 1, in [-1, 1]."""
    ids = turn["choices"][turn.get("chosen_choice", 0)]["completion_ids"]
    return 2 * sum(i in TARGET for i in ids) / max(1, len(ids)) - 1


def sample(engine, prompt, n, seed0, max_tokens=12):
    """N completions of PROMPT sampled at temperature 1 with seeds SEED0, SEED0 + 1, ...: their
    token ids and log-probs."""
    return sample_each(engine, [(prompt, n, seed0)], max_tokens)[0]


def sample_each(engine, requests, max_tokens=12):
    """`sample` for each (prompt, n, seed0) of REQUESTS, all submitted before any is read, so
    they decode in one batch: a seeded request gets the same tokens whatever else runs."""
    queues = []
    for prompt, n, seed0 in requests:
        queues.append([])
        for i in range(n):
            q = queue.Queue()
            engine.submit(Job(prompt, SamplingParams(max_tokens=max_tokens, temperature=1.0,
                                                     seed=seed0 + i), q.put))
            queues[-1].append(q)
    return [[read_all(q) for q in qs] for qs in queues]


def read_all(q):
    ids, lps = [], []
    while True:
        step = q.get(timeout=60)
        if step.token is not None:
            ids.append(step.token.id)
            lps.append(step.token.logprob)
        if step.finish_reason:
            assert step.error is None
            return ids, lps


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
        before = {k: mx.array(v) for k, v in tree_flatten(trainer.learner.model.parameters())}
        for step in range(3):
            trainer.train_batch([scored(prompt, *s) for s in sample(engine, prompt, 8, step)])
        after = dict(tree_flatten(trainer.learner.model.parameters()))
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
        for k, v in lora_weights(trainer.learner.model).items():
            assert mx.array_equal(v, lora_weights(own.model)[k]).item()
        # checkpoint at step 3 (save_interval=3): mlx-lm opens it and gives the same logits
        ckpt = latest_checkpoint(tmp_path / "checkpoints")
        assert ckpt is not None and ckpt.name == "step_000003"
        model, _ = mlx_lm.load(own.source, adapter_path=str(ckpt))
        ids = mx.array(prompt + [5, 17, 300])[None]
        trainer.learner.model.eval()
        assert mx.allclose(model(ids), trainer.learner.model(ids), atol=1e-4).item()
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
        saved_opt = dict(tree_flatten(trainer.learner.optimizer.state))
        saved_lora = lora_weights(trainer.learner.model)
    finally:
        trainer.stop()
        engine.stop()
    fresh = load_serving_model(ModelSettings(model="tiny"))
    engine = Engine(fresh.model, fresh.tokenizer.eos_token_ids)
    engine.start()
    resumed = Trainer(settings, training_copy(fresh), fresh.lora_config, engine,
                      data_dir=tmp_path)
    try:
        assert resumed.resume().name == "step_000003"
        assert (resumed.step, resumed.version) == (3, 3)
        opt = dict(tree_flatten(resumed.learner.optimizer.state))
        assert set(opt) == set(saved_opt)
        for k, v in saved_opt.items():
            assert mx.allclose(v, opt[k]).item(), k
        for k, v in saved_lora.items():
            assert mx.array_equal(v, lora_weights(resumed.learner.model)[k]).item(), k
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
    own = load_serving_model(ModelSettings(model="tiny"))
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
    lines = read_records(tmp_path, "training.jsonl")
    # a batch whose advantages are all 0 takes no step: its `skipped` line keeps the version
    steps = [ln for ln in lines if ln["kind"] == "step"]
    assert [ln["adapter_version"] for ln in steps] == list(range(1, len(steps) + 1))
    assert all(ln["kind"] in ("step", "skipped") for ln in lines), lines


def test_qlora_trains_lora_over_a_quantized_frozen_base(tmp_path):
    from rlproxy.settings import load_settings

    settings = load_settings({"quantize_bits": 8, "model": "tiny"}, environ={})
    own = load_serving_model(settings.model)
    assert type(own.model.layers[0].self_attn.q_proj.linear).__name__ == "QuantizedLinear"
    _, engine, trainer, prompt = setup(own, tmp_path, quantize_bits=8)
    try:
        before = {k: mx.array(v) for k, v in tree_flatten(trainer.learner.model.parameters())}
        for step in range(3):
            trainer.train_batch([scored(prompt, *s) for s in sample(engine, prompt, 8, step)])
        after = dict(tree_flatten(trainer.learner.model.parameters()))
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


# ---- schedules, entropy and resume ----

def test_learning_rate_schedules_by_hand():
    from rlproxy.settings import TrainerSettings
    from rlproxy.training.schedule import lr_at

    t = TrainerSettings(learning_rate=1e-3, warmup_steps=2, lr_min=1e-4, lr_decay_steps=4,
                        lr_schedule="cosine")
    # warmup (s + 1) / W, then 1e-4 + 9e-4 * (1 + cos(pi * d / 4)) / 2, flat after d = 4
    want = [5e-4, 1e-3, 1e-3, 1e-4 + 9e-4 * (1 + math.cos(math.pi / 4)) / 2, 5.5e-4,
            1e-4 + 9e-4 * (1 + math.cos(3 * math.pi / 4)) / 2, 1e-4, 1e-4, 1e-4]
    assert [lr_at(s, t) for s in range(9)] == pytest.approx(want, rel=1e-12)
    t = t.model_copy(update={"lr_schedule": "linear"})
    assert [lr_at(s, t) for s in (2, 3, 4, 6, 50)] == pytest.approx(
        [1e-3, 7.75e-4, 5.5e-4, 1e-4, 1e-4], rel=1e-12)
    t = t.model_copy(update={"lr_schedule": "constant", "warmup_steps": 0})
    assert lr_at(0, t) == lr_at(99, t) == 1e-3 and lr_at(5, t, scale=0.25) == 2.5e-4


def random_item(vocab, seed, n_prompt=24, n_completion=10):
    import random

    rng = random.Random(seed)
    ids = [rng.randrange(3, vocab) for _ in range(n_completion)]
    turn = {"uid": f"u{seed}", "prompt_ids": [rng.randrange(3, vocab) for _ in range(n_prompt)],
            "choices": [{"completion_ids": ids,
                         "logprobs": [-7 + rng.random() for _ in ids]}]}
    r = rng.uniform(-1, 1)
    return {"turn": turn, "reward": r, "advantages": [r] * len(ids)}


def test_resume_gives_the_same_learning_rate_and_the_same_next_step(own, tmp_path):
    """Cosine with warmup and an entropy bonus: a trainer resumed from step 3's checkpoint
    takes step 4 exactly as the one that never stopped (rate, loss, entropy, weights)."""
    flags = {"learning_rate": 1e-3, "batch_size": 4, "train": True, "save_interval": 3,
             "lr_schedule": "cosine", "warmup_steps": 2, "lr_decay_steps": 5, "lr_min": 1e-4,
             "entropy_coef": 0.01}
    settings = make_settings(tmp_path, **flags)
    batches = [[random_item(own.vocab_size, 10 * b + i) for i in range(4)] for b in range(4)]
    first = Trainer(settings, training_copy(own), own.lora_config, data_dir=tmp_path)
    try:
        lines = [first.train_batch(b)[0] for b in batches]
        weights = lora_weights(first.learner.model)
    finally:
        first.writer.close()
        first.journal.close()
    assert [ln["learning_rate"] for ln in lines] == pytest.approx(
        [5e-4, 1e-3, 1e-3, 1e-4 + 9e-4 * (1 + math.cos(math.pi / 5)) / 2], rel=1e-6)
    assert all(ln["entropy"] > 0 for ln in lines)
    again = Trainer(settings, training_copy(own), own.lora_config, data_dir=tmp_path)
    try:
        assert again.resume().name == "step_000003"
        assert again.learner.learning_rate() == pytest.approx(lines[3]["learning_rate"],
                                                              rel=1e-7)
        line = again.train_batch(batches[3])[0]
        for k in ("learning_rate", "loss", "entropy", "grad_norm"):
            assert line[k] == pytest.approx(lines[3][k], rel=1e-5), k
        for k, v in lora_weights(again.learner.model).items():
            assert mx.allclose(v, weights[k], atol=1e-6).item(), k
    finally:
        again.writer.close()
        again.journal.close()


def test_the_entropy_bonus_raises_the_entropy(own, tmp_path):
    """Zero advantages: the policy loss pulls nowhere, so with entropy_coef > 0 the bonus alone
    moves the weights, and it raises the entropy of the completion positions; with 0 there is
    nothing to step on, and no step is taken (test_sound_updates.py)."""
    def steps(coef, where):
        settings = make_settings(where, learning_rate=2e-4, batch_size=2, train=True,
                                 entropy_coef=coef, save_interval=1000)
        trainer = Trainer(settings, training_copy(own), own.lora_config, data_dir=where)
        batch = [random_item(own.vocab_size, i) for i in range(2)]
        for s in batch:
            s["reward"], s["advantages"] = 0.0, [0.0] * len(s["advantages"])
        try:
            return [trainer.train_batch(batch) for _ in range(4)]
        finally:
            trainer.writer.close()
            trainer.journal.close()

    ent = [lines[0]["entropy"] for lines in steps(1.0, tmp_path / "bonus")]
    assert ent[0] < ent[1] < ent[2] < ent[3], ent
    assert steps(0.0, tmp_path / "none") == [[]] * 4


# ---- items: a choice, its key, its baseline ----

def test_an_item_trains_its_own_choice_under_its_key_and_a_baselined_one_keeps_its_advantages(
        own, tmp_path):
    settings = make_settings(tmp_path, learning_rate=1e-3, batch_size=2, train=True,
                             baseline="mean", save_interval=1000)
    trainer = Trainer(settings, training_copy(own), own.lora_config, data_dir=tmp_path)
    a, b = random_item(own.vocab_size, 1), random_item(own.vocab_size, 2)
    turn = a["turn"]
    turn["choices"].append(b["turn"]["choices"][0])  # choice 1 of the same request
    other = {"turn": turn, "choice": 1, "key": f"{turn['uid']}/1", "reward": 0.5,
             "advantages": [0.25] * 10, "baselined": True}
    try:
        trainer.progress.baseline, trainer.progress.baseline_n = 0.4, 3
        ex = trainer.runner.example(other)
        assert ex["ids"] == turn["prompt_ids"] + b["turn"]["choices"][0]["completion_ids"]
        assert ex["uids"] == [f"{turn['uid']}/1"]
        assert ex["adv"][-10:] == [0.25] * 10  # the group baseline stands: no running mean
        assert (trainer.baseline, trainer.baseline_n) == (0.4, 3)
        ex = trainer.runner.example(a)  # an old-style item: the chosen choice, keyed by its uid
        assert ex["uids"] == [turn["uid"]] and ex["ids"][-10:] == \
            turn["choices"][0]["completion_ids"]
        assert ex["adv"][-10:] == pytest.approx([a["reward"] - 0.4] * 10)
        assert trainer.baseline_n == 4
        trainer.train_batch([a, other])
        assert set(trainer.trained) >= {turn["uid"], f"{turn['uid']}/1"}
        trainer.submit(other)  # trained: not again
        assert trainer.books.inbox.qsize() == 0
    finally:
        trainer.writer.close()
        trainer.journal.close()
    step = read_records(tmp_path, "training.jsonl")[-1]
    assert sorted(step["uids"]) == sorted([turn["uid"], f"{turn['uid']}/1"])


def test_released_turns_rebuilds_every_released_choice(tmp_path):
    import json

    from rlproxy.training.items import released_turns

    turn = {"uid": "t1", "session_id": "s", "index": 0, "trainable": True, "chosen_choice": 1,
            "prompt_ids": [5, 6], "choices": [
                {"completion_ids": [7, 8], "logprobs": [-1.0, -2.0]},
                {"completion_ids": [9], "logprobs": [-0.5]},
                {"completion_ids": [10, 11, 12], "logprobs": [-1.0, -1.0, -1.0]}]}
    old = {"uid": "t0", "prompt_ids": [5], "choices": [{"completion_ids": [3],
                                                         "logprobs": [-1.0]}]}
    (tmp_path / "conversations.jsonl").write_text(json.dumps(old) + "\n" + json.dumps(turn)
                                                  + "\n")
    releases = [
        {"kind": "release", "uid": "t0", "reward": 0.5, "reason": "scored"},  # before choices
        {"kind": "release", "uid": "t1", "choice": 1, "key": "t1", "reward": 1.0,
         "baseline": 0.25, "reason": "scored"},
        {"kind": "release", "uid": "t1", "choice": 0, "key": "t1/0", "reward": -0.5,
         "baseline": 0.25, "scale": 0.5, "reason": "scored"},
        {"kind": "release", "uid": "t1", "choice": 2, "key": "t1/2", "reward": 0.0,
         "baseline": 0.25, "reason": "scored"},
        {"kind": "release", "uid": "t1", "choice": 2, "key": "t1/2", "reward": 1.0,
         "baseline": None, "reason": "feedback"},  # the latest release of a key wins
    ]
    (tmp_path / "prm_scores.jsonl").write_text("".join(json.dumps(r) + "\n" for r in releases))
    items = {s["key"]: s for s in released_turns(tmp_path, 1.0, 2.0, skip={"nothing"})}
    assert set(items) == {"t0", "t1", "t1/0", "t1/2"}
    assert (items["t0"]["choice"], items["t0"]["advantages"]) == (0, [1.0])
    assert not items["t0"]["baselined"]
    assert (items["t1"]["choice"], items["t1"]["advantages"]) == (1, [2 * 0.75])
    assert items["t1"]["baselined"] and items["t1"]["reward"] == 1.0
    assert items["t1/0"]["advantages"] == [2 * (-0.75 / 0.5)] * 2  # group-std: / its std
    assert items["t1/2"]["advantages"] == [2.0] * 3 and not items["t1/2"]["baselined"]
    assert {s["key"] for s in released_turns(tmp_path, 1.0, 2.0, skip={"t1/0"})} == \
        {"t0", "t1", "t1/2"}


# ---- bounded, thread-safe books ----

def test_trained_keys_are_bounded_once_running_and_the_queue_has_a_cap(own, tmp_path,
                                                                       monkeypatch):
    import rlproxy.training.books as books_module
    from rlproxy.lru import LRU

    keys = LRU(2)  # the trainer's key sets: an LRU used as a set
    for k in "abc":
        keys.add(k)
    assert list(keys) == ["b", "c"] and set(keys) == {"b", "c"} and "c" in keys
    keys.add("b")
    keys.add("d")  # the oldest, c, goes: b was added again
    assert list(keys) == ["b", "d"]

    monkeypatch.setattr(books_module, "TRAINED_KEEP", 3)
    monkeypatch.setattr(books_module, "MAX_QUEUED", 5)
    settings = make_settings(tmp_path, train=True, batch_size=4, save_interval=1000)
    trainer = Trainer(settings, training_copy(own), own.lora_config, data_dir=tmp_path)
    trainer.books.mark_trained(["k1", "k2", "k3", "k4", "k5"])  # as from a long training.jsonl
    for i in range(8):
        trainer.submit(random_item(own.vocab_size, 100 + i))
    assert len(trainer.books.queued) == 5 and trainer.books.inbox.qsize() == 5
    assert trainer.stats.dropped == 3
    trainer.start()  # trims: start-up has resubmitted what needed the whole history
    try:
        assert len(trainer.trained) <= 3
    finally:
        trainer.stop()


def test_submit_from_many_threads_while_the_trainer_trains(own, tmp_path):
    """Issue 13 item 12: `queued` and `trained` change from the scorer's threads and the
    trainer's; under the lock every item is trained exactly once and queued empties."""
    import threading

    settings = make_settings(tmp_path, train=True, batch_size=4, learning_rate=1e-4,
                             save_interval=1000)
    trainer = Trainer(settings, training_copy(own), own.lora_config, data_dir=tmp_path)
    items = [random_item(own.vocab_size, 1000 + i, n_prompt=8, n_completion=4)
             for i in range(32)]
    trainer.start()
    try:
        threads = [threading.Thread(target=lambda part=items[k::4]: [
            trainer.submit(s) for s in part * 3]) for k in range(4)]  # each item 3 times
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        deadline = time.time() + 60
        while (trainer.books.queued or trainer.books.inbox.qsize()) and time.time() < deadline:
            time.sleep(0.05)
    finally:
        trainer.stop()
    assert not trainer.books.queued and trainer.error is None
    trained = [u for ln in read_records(tmp_path, "training.jsonl") if ln["kind"] == "step"
               for u in ln["uids"]]
    assert sorted(trained) == sorted(s["turn"]["uid"] for s in items)


def test_a_trainer_stopped_while_paused_trains_nothing(own, tmp_path):
    """Pause holds a batch; stopping then must not train it on the way out (its items stay
    untrained, so a restart trains them)."""
    settings = make_settings(tmp_path, train=True, batch_size=2, learning_rate=1e-3)
    trainer = Trainer(settings, training_copy(own), own.lora_config, data_dir=tmp_path)
    before = lora_weights(trainer.learner.model)
    trainer.pause()
    trainer.start()
    for i in range(2):
        trainer.submit(random_item(own.vocab_size, 500 + i))
    deadline = time.time() + 30
    while not trainer.books.inbox.empty() and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)  # the full batch is collected and held between batches by the pause
    trainer.stop()
    after = lora_weights(trainer.learner.model)
    assert trainer.step == 0 and not trainer.trained
    assert all(mx.array_equal(before[k], after[k]).item() for k in before)
    assert [x["kind"] for x in read_records(tmp_path, "training.jsonl")] == ["pause"]


def test_the_served_lora_forward_matches_the_training_copy_after_a_step(own, tmp_path):
    """The serving model adds its LoRA term in one addmm (serving/model.py ServingLoRALinear);
    with a trained, non-zero adapter its log-probs still equal the training copy's (mlx-lm's
    LoRALinear forward) on the same tokens, to float rounding."""
    from mlx_lm.tuner.lora import LoRALinear

    from rlproxy.serving.model import ServingLoRALinear

    served = [m for _, m in own.model.named_modules() if isinstance(m, LoRALinear)]
    assert served and all(type(m) is ServingLoRALinear for m in served)
    settings, engine, trainer, prompt = setup(own, tmp_path)
    tokens = mx.array([prompt + list(range(300, 340))])
    before = own.model(tokens)
    try:
        trainer.train_batch([scored(prompt, *s) for s in sample(engine, prompt, 8, 11)])
        deadline = time.time() + 5
        while engine.adapter_version < 1 and time.time() < deadline:
            time.sleep(0.05)
        assert engine.adapter_version == 1
        copy = trainer.learner.model
        assert all(type(m) is LoRALinear for _, m in copy.named_modules()
                   if isinstance(m, LoRALinear))
        assert any(mx.abs(m.lora_b).max().item() > 0 for m in served)  # the step reached it
        copy.eval()
        want, got = copy(tokens), own.model(tokens)
        assert got.dtype == want.dtype
        assert mx.abs(got - before).max().item() > 1e-2  # the adapter moved the logits ...
        assert mx.abs(got - want).max().item() < 1e-4  # ... and both forwards agree on it
    finally:
        trainer.stop()
        engine.stop()
