"""Sound updates, on the real tiny model and on SmolLM2-135M-Instruct: a batch with no signal
(every advantage zero) takes no optimizer step and publishes nothing; group-std advantages of a
near-identical group stay small (the std floor); the eval gate refuses a candidate whose probe
replies collapsed to whitespace or to a few repeated tokens."""

from __future__ import annotations

import json
import statistics
import uuid

import rlproxy  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import pytest

from rlproxy.scoring import judging as scoring
from rlproxy.serving.engine import Engine
from rlproxy.serving.logprobs import token_logprobs
from rlproxy.serving.model import load_serving_model, lora_weights
from rlproxy.settings import ModelSettings, TrainerSettings
from rlproxy.training import degeneracy
from rlproxy.training.examples import no_signal
from rlproxy.training.loop import Trainer, training_copy
from conftest import make_settings, read_records
from test_trainer import sample, scored, setup


# ---- building items the way the scorer does: release lines, then released items ----

def group_items(prompt, completions, rewards, mode="group", std_floor=scoring.STD_FLOOR,
                teacher=None, w_opd=1.0):
    """The scorer -> trainer items of one request with len(COMPLETIONS) choices ((ids,
    log-probs) each) and REWARDS, through scoring.release_lines and released_item (TEACHER:
    teacher log-probs for every choice, as OPD gives)."""
    turn = {"uid": uuid.uuid4().hex, "prompt_ids": prompt, "chosen_choice": 0,
            "choices": [{"completion_ids": ids, "logprobs": lps} for ids, lps in completions]}
    tlp = [teacher(ids, lps) if teacher else None for ids, lps in completions]
    line = {"kind": "score", "uid": turn["uid"], "session_id": "s", "index": 0,
            "chosen_choice": 0, "reward": rewards[0], "teacher_logprobs": tlp[0],
            "other_choices": [{"choice": i, "reward": rewards[i], "teacher_logprobs": tlp[i]}
                              for i in range(1, len(completions))]}
    releases = scoring.release_lines(line, len(completions), rewards[0], "scored", mode,
                                     with_others=True, std_floor=std_floor)
    return [scoring.released_item(turn, line, r, w_opd=w_opd, w_rl=1.0) for r in releases]


def weights(trainer) -> dict:
    return {k: mx.array(v) for k, v in lora_weights(trainer.learner.model).items()}


def unchanged(before: dict, trainer) -> bool:
    return all(mx.array_equal(v, lora_weights(trainer.learner.model)[k]).item()
               for k, v in before.items())


# ---- no signal, no step ----

def example(adv, mask, uids=("u",)):
    return {"adv": adv, "mask": mask, "uids": list(uids)}


def test_no_signal_means_every_trained_advantage_is_zero():
    ppo = TrainerSettings()
    zero = [example([0.0, 0.0, 0.0], [0.0, 1.0, 1.0]), example([0.0, -0.0], [1.0, 1.0], "vw")]
    reason = no_signal(zero, ppo)
    assert "every advantage of its 3 turns is 0" in reason and "no optimizer step" in reason
    assert no_signal(zero, TrainerSettings(loss_fn="dro")) == reason  # its penalty: no reason
    assert no_signal([example([0.0, 1e-9], [1.0, 1.0])], ppo) is not None  # rounding
    # one OPD token (teacher - behaviour) is signal; a prompt position never counts
    assert no_signal([zero[0], example([0.0, 0.02], [1.0, 1.0])], ppo) is None
    assert no_signal([example([5.0, 0.0], [0.0, 1.0])], ppo) is not None
    # terms of their own: SFT ignores advantages; a KL penalty or entropy bonus pulls alone
    for t in (TrainerSettings(loss_fn="cross_entropy"), TrainerSettings(kl_coef=0.1),
              TrainerSettings(entropy_coef=0.01)):
        assert no_signal(zero, t) is None, t


def test_a_batch_of_equal_rewards_takes_no_step_and_publishes_nothing(own, tmp_path):
    """After a normal step AdamW holds momentum: a zero-gradient update would still move the
    adapter (the defect seen on the real model). The equal-reward batch leaves the adapter,
    the optimizer's update count and the version alone, writes one `skipped` line with its
    uids and reason, and the next batch steps as usual. A restart counts its turns as handled."""
    settings, engine, trainer, prompt = setup(own, tmp_path)
    try:
        trainer.train_journaled([scored(prompt, *s) for s in sample(engine, prompt, 8, 0)])
        assert (trainer.step, trainer.version) == (1, 1)
        before, updates = weights(trainer), int(trainer.learner.optimizer.state["step"].item())
        batch = (group_items(prompt, sample(engine, prompt, 4, 10), [0.5] * 4)
                 + group_items(prompt, sample(engine, prompt, 4, 20), [-1.0] * 4))
        assert all(a == 0.0 for s in batch for a in s["advantages"])
        for s in batch:
            trainer.submit(s)
        assert trainer.train_journaled(batch) == []
        trainer._done(batch)
        assert unchanged(before, trainer)
        assert int(trainer.learner.optimizer.state["step"].item()) == updates
        assert (trainer.step, trainer.version) == (1, 1)
        assert trainer.stats.skipped_steps == 1 and trainer.stats.skipped == 8
        keys = [s["key"] for s in batch]
        assert not trainer.books.queued & set(keys) and set(keys) <= set(trainer.trained)
        skipped = read_records(tmp_path, "training.jsonl")[-1]
        assert skipped["kind"] == "skipped" and sorted(skipped["uids"]) == sorted(keys)
        assert "every advantage of its 8 turns is 0" in skipped["reason"]
        assert (skipped["step"], skipped["adapter_version"], skipped["turns"]) == (1, 1, 8)
        journal = read_records(tmp_path, "train_journal.jsonl")
        assert journal[-1]["kind"] == "step_end" and journal[-1]["ok"]  # not charged

        trainer.train_journaled([scored(prompt, *s) for s in sample(engine, prompt, 8, 30)])
        assert (trainer.step, trainer.version) == (2, 2) and not unchanged(before, trainer)
    finally:
        trainer.stop()
        engine.stop()
    again = Trainer(settings, training_copy(own), own.lora_config, None, data_dir=tmp_path)
    assert set(keys) <= set(again.trained)
    again.stop()


def test_equal_rewards_with_a_teacher_still_train_on_the_opd_term(own, tmp_path):
    settings, engine, trainer, prompt = setup(own, tmp_path, batch_size=4)
    try:
        batch = group_items(prompt, sample(engine, prompt, 4, 0), [1.0] * 4,
                            teacher=lambda ids, lps: [lp + 0.5 for lp in lps])
        assert all(a == pytest.approx(0.5) for s in batch for a in s["advantages"])
        lines = trainer.train_journaled(batch)
        assert len(lines) == 1 and lines[0]["grad_norm"] > 0 and trainer.version == 1
    finally:
        trainer.stop()
        engine.stop()


# ---- the std floor ----

NEAR = [0.5, 0.508, 0.5, 0.504]  # a spread of 0.008, as measured on the real model


def test_the_std_floor_bounds_a_near_identical_group():
    std = statistics.stdev(NEAR)
    floored = scoring.group_advantages(NEAR, "group-std")
    assert max(abs(a) for a in floored) <= (max(NEAR) - min(NEAR)) / scoring.STD_FLOOR
    assert floored == pytest.approx([(r - statistics.fmean(NEAR)) / 0.1 for r in NEAR])
    blown = scoring.group_advantages(NEAR, "group-std", std_floor=1e-4)  # std + 1e-4, as TRL
    assert max(abs(a) for a in blown) > 1.0 and std < 0.01
    # a real spread is divided by its own std; "group" (Dr. GRPO) never divides
    wide = [1.0, -1.0, 0.5, 0.0]
    assert scoring.group_baseline(wide, "group-std")[1] == pytest.approx(statistics.stdev(wide))
    assert scoring.group_advantages(NEAR, "group") == pytest.approx(
        [r - statistics.fmean(NEAR) for r in NEAR])


def test_the_floor_keeps_the_trainers_gradient_proportionally_small(own, tmp_path):
    """The same near-identical group, released with the floor and without it (std + 1e-4),
    trained from the same adapter: the gradient shrinks by std / floor, as the advantages do."""
    settings, engine, trainer, prompt = setup(own, tmp_path, batch_size=4)
    try:
        completions = sample(engine, prompt, 4, 0)
        norms = []
        for floor in (scoring.STD_FLOOR, 1e-4):
            fresh = Trainer(settings, training_copy(own), own.lora_config, None,
                            data_dir=tmp_path / str(floor))
            items = group_items(prompt, completions, NEAR, "group-std", std_floor=floor)
            norms.append(fresh.train_batch(items)[0]["grad_norm"])
            fresh.stop()
    finally:
        trainer.stop()
        engine.stop()
    ratio = norms[0] / norms[1]
    assert ratio == pytest.approx(statistics.stdev(NEAR) / scoring.STD_FLOOR, rel=0.05), norms


# ---- degeneracy, by hand ----

def test_degeneracy_figures_of_hand_made_replies():
    texts = ["The river runs to the sea.", "Owls hunt at night, mostly."]
    replies = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13]]
    normal = degeneracy.figures(texts, replies)
    assert normal == {"repeat_rate": 0.0, "empty_rate": 0.0,
                      "blank_share": round(9 / 53, 4), "distinct_share": 1.0}
    # whitespace with a word let through: neither rate is past its limit, the blank share is
    blank = degeneracy.figures(["\n\n \n\n  \n", "\n\n\n word \n\n"],
                               [[5, 6, 5, 6, 5], [5] * 4])
    assert blank == {"repeat_rate": 0.4, "empty_rate": 0.5, "blank_share": round(15 / 19, 4),
                     "distinct_share": round(3 / 9, 4)}
    assert degeneracy.degenerate(blank, normal) == [
        "degenerate: blank share 0.79 > 0.5 (served: 0.17)"]
    few = degeneracy.figures(["ab ba ab"] * 2, [[7, 8, 8, 7, 7, 7, 8, 7, 8, 8]] * 2)
    assert few["repeat_rate"] < 0.5 and few["distinct_share"] == 0.2  # 2 tokens, any order
    assert degeneracy.degenerate(few, normal) == [
        "degenerate: distinct share 0.20 < 0.3 (served: 1.00)"]
    empty = degeneracy.figures(["", ""], [[], []])  # an end token first, every time
    assert empty["empty_rate"] == 1.0 and degeneracy.degenerate(empty, normal) == [
        "degenerate: empty rate 1.00 > 0.5 (served: 0.00)"]
    assert degeneracy.degenerate(normal, normal) == []
    assert degeneracy.degenerate(few, few) == []  # the served adapter writes so already


# ---- the gate refuses a collapsed candidate ----

PROBES = [[{"role": "user", "content": f"Tell me about {topic}."}] for topic in ("rivers", "owls")]


def collapse_gated(loaded, tmp_path, target: str, steps: int, **flags):
    """Train LOADED's adapter with cross_entropy towards TARGET for STEPS batches under the
    eval gate (eval_every = STEPS, no reward functions, no KL bound: degeneracy is the only
    check), then run the gate: its `eval` line. Returns (engine, trainer, line)."""
    probes = tmp_path / "probes.jsonl"
    probes.write_text("".join(json.dumps({"messages": m}) + "\n" for m in PROBES))
    settings = make_settings(tmp_path, **{
        "train": True, "batch_size": 1, "loss_fn": "cross_entropy", "eval_every": steps,
        "eval_prompts": str(probes), "eval_probes": 2, "save_interval": 1000, **flags})
    engine = Engine(loaded.model, loaded.tokenizer.eos_token_ids)
    engine.start()
    # the training copy's LoRA starts from MLX's global random state, which earlier tests in a
    # worker move: seeded, the collapse does not depend on the order tests run in (at lr 1e-2
    # one draw in six collapsed only partly: blank share 0.39)
    mx.random.seed(0)
    trainer = Trainer(settings, training_copy(loaded), loaded.lora_config, engine,
                      data_dir=tmp_path, tokenizer=loaded.tokenizer)
    tok = loaded.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hi."}],
                                     add_generation_prompt=True)
    ids = tok.encode(target, add_special_tokens=False)
    for _ in range(steps):
        turn = {"uid": uuid.uuid4().hex, "prompt_ids": prompt,
                "choices": [{"completion_ids": ids, "logprobs": [-1.0] * len(ids)}]}
        trainer.train_journaled([{"turn": turn, "reward": None, "advantages": [0.0] * len(ids)}])
    assert trainer.gate.due
    return engine, trainer, trainer.evaluate()


def assert_rolled_back(engine, trainer, line, tmp_path, served: dict):
    assert not line["passed"] and "degenerate" in line["refused"], line
    rollback = read_records(tmp_path, "training.jsonl")[-1]
    assert rollback["kind"] == "rollback" and rollback["gate"]
    assert rollback["reason"] == line["refused"] and rollback["adapter_version"] == 0
    assert unchanged(served, trainer) and engine.adapter_version == 0


def test_the_gate_rolls_back_a_candidate_collapsed_onto_newlines(own, tmp_path):
    served = {k: mx.array(v) for k, v in lora_weights(own.model).items()}
    engine, trainer, line = collapse_gated(own, tmp_path, "\n" * 16, 4, learning_rate=1e-2,
                                           eval_max_tokens=16)
    try:
        assert_rolled_back(engine, trainer, line, tmp_path, served)
        assert line["candidate"]["repeat_rate"] > 0.5 or line["candidate"]["empty_rate"] > 0.5
    finally:
        trainer.stop()
        engine.stop()


# ---- on SmolLM2-135M-Instruct ----

def behaviour_logprobs(model, prompt: list[int], ids: list[int]) -> list[float]:
    """The model's own log-probs of IDS after PROMPT: the turn is on-policy."""
    seq = mx.array(prompt + ids)[None]
    return token_logprobs(model, seq[:, :-1], seq[:, 1:])[0, len(prompt) - 1:].tolist()


@pytest.mark.real_model
def test_real_model_equal_rewards_leave_the_adapter_and_its_version(real, tmp_path):
    settings = make_settings(tmp_path, model="smollm2-135m-instruct", train=True,
                             learning_rate=2e-4, batch_size=2)
    trainer = Trainer(settings, training_copy(real), real.lora_config, None, data_dir=tmp_path)
    tok = real.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hi."}],
                                     add_generation_prompt=True)
    replies = [tok.encode(t, add_special_tokens=False) for t in ("Hello there!", "Hi.")]
    completions = [(ids, behaviour_logprobs(real.model, prompt, ids)) for ids in replies]
    try:
        trainer.train_journaled(group_items(prompt, completions, [1.0, -1.0]))
        assert trainer.version == 1  # AdamW now has momentum
        before, updates = weights(trainer), int(trainer.learner.optimizer.state["step"].item())
        assert trainer.train_journaled(group_items(prompt, completions, [0.3, 0.3])) == []
        assert unchanged(before, trainer) and trainer.version == 1
        assert int(trainer.learner.optimizer.state["step"].item()) == updates
        assert read_records(tmp_path, "training.jsonl")[-1]["kind"] == "skipped"
    finally:
        trainer.stop()


@pytest.mark.real_model
def test_real_model_the_gate_rolls_back_a_collapse_to_whitespace(tmp_path):
    """Two cross_entropy steps towards newlines at 1e-3 collapse SmolLM2's replies to other
    prompts too (measured: an end token first after one, newlines only after two); the gate
    sees it on a probe it never trained on and rolls back."""
    loaded = load_serving_model(ModelSettings(model="smollm2-135m-instruct"))  # it publishes
    served = {k: mx.array(v) for k, v in lora_weights(loaded.model).items()}
    engine, trainer, line = collapse_gated(loaded, tmp_path, "\n\n" * 8, 2, learning_rate=1e-3,
                                           eval_probes=1, eval_max_tokens=6,  # CPU time
                                           model="smollm2-135m-instruct")
    try:
        assert_rolled_back(engine, trainer, line, tmp_path, served)
        assert line["served"]["blank_share"] < 0.5 and line["served"]["empty_rate"] == 0
    finally:
        trainer.stop()
        engine.stop()
