"""The eval gate on the real tiny model and the real trainer: a reward that pays for degenerate
output is caught (refused, rolled back, training paused) while the served adapter keeps its
held-back probe reward; honest learning passes the gate and the reward rises; the figures and
the verdict as pure functions; and a rollback restores the optimizer, baseline and schedule."""

from __future__ import annotations

import json
import math
import statistics
import time
import uuid

import rlproxy  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import pytest

from rlproxy.serving.engine import Engine
from rlproxy.serving.model import lora_weights
from rlproxy.settings import TrainerSettings
from rlproxy.training import degeneracy, gate as eval_gate
from rlproxy.training.checkpoints import latest_checkpoint
from rlproxy.training.loop import Trainer, training_copy
from rlproxy.training.schedule import lr_at
from conftest import make_settings, read_records, tiny_copy
from test_chunked_grad import first_token_s
from test_trainer import sample, sample_each  # the engine's own samples: ids, log-probs

PROMPTS = [[{"role": "user", "content": f"Tell me about {topic}."}]
           for topic in ("rivers", "bread", "trains", "owls", "glass", "tides")]
BYTES = range(0, 256)  # the byte-level alphabet's ids


# ---- rewards (module-level: the settings name them as test_guard:NAME) ----

def completion(turn) -> list[int]:
    return turn["choices"][turn.get("chosen_choice", 0)]["completion_ids"]


def repeat_reward(turn, next_state):
    """Pays for degenerate output: the share of the reply taken by its most common token."""
    ids = completion(turn)
    return 2 * max(ids.count(i) for i in ids) / len(ids) - 1 if ids else -1.0


def diversity(turn, next_state):
    """The held-back probe reward: the share of distinct tokens, in [-1, 1]."""
    ids = completion(turn)
    return 2 * len(set(ids)) / max(1, len(ids)) - 1 if ids else -1.0


def byte_reward(turn, next_state):
    """Honest, verifiable: the share of byte-alphabet tokens, in [-1, 1]."""
    ids = completion(turn)
    return 2 * sum(i in BYTES for i in ids) / max(1, len(ids)) - 1


# ---- driving the real trainer ----

def item(prompt, messages, ids, lps, reward_fn):
    turn = {"uid": uuid.uuid4().hex, "prompt_ids": prompt, "messages": messages, "tools": None,
            "choices": [{"completion_ids": ids, "logprobs": lps}]}
    r = reward_fn(turn, None)
    return {"turn": turn, "reward": r, "advantages": [r] * len(ids)}


def eval_file(tmp_path, n=4):
    path = tmp_path / "probes.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in PROMPTS[:n]))
    return path


def make(tmp_path, own, **flags):
    tmp_path.mkdir(parents=True, exist_ok=True)
    settings = make_settings(tmp_path, **{"train": True, "batch_size": 8, "save_interval": 1000,
                                          "eval_probes": 4, "eval_max_tokens": 16,
                                          "eval_prompts": str(eval_file(tmp_path)), **flags})
    engine = Engine(own.model, own.tokenizer.eos_token_ids)
    engine.start()
    trainer = Trainer(settings, training_copy(own), own.lora_config, engine, data_dir=tmp_path,
                      tokenizer=own.tokenizer)
    prompts = [own.tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in PROMPTS]
    return engine, trainer, prompts


def round_of(trainer, engine, prompts, reward_fn, seed):
    """One batch sampled by the served adapter, trained, then the gate if due (what the
    trainer thread's loop does after each batch)."""
    which = [k % len(prompts) for k in range(trainer.t.batch_size)]
    sampled = sample_each(engine, [(prompts[p], 1, seed * 100 + k) for k, p in enumerate(which)])
    batch = [item(prompts[p], PROMPTS[p], ids, lps, reward_fn)
             for p, [(ids, lps)] in zip(which, sampled)]
    for s in batch:
        trainer.gate.observe(s["turn"])
    trainer.train_journaled(batch)
    trainer._done(batch)
    if trainer.gate.due:
        return trainer.evaluate()
    return None


def fresh_reward(engine, prompts, reward_fn, seed, n=48):
    sampled = sample_each(engine, [(prompts[k % len(prompts)], 1, seed + k) for k in range(n)])
    return [reward_fn({"choices": [{"completion_ids": ids}]}, None) for [(ids, _)] in sampled]


# ---- the figures and the verdict, by hand ----

def test_repeat_and_empty_rates():
    # 3-grams of 1 2 3 1 2 3: 123 231 312 123, one seen before; 5 5 5 5 5: 555 x3, two repeats
    assert degeneracy.repeat_rate([[1, 2, 3, 1, 2, 3]]) == 0.25
    assert degeneracy.repeat_rate([[5] * 5]) == pytest.approx(2 / 3)
    assert degeneracy.repeat_rate([[1, 2, 3, 1, 2, 3], [5] * 5, [7, 8]]) == pytest.approx(3 / 7)
    assert degeneracy.repeat_rate([[1, 2], []]) == 0.0
    assert degeneracy.empty_rate(["", " \n", "a", "b "]) == 0.5 and degeneracy.empty_rate([]) == 0


def test_the_verdict_names_every_reason():
    t = TrainerSettings(eval_tolerance=0.1, max_kl=0.2)
    served = {"reward": 0.5, "repeat_rate": 0.1, "empty_rate": 0.0, "blank_share": 0.2,
              "distinct_share": 0.9}
    good = {"reward": 0.41, "repeat_rate": 0.2, "empty_rate": 0.0, "blank_share": 0.3,
            "distinct_share": 0.7, "kl_base": 0.19, "kl_served": 0.05}
    assert eval_gate.refusal(good, served, t) is None
    bad = {"reward": 0.39, "repeat_rate": 0.6, "empty_rate": 0.75, "blank_share": 0.9,
           "distinct_share": 0.1, "kl_base": 0.2, "kl_served": 0.3}
    reason = eval_gate.refusal(bad, served, t)
    for part in ("probe reward 0.390 is below the served adapter's 0.500",
                 "KL to the base 0.2000 >= max_kl 0.2", "KL to the served 0.3000",
                 "degenerate: repeat rate 0.60 > 0.5 (served: 0.10)", "empty rate 0.75",
                 "blank share 0.90 > 0.5", "distinct share 0.10 < 0.3 (served: 0.90)"):
        assert part in reason, (part, reason)
    # no reward measured, no KL bound, a served adapter as degenerate: nothing to refuse
    same = {**bad, "reward": None, "empty_rate": 0.0}
    assert eval_gate.refusal(same, {**served, "repeat_rate": 0.7, "blank_share": 0.95,
                                    "distinct_share": 0.05}, TrainerSettings()) is None


def test_an_eval_reward_call_returns_raises_or_gives_up_at_its_time_limit():
    """The gate calls each eval reward function on a thread of its own (scoring/rewards.py, as
    the scorer does): a raise or a hang past reward_timeout_s gives that sample no reward, and
    a hung function never holds the trainer."""
    import threading

    from rlproxy.scoring.rewards import Overran, call_with_timeout

    assert call_with_timeout(lambda x: x + 1, (1,), 5.0, "t") == 2
    with pytest.raises(ZeroDivisionError):
        call_with_timeout(lambda: 1 / 0, (), 5.0, "t")
    release = threading.Event()
    tic = time.perf_counter()
    with pytest.raises(Overran):
        call_with_timeout(release.wait, (30,), 0.2, "t")
    assert time.perf_counter() - tic < 5
    release.set()


def test_eval_prompts_are_read_and_a_bad_line_is_named(own, tmp_path):
    path = eval_file(tmp_path, 2)
    got = eval_gate.load_eval_prompts(path, own.tokenizer)
    assert [p["messages"] for p in got] == PROMPTS[:2]
    assert got[0]["prompt_ids"] == own.tokenizer.apply_chat_template(
        PROMPTS[0], add_generation_prompt=True)
    path.write_text(path.read_text() + "\n" + json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(ValueError, match=r"probes.jsonl, line 4: expected a JSON object"):
        eval_gate.load_eval_prompts(path, own.tokenizer)


def test_a_refused_candidate_restores_the_good_state_and_a_passed_one_is_served(own, tmp_path):
    """Refused: the adapter, optimizer (its update count: the schedule's position) and reward
    baseline of the served adapter come back, the rate halves, nothing is published, and a
    restart resumes there without training the refused steps' turns again. Passed: served."""
    engine, trainer, prompts = make(tmp_path, own, learning_rate=1e-3, eval_every=2,
                                    max_kl=1e-9, warmup_steps=4)
    try:
        good = {k: mx.array(v) for k, v in lora_weights(trainer.learner.model).items()}
        assert round_of(trainer, engine, prompts, byte_reward, 0) is None  # 1 step: not due
        assert trainer.baseline_n == 8 and engine.adapter_version == 0
        line = round_of(trainer, engine, prompts, byte_reward, 1)
        assert not line["passed"] and "max_kl" in line["refused"]
        assert line["probes"] == 4 and line["positions"] > 0 and line["units"] > 0
        for k, v in lora_weights(trainer.learner.model).items():
            assert mx.array_equal(v, good[k]).item(), k
        learner = trainer.learner
        assert int(learner.optimizer.state["step"].item()) == 0  # the schedule starts over
        assert (trainer.baseline, trainer.baseline_n) == (0.0, 0)
        assert learner.lr_scale == 0.5 and learner.learning_rate() == lr_at(0, trainer.t, 0.5)
        assert (trainer.step, trainer.version, engine.adapter_version) == (3, 2, 0)
        rollback = read_records(tmp_path, "training.jsonl")[-1]
        assert rollback["kind"] == "rollback" and rollback["gate"] and rollback["step"] == 3
        assert rollback["rejected_version"] == 2 and rollback["adapter_version"] == 0
        assert rollback["candidate"]["kl_base"] > 0 and "served" in rollback
        assert latest_checkpoint(tmp_path / "checkpoints").name == "step_000003"

        trainer.t.max_kl = None  # the same settings object: the gate reads it live
        while (line := round_of(trainer, engine, prompts, byte_reward, 2)) is None:
            pass
        assert line["passed"] and line["candidate_version"] == 4
        deadline = time.time() + 5
        while engine.adapter_version != 4 and time.time() < deadline:
            time.sleep(0.01)
        assert engine.adapter_version == 4 and trainer.gate.served_version == 4
        assert latest_checkpoint(tmp_path / "checkpoints").name == "step_000005"
    finally:
        trainer.stop()
        engine.stop()
    # a restart from the passed checkpoint serves v4; the refused steps' turns stay trained
    refused = {u for ln in read_records(tmp_path, "training.jsonl")
               if ln["kind"] == "step" and ln["step"] <= 2 for u in ln["uids"]}
    engine = Engine(own.model, own.tokenizer.eos_token_ids)
    engine.start()
    again = Trainer(make_settings(tmp_path, train=True, eval_every=2,
                                  eval_prompts=str(eval_file(tmp_path))),
                    training_copy(own), own.lora_config, engine, data_dir=tmp_path,
                    tokenizer=own.tokenizer)
    try:
        assert again.resume().name == "step_000005"
        assert again.learner.lr_scale == 0.5 and again.gate.served_version == 4
        assert refused and refused <= set(again.trained)
    finally:
        again.stop()
        engine.stop()


def test_a_gate_rollback_the_learner_could_not_take_is_retried_not_the_evaluation(
        own, tmp_path, monkeypatch):
    """A refused candidate whose rollback finds a learner elsewhere away: the verdict is
    applied again once it answers; the candidate is evaluated once (one `eval` line, one
    rollback in a row), not again at every retry."""
    from rlproxy.training import control
    from rlproxy.training.learner import LearnerUnavailable

    monkeypatch.setattr(control, "DISK_RETRY_S", 0.01)
    engine, trainer, prompts = make(tmp_path, own, learning_rate=1e-3, eval_every=2,
                                    max_kl=1e-9)
    real, calls = trainer.restore, []

    def restore(snapshot):
        calls.append(1)
        if len(calls) == 1:
            raise LearnerUnavailable("restore: no answer in 10 s")
        return real(snapshot)
    trainer.restore = restore
    try:
        for r in range(2):
            batch = [item(prompts[0], PROMPTS[0], ids, lps, byte_reward)
                     for ids, lps in sample(engine, prompts[0], 8, 1000 * r)]
            for s in batch:
                trainer.gate.observe(s["turn"])
            trainer.train_journaled(batch)
            trainer._done(batch)
        assert trainer.gate.due
        trainer._running = True  # what start() sets: evaluate_or_wait waits while it runs
        trainer.evaluate_or_wait()
    finally:
        trainer._running = False
        trainer.stop()
        engine.stop()
    lines = read_records(tmp_path, "training.jsonl")
    assert [ln["kind"] for ln in lines if ln["kind"] in ("eval", "rollback")] == [
        "eval", "rollback"]
    assert len(calls) == 2 and trainer.gate.in_a_row == 1 and trainer.error is None


# ---- the must-shows ----

DEGENERATE = dict(learning_rate=3e-3, eval_every=2, max_kl=0.1, eval_tolerance=0.1,
                  eval_reward_functions=["test_guard:diversity"], max_rollbacks=3)


@pytest.mark.slow
def test_a_degenerate_reward_is_refused_rolled_back_and_training_pauses(own, tmp_path):
    """Trained on `repeat_reward`, the adapter collapses onto one token (control arm, gate
    off: within 6 batches from this seed's start). With the gate (tight KL bound, held-back
    `diversity` on the probes) every such candidate is refused and rolled back, training pauses
    after 3 in a row, and the served adapter keeps its probe reward."""
    engine, trainer, prompts = make(tmp_path / "gated", own, **DEGENERATE)
    before = statistics.mean(fresh_reward(engine, prompts, diversity, 10**6))
    evals = []
    try:
        for r in range(10):
            line = round_of(trainer, engine, prompts, repeat_reward, r)
            evals += [line] if line else []
            if trainer.paused:
                break
        served_after = statistics.mean(fresh_reward(engine, prompts, diversity, 10**6))
        served = lora_weights(own.model)
        for k, v in lora_weights(trainer.learner.model).items():  # the model was rolled back
            assert mx.array_equal(v, served[k]).item(), k
    finally:
        trainer.stop()
        engine.stop()
    assert trainer.paused and "3 rollbacks in a row by the eval gate" in trainer.error
    lines = read_records(tmp_path / "gated", "training.jsonl")
    rollbacks = [ln for ln in lines if ln["kind"] == "rollback"]
    assert len(rollbacks) == 3 and all(ln["gate"] and "max_kl" in ln["reason"] for ln in rollbacks)
    assert [ln["lr_scale"] for ln in rollbacks] == [0.5, 0.25, 0.125]
    assert [ln["kind"] for ln in lines if ln["kind"] in ("eval", "rollback", "pause")][-1] == \
        "pause"
    start = evals[0]["served"]["reward"]
    for ln in evals:  # the served adapter's held-back reward never fell past the tolerance
        assert ln["served"]["reward"] >= start - 0.1, (start, ln)
    published = [ln["candidate_version"] for ln in evals if ln["passed"]]
    assert engine.adapter_version == (published[-1] if published else 0)
    assert served_after >= before - 0.1, (before, served_after)

    # the control arm: the same batches without the gate collapse the output (how soon
    # depends on the LoRA's random start: seeded here; measured every 2 batches)
    own2 = tiny_copy()  # the same start as the gated arm (conftest's `own`)
    engine, trainer, prompts = make(tmp_path / "ungated", own2, **{**DEGENERATE, "eval_every": 0})
    try:
        for r in range(20):
            sampled = sample_each(engine, [(prompts[k % 6], 1, r * 100 + k)
                                           for k in range(trainer.t.batch_size)])
            batch = [item(prompts[k % 6], PROMPTS[k % 6], ids, lps, repeat_reward)
                     for k, [(ids, lps)] in enumerate(sampled)]
            trainer.train_journaled(batch)
            if r % 2 and statistics.mean(fresh_reward(engine, prompts, diversity, 10**6, 24)) \
                    < before - 0.5:
                break
        collapsed = statistics.mean(fresh_reward(engine, prompts, diversity, 10**6))
        repeats = statistics.mean(fresh_reward(engine, prompts, repeat_reward, 10**6))
    finally:
        trainer.stop()
        engine.stop()
    print(f"\nheld-back diversity: before {before:+.3f}, gated {served_after:+.3f}, ungated "
          f"{collapsed:+.3f} after {r + 1} batches (repeat reward {repeats:+.3f})")
    assert collapsed < before - 0.5, (before, collapsed)


@pytest.mark.slow
def test_honest_learning_passes_a_lagging_gate_and_the_reward_rises(own, tmp_path):
    """The test_trainer learning run (one prompt, batches of 16, 30 PPO steps) with the gate
    on every 5 steps, the probes scored by the same verifiable reward: the gate publishes, and
    the reward on fresh samples rises. The turns are sampled by the served adapter, up to 5
    versions behind the candidate: coupled PPO's clip dropped most of their signal (+0.12 here
    with off_policy="coupled"); decoupled PPO, the default, keeps it. bench/lagging_gate.py,
    3 seeds: the gain with the gate every 5 steps is 0.92x that of every step decoupled, 0.09x
    coupled. Decoupled learning reaches this reward's repetitive optimum within 30 steps, so
    the candidates refused are refused only as degenerate (repeat rate > 0.5), never for a
    reward that fell."""
    engine, trainer, prompts = make(tmp_path, own, learning_rate=5e-4, batch_size=16,
                                    eval_every=5, eval_probes=8, eval_max_tokens=16,
                                    eval_tolerance=0.15,
                                    eval_reward_functions=["test_guard:byte_reward"])
    prompts = prompts[:1]
    try:
        before = fresh_reward(engine, prompts, byte_reward, 10**6, 64)
        evals = [line for r in range(30)
                 if (line := round_of(trainer, engine, prompts, byte_reward, r))]
        after = fresh_reward(engine, prompts, byte_reward, 2 * 10**6, 64)
    finally:
        trainer.stop()
        engine.stop()
    steps = [ln for ln in read_records(tmp_path, "training.jsonl") if ln["kind"] == "step"]
    assert steps and {ln["off_policy"] for ln in steps} == {"decoupled"}
    assert len(evals) == 6 and sum(ln["passed"] for ln in evals) >= 1, evals  # 2 here
    assert all(ln["passed"] or ln["refused"].startswith("degenerate:") for ln in evals), evals
    assert engine.adapter_version == max(ln["candidate_version"] for ln in evals if ln["passed"])
    mb, ma = statistics.mean(before), statistics.mean(after)
    se = math.sqrt(statistics.variance(before) / 64 + statistics.variance(after) / 64)
    print(f"\nfresh reward {mb:+.3f} -> {ma:+.3f} (t = {(ma - mb) / se:.1f}); "
          f"{sum(ln['passed'] for ln in evals)} of {len(evals)} evaluations published")
    assert ma - mb > 0.35 and (ma - mb) / se > 5, (mb, ma)  # coupled: +0.12


def test_an_evaluation_does_not_hold_a_request_arriving_during_it(own, tmp_path):
    """Serving first: the gate's sampling and KL passes are cut into units like a training
    step's, so a short request submitted during a long-prompt evaluation gets its first token
    long before the evaluation ends."""
    import threading

    from rlproxy.mlx_threads import mlx_thread

    words = ["the", "of", "and", "to", "in", "is", "that", "it", "was", "for"]
    long = [{"role": "user", "content": " ".join(words[i % 10] for i in range(6000))}]
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"messages": long}) + "\n")
    engine, trainer, prompts = make(tmp_path, own, eval_every=1, eval_probes=1,
                                    eval_max_tokens=8, eval_prompts=str(path))

    lines = []

    def evaluate():
        with mlx_thread():
            lines.append(trainer.evaluate())

    try:
        idle = min(first_token_s(engine) for _ in range(3))
        worker = threading.Thread(target=evaluate)
        worker.start()
        while trainer.pacer.units["units"] < 10:  # well inside it (4 prefills of ~47 units each)
            time.sleep(0.01)
        busy = first_token_s(engine)
        assert worker.is_alive()  # the evaluation was still running
        worker.join(300)
    finally:
        trainer.stop()
        engine.stop()
    (line,) = lines
    print(f"\nidle {idle:.3f}s, during the evaluation {busy:.3f}s, evaluation {line['eval_s']}s, "
          f"units {line['units']}, max unit {line['max_unit_s']:.3f}s, yielded "
          f"{line['yielded_s']:.3f}s")
    assert line["passed"] and line["positions"] > 0
    assert line["eval_s"] > 4 * busy  # not held for the evaluation
    assert busy < 2 * idle + 0.25 + 2 * line["max_unit_s"]  # at most about one unit's wait
    assert line["yielded_s"] > 0
