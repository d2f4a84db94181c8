"""No poison turn: a turn whose training step kills the process or raises is retried once, then
quarantined, and the server comes up, serves and trains the other turns.

The kill test runs the real `rlproxy serve` as a subprocess, drives it with the openai SDK, and
SIGKILLs it while the train journal shows a step over a long turn running: once on the first
attempt, once on the retry after the restart. The raise test writes a turn record whose
log-probs lost an entry (so its loss cannot be built) into a real data directory and starts the
real app on it with training on. The rest drive the real trainer on the tiny model: the turns of
a several-turn step that died, ids outside the vocabulary, and steps lost since the last
checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import requests

from rlproxy.serving.model import load_serving_model
from rlproxy.settings import ModelSettings
from rlproxy.training.items import released_turns
from rlproxy.training import control
from rlproxy.training.journal import JOURNAL
from rlproxy.training.learner import LearnerFailed, LearnerUnavailable
from rlproxy.training.loop import Trainer, training_copy
from conftest import ServerThread, make_settings, read_records, tiny_copy
from rlproxy.ops.served import free_port, server_env, wait_healthy
from test_durability import read_lines, stop

REPO = Path(__file__).resolve().parents[1]
REWARD_MODULE = "def reward(turn, next_state):\n    return 1.0\n"
# ~3,500 prompt tokens (one per word with the embedded tokenizer). With --prompt-grad full one
# step over it on the tiny model takes seconds (8.9 s measured on the shared 2-core CPU), long
# enough to see its journal line, then SIGKILL the server inside it; both such steps are killed,
# so the test never waits for one to finish.
LONG_WORDS = 3500
COMMON = ["the", "of", "and", "to", "in", "is", "that", "it", "was", "for"]


def journal(data: Path) -> list[dict]:
    return read_lines(data / JOURNAL) if (data / JOURNAL).exists() else []


def serve(data: Path, tmp: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """`rlproxy serve` with training on, one turn per step and a reward function; waits until
    /healthz answers, without asserting it is ok (the caller checks)."""
    port = free_port()
    env = server_env(tmp, REPO)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlproxy.cli", "serve", "--model", "tiny", "--port", str(port), "--data-dir",
             str(data), "--log-level", "WARNING", "--batch-size", "1", "--no-judge",
             "--no-at-least-one", "--reward-function", "poison_reward:reward",
             "--baseline", "none",  # a constant reward must still train every turn
             "--save-interval", "1000", "--no-prefix-cache", "--prompt-grad", "full"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, log, ok_only=False)
    return proc, url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(url: str, sid: str, content: str) -> str:
    """One finished session of one turn (released for training at once); its turn's uid."""
    raw = client(url).chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": content}], max_tokens=8, seed=1,
        extra_headers={"X-Session-Id": sid, "X-Session-Done": "1"})
    assert raw.parse().choices[0].finish_reason in ("length", "stop")
    return raw.headers["X-Turn-Uid"]


def wait_for_start(data: Path, uid: str, attempt: int, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in journal(data):
            if line["kind"] == "step_start" and line["uids"] == [uid] \
                    and line["attempt"] == attempt:
                return line
        time.sleep(0.01)
    raise AssertionError(f"no step over {uid} (attempt {attempt}) in {timeout} s: "
                         f"{journal(data)}")


def kill_inside(proc: subprocess.Popen, data: Path, start: dict) -> None:
    """SIGKILL now, and check the step was still running (no end line)."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    ends = [ln for ln in journal(data) if ln["kind"] == "step_end" and ln["n"] == start["n"]]
    assert not ends, f"the step ended before the kill ({ends}): make the long turn longer"


def health(url: str) -> dict:
    r = requests.get(url + "/healthz", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def trained_uids(data: Path) -> list[str]:
    return [u for line in read_lines(data / "training.jsonl") if line.get("kind") == "step"
            for u in line["uids"]]


def test_a_turn_killed_in_its_step_twice_is_quarantined_and_the_server_serves(tmp_path):
    (tmp_path / "poison_reward.py").write_text(REWARD_MODULE)
    data, log = tmp_path / "data", tmp_path / "server.log"
    rng = random.Random(0)
    long_text = " ".join(rng.choice(COMMON) for _ in range(LONG_WORDS))
    procs = []
    try:
        # 1. the long turn's first step, after a clean one (a death before any clean step
        # charges no one: training/journal.py's crash blame): killed inside it
        proc, url = serve(data, tmp_path, log)
        procs.append(proc)
        warm = chat(url, "warm-up", "A short question first.")
        wait_until(lambda: warm in trained_uids(data), what="the warm-up step")
        long_uid = chat(url, "long", long_text)
        kill_inside(proc, data, wait_for_start(data, long_uid, attempt=1))

        # 2. restart: it serves while the turn is retried (alone); killed inside the retry
        proc, url = serve(data, tmp_path, log)
        procs.append(proc)
        assert health(url)["status"] == "ok"
        during = chat(url, "during-retry", "A short question while the retry runs.")
        retry = wait_for_start(data, long_uid, attempt=2)
        kill_inside(proc, data, retry)

        # 3. restart: the turn is quarantined, the server serves and trains the others
        proc, url = serve(data, tmp_path, log)
        procs.append(proc)
        trainer = health(url)["trainer"]
        assert trainer["quarantined"] == 1 and trainer["alive"] and trainer["error"] is None
        after = chat(url, "after", "And one after the restart.")
        deadline = time.monotonic() + 60
        while not {during, after} <= set(trained_uids(data)):
            assert time.monotonic() < deadline, (trained_uids(data), journal(data))
            time.sleep(0.1)
        assert long_uid not in trained_uids(data)
        trainer = health(url)["trainer"]
        assert (trainer["quarantined"], trainer["error"], trainer["alive"]) == (1, None, True)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        for p in procs:
            stop(p)
    lines = journal(data)
    mine = [ln for ln in lines if long_uid in ln.get("uids", [ln.get("uid")])]
    assert [ln["kind"] for ln in mine] == ["step_start", "step_start", "quarantined"], mine
    died = [ln for ln in lines if ln["kind"] == "step_end" and ln.get("died")]
    assert [ln["n"] for ln in died] == [mine[0]["n"], mine[1]["n"]]  # each ended at a restart
    assert "died" in mine[2]["reason"] and mine[2]["attempts"] == 2
    assert all(ln["schema_version"] == 1 for ln in lines)
    # never trained again: not by the next resume, not by `rlproxy train --from`
    assert long_uid not in {s["turn"]["uid"] for s in released_turns(data, 1.0, 1.0)}
    assert {during, after} <= {s["turn"]["uid"] for s in released_turns(data, 1.0, 1.0)}


def poisoned_copy(record: dict) -> dict:
    """A real turn record whose behaviour log-probs lost their last entry, under a new uid:
    its loss cannot be built, so every step over it raises."""
    bad = json.loads(json.dumps(record))
    bad["uid"] = "poison-" + record["uid"]
    bad["session_id"] = "poison-session"
    bad["choices"][0]["logprobs"] = bad["choices"][0]["logprobs"][:-1]
    return bad


def wait_until(check, timeout: float = 60, what: str = ""):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return found


@pytest.fixture(scope="module")
def own():
    return tiny_copy()  # trained here: a private copy, shared by this module's tests


def test_a_step_that_raises_is_retried_turn_by_turn_and_its_turn_quarantined(own, tmp_path):
    # baseline none: a turn retried alone must carry signal (a mean baseline can zero it)
    flags = dict(judge=False, at_least_one=False, reward_functions=["test_trainer:target_reward"],
                 save_interval=1000, prefix_cache=False, baseline="none")
    with ServerThread(make_settings(tmp_path, **flags), own) as s:  # record, no training
        first = [chat(s.url, f"rec-{i}", f"hello {i}") for i in range(2)]
        wait_until(lambda: len([r for r in read_records(tmp_path, "prm_scores.jsonl")
                                if r["kind"] == "release"]) == 2, what="release")
    record = next(r for r in read_records(tmp_path) if r["uid"] == first[0])
    bad = poisoned_copy(record)
    with open(tmp_path / "conversations.jsonl", "a") as f:  # trainable, not yet scored
        f.write(json.dumps(bad) + "\n")

    settings = make_settings(tmp_path, train=True, batch_size=2, **flags)
    with ServerThread(settings, own) as s:
        # resumed: the two released turns train together; the poison one is scored, released,
        # and waits for a partner
        wait_until(lambda: set(first) <= set(trained_uids(tmp_path)), what="resume")
        partner = chat(s.url, "partner", "a turn that shares the poison turn's step")
        wait_until(lambda: partner in trained_uids(tmp_path), what="partner")
        trainer = health(s.url)["trainer"]
        assert trainer["alive"] and trainer["error"] is None
        assert (trainer["quarantined"], trainer["failed_steps"]) == (1, 2)
        later = [chat(s.url, f"later-{i}", f"later {i}") for i in range(2)]
        wait_until(lambda: set(later) <= set(trained_uids(tmp_path)), what="later")
        assert health(s.url)["trainer"]["alive"]

    steps = [(ln["kind"], ln.get("uids", ln.get("uid")), ln.get("attempt"), ln.get("ok"))
             for ln in journal(tmp_path)]
    assert steps == [
        ("step_start", first, 1, None), ("step_end", None, None, True),
        ("step_start", [bad["uid"], partner], 1, None), ("step_end", None, None, False),
        ("step_start", [bad["uid"]], 2, None), ("step_end", None, None, False),
        ("quarantined", bad["uid"], None, None),
        ("step_start", [partner], 2, None), ("step_end", None, None, True),
        ("step_start", later, 1, None), ("step_end", None, None, True),
    ], steps
    quarantine = journal(tmp_path)[6]
    assert "ValueError" in quarantine["reason"] or "shape" in quarantine["reason"], quarantine
    assert bad["uid"] not in trained_uids(tmp_path)
    assert bad["uid"] not in {t["turn"]["uid"] for t in released_turns(tmp_path, 1.0, 1.0)}


def make_scored(own, uid: str, completion: list[int]) -> dict:
    """A scored turn as the scorer hands it to the trainer, on a real templated prompt."""
    prompt = own.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                               add_generation_prompt=True)
    turn = {"uid": uid, "prompt_ids": prompt,
            "choices": [{"completion_ids": completion, "logprobs": [-1.0] * len(completion)}]}
    return {"turn": turn, "reward": 1.0, "advantages": [1.0] * len(completion)}


def test_the_turns_of_a_step_that_died_come_back_alone(own, tmp_path):
    """A several-turn step the process died in: after the restart each of its turns trains in
    a step of its own (attempt 2), and new turns still train in full batches."""
    from rlproxy.training.journal import StepJournal

    dead = StepJournal(tmp_path)
    dead.start(["a", "b"], 40)  # ... and the process died: no end line
    dead.close()
    # baseline none: a and b train after c and d, whose rewards a mean baseline would cancel
    trainer = Trainer(make_settings(tmp_path, train=True, batch_size=2, baseline="none"),
                      training_copy(own), own.lora_config, data_dir=tmp_path,
                      vocab_size=own.vocab_size)
    trainer.start()
    try:
        for uid in "abcd":
            trainer.submit(make_scored(own, uid, [5, 6, 7]))
        wait_until(lambda: set("abcd") <= set(trained_uids(tmp_path)), what="training")
    finally:
        trainer.stop()
    steps = [(ln["uids"], ln["attempt"]) for ln in journal(tmp_path)
             if ln["kind"] == "step_start"]
    # died before any clean step: not charged; they wait for one (c, d), then come back alone
    assert steps == [(["a", "b"], 1), (["c", "d"], 1), (["a"], 2), (["b"], 2)], steps
    assert journal(tmp_path)[1] | {"time": 0} == {
        "schema_version": 1, "kind": "step_end", "n": 1, "ok": False, "died": True,
        "charged": False,
        "error": "the process died during this step (killed, out of memory or crashed)",
        "time": 0}
    assert trainer.alive is False and trainer.error is None
    assert not [ln for ln in journal(tmp_path) if ln["kind"] == "quarantined"]


def test_a_turn_with_ids_outside_the_vocabulary_is_quarantined_without_a_try(own, tmp_path):
    """Such ids (turns recorded under another model) make MLX's embedding read out of bounds
    and crash the process rather than raise, so they must never reach a step."""
    trainer = Trainer(make_settings(tmp_path, train=True), training_copy(own), own.lora_config,
                      data_dir=tmp_path, vocab_size=own.vocab_size)
    try:
        lines = trainer.train_journaled([make_scored(own, "foreign", [5, own.vocab_size + 7]),
                                         make_scored(own, "fine", [5, 6])])
    finally:
        trainer.stop()
    assert [ln["uids"] for ln in lines] == [["fine"]]
    quarantined = [ln for ln in journal(tmp_path) if ln["kind"] == "quarantined"]
    assert [(q["uid"], q["attempts"]) for q in quarantined] == [("foreign", 0)]
    assert f"token id {own.vocab_size + 7} is outside" in quarantined[0]["reason"]
    starts = [ln["uids"] for ln in journal(tmp_path) if ln["kind"] == "step_start"]
    assert starts == [["fine"]]


def test_turns_trained_after_the_last_checkpoint_are_trained_again_after_a_kill(own, tmp_path):
    """A kill loses the updates since the last checkpoint; resume trains those turns again
    instead of counting them as trained."""
    # baseline none: the same reward every turn must still train (a mean baseline makes it 0)
    settings = make_settings(tmp_path, train=True, batch_size=1, save_interval=2,
                             baseline="none")
    killed = Trainer(settings, training_copy(own), own.lora_config, data_dir=tmp_path)
    for uid in "abc":
        killed.train_journaled([make_scored(own, uid, [5, 6, 7])])
    killed.writer.close()  # ... and the process dies: step 3 was never saved
    killed.journal.close()

    resumed = Trainer(settings, training_copy(own), own.lora_config, data_dir=tmp_path)
    try:
        assert resumed.resume().name == "step_000002" and resumed.step == 2
        assert set(resumed.trained) == {"a", "b"}
        line = journal(tmp_path)[-1]
        assert (line["kind"], line["step"], line["lost_steps"], line["retrain"]) == \
            ("resumed", 2, 1, ["c"])
        assert [ln["step"] for ln in resumed.train_journaled([make_scored(own, "c", [5, 6])])] \
            == [3]
    finally:
        resumed.stop()
    again = Trainer(settings, training_copy(own), own.lora_config, data_dir=tmp_path)
    try:  # stopped cleanly: step 3 saved, nothing to redo
        assert again.resume().name == "step_000003" and set(again.trained) == {"a", "b", "c"}
    finally:
        again.stop()


def test_a_checkpoint_of_another_lora_layout_is_refused_not_loaded(own, tmp_path):
    """MLX's `update` takes arrays of any shape: without the check, a rank-8 checkpoint loads
    into a rank-4 model and training runs on with zero gradients."""
    trainer = Trainer(make_settings(tmp_path, train=True), training_copy(own), own.lora_config,
                      data_dir=tmp_path)
    trainer.save()
    trainer.stop()
    settings = make_settings(tmp_path, train=True, lora_rank=4)
    other = load_serving_model(settings.model)
    trainer = Trainer(settings, training_copy(other), other.lora_config, data_dir=tmp_path)
    try:
        with pytest.raises(ValueError, match="another model or LoRA layout"):
            trainer.resume()
    finally:
        trainer.stop()


def offline_trainer(own, tmp_path, **flags) -> Trainer:
    return Trainer(make_settings(tmp_path, train=True, **flags), training_copy(own),
                   own.lora_config, data_dir=tmp_path, vocab_size=own.vocab_size)


def steps_of(tmp_path) -> list[tuple[int, list[str]]]:
    return [(ln["step"], ln["uids"]) for ln in read_records(tmp_path, "training.jsonl")
            if ln["kind"] == "step"]


def test_a_failed_checkpoint_save_is_not_charged_to_the_turns(own, tmp_path):
    """The update is applied and published before the save: a full disk (here: checkpoints/
    is a file) costs the checkpoint, never a retrain or a quarantine."""
    t = offline_trainer(own, tmp_path, batch_size=2, save_interval=1)
    t.learner.checkpoints = tmp_path / "not-a-dir"
    t.learner.checkpoints.write_text("")
    lines = t.train_journaled([make_scored(own, "a", [5, 6, 7]), make_scored(own, "b", [8, 9])])
    assert [ln["step"] for ln in lines] == [1] and steps_of(tmp_path) == [(1, ["a", "b"])]
    assert (t.step, t.version, t.stats.save_errors) == (1, 1, 1)
    assert "checkpoint save failed" in t.error
    assert not t.journal.quarantined and not t.journal.failures
    assert [(ln["kind"], ln.get("ok")) for ln in journal(tmp_path)] == [
        ("step_start", None), ("step_end", True)]
    t.stop()


def failing_learner(t: Trainer, error) -> None:
    """The learner seam: a remote learner's step over any batch that holds a `poison` turn
    fails with ERROR (what remote/service.py raises for such an answer); others train."""
    real = t.learner.forward_backward

    def forward_backward(examples, between):
        if any(u.startswith("poison") for e in examples for u in e["uids"]):
            raise error
        return real(examples, between)
    t.learner.forward_backward = forward_backward


def test_a_batch_a_remote_learner_keeps_failing_on_is_charged_then_quarantined(
        own, tmp_path, monkeypatch):
    """A learner that answers one batch with a failure of its own (e.g. out of memory on a
    datum) is retried like an outage, then the batch is charged: split turn by turn, the
    innocent turn trains, the failing one is quarantined; training goes on."""
    monkeypatch.setattr(control, "DISK_RETRY_S", 0.0)
    t = offline_trainer(own, tmp_path, batch_size=2, save_interval=1000, baseline="none")
    failing_learner(t, LearnerFailed("forward_backward: RequestFailedError: out of memory"))
    batch = [make_scored(own, "poison-1", [5, 6, 7]), make_scored(own, "good", [8, 9])]
    results = [t.train_or_wait(batch) for _ in range(control.LEARNER_FAILED_TRIES)]
    assert results == [False] * (control.LEARNER_FAILED_TRIES - 1) + [True]
    assert steps_of(tmp_path) == [(1, ["good"])]
    assert "poison-1" in t.journal.quarantined and t.runner.learner_failures == 0
    assert "out of memory" in str(t.journal.quarantined["poison-1"])
    t.stop()


def test_a_learner_that_is_down_never_charges_the_turns(own, tmp_path, monkeypatch):
    """Retried as often as it takes, uncharged; when the learner is back the batch trains
    whole, and the running reward baseline took each reward once (the default `mean`: taken at
    every retry, it swallowed the batch's own signal and the batch was skipped)."""
    monkeypatch.setattr(control, "DISK_RETRY_S", 0.0)
    t = offline_trainer(own, tmp_path, batch_size=2, save_interval=1000)
    down = {"poison": True}
    real = t.learner.forward_backward

    def forward_backward(examples, between):
        if down["poison"]:
            raise LearnerUnavailable("forward_backward: no answer in 10 s")
        return real(examples, between)
    t.learner.forward_backward = forward_backward
    batch = [make_scored(own, "a", [5, 6, 7]), make_scored(own, "b", [8, 9])]
    batch[1]["reward"] = -1.0
    batch[1]["advantages"] = [-1.0] * 2
    assert not any(t.train_or_wait(batch) for _ in range(6))
    assert not t.journal.quarantined and not t.journal.failures and not steps_of(tmp_path)
    assert "waits for the learner (try 6" in t.error
    assert t.baseline_n == 2
    down["poison"] = False
    assert t.train_or_wait(batch)
    assert steps_of(tmp_path) == [(1, ["a", "b"])] and t.error is None
    assert t.baseline_n == 2
    t.stop()


def test_a_later_epoch_failing_does_not_retrain_the_applied_update(own, tmp_path):
    t = offline_trainer(own, tmp_path, batch_size=2, train_epochs=2, save_interval=1000)
    real = t.runner.train_step

    def second_epoch_breaks(examples, epoch=0):
        if epoch == 1:
            raise RuntimeError("epoch 2 broke")
        return real(examples, epoch)

    t.runner.train_step = second_epoch_breaks
    t.train_journaled([make_scored(own, "a", [5, 6, 7]), make_scored(own, "b", [8, 9])])
    assert steps_of(tmp_path) == [(1, ["a", "b"])] and t.step == 1
    assert not t.journal.quarantined and {"a", "b"} <= set(t.trained)
    assert t.stats.errors_after_update == 1 and "epoch 2 broke" in t.error
    t.stop()


def test_a_retried_turn_advances_the_reward_baseline_once(own, tmp_path):
    t = offline_trainer(own, tmp_path, batch_size=2, save_interval=1000)
    bad = make_scored(own, "bad", [5, "six", 7])  # a malformed record: its step raises
    bad["reward"] = 0.0  # so that a's retry, alone, has a non-zero advantage (1 - mean 0.9)
    t.train_journaled([make_scored(own, "a", [8, 9]), bad])
    assert t.journal.quarantined.keys() == {"bad"} and steps_of(tmp_path) == [(1, ["a"])]
    assert t.baseline_n == 2  # a and bad once each, though a was tried twice, bad three times
    t.stop()


def test_every_turn_failing_alike_pauses_training_instead_of_quarantining_all(own, tmp_path):
    """A cause outside the turns (say, a model the loss does not support): after three
    different turns fail in a row with one error type, training pauses with an error."""
    # baseline none: equal rewards after the first would be zero advantages, never reaching
    # the loss at all
    t = offline_trainer(own, tmp_path, batch_size=1, save_interval=1000, baseline="none")

    def unsupported(*args, **kwargs):
        raise NotImplementedError("this model's layers are not supported")

    t.learner.loss_fn = unsupported
    for uid in "abcd":
        if not t.paused:
            t.train_journaled([make_scored(own, uid, [5, 6, 7])])
    assert t.paused and "training paused" in t.error and "NotImplementedError" in t.error
    assert set(t.journal.quarantined) == {"a", "b"}  # c was not quarantined, d not tried
    assert t.books.inbox.get_nowait()["turn"]["uid"] == "c"  # kept for after the resume
    t.unpause()
    assert t.error is None and not t.paused
    t.stop()


def test_an_update_for_a_waiting_turn_replaces_it_and_queued_is_pruned(own, tmp_path):
    t = offline_trainer(own, tmp_path, batch_size=2, save_interval=1000, max_context_tokens=40)
    a, b = make_scored(own, "a", [5, 6, 7]), make_scored(own, "b", [8, 9])
    t.submit(a)
    t.submit(b)
    t.submit({**a, "reward": 0.25, "update": True})  # feedback while a waits in the inbox
    batch = t.books.next_batch(t.t.batch_size)  # as the trainer thread collects it
    assert [(s["turn"]["uid"], s["reward"]) for s in batch] == [("a", 0.25), ("b", 1.0)]
    assert t.books.inbox.empty()
    t.train_journaled(batch)
    t._done(batch)
    assert t.books.queued == set() and steps_of(tmp_path) == [(1, ["a", "b"])]

    long = make_scored(own, "long", [5] * 60)  # over max_context_tokens: skipped
    for _ in range(2):  # e.g. resubmitted by a restart: one `skipped` line, queued pruned
        t.submit(long)
        t.train_journaled([long])
        t._done([long])
    skipped = [ln for ln in read_records(tmp_path, "training.jsonl") if ln["kind"] == "skipped"]
    assert [ln["uid"] for ln in skipped] == ["long"] and t.books.queued == set()
    t.stop()


def test_a_second_rollback_request_rejects_the_first(own, tmp_path):
    from rlproxy.training.control import CheckpointGone, RollbackSuperseded

    t = offline_trainer(own, tmp_path, save_interval=1000)
    with pytest.raises(CheckpointGone):  # found when asked for, not later on the trainer thread
        t.request_rollback(1)
    for step in (1, 2):
        t.step = step
        t.save()
    first = t.request_rollback(1)
    second = t.request_rollback(2)
    with pytest.raises(RollbackSuperseded):
        first.result(timeout=1)
    assert not second.done() and t.operator.pending[0].name == "step_000002"
    t.stop()


def test_a_pending_rollback_target_survives_the_prune_of_later_saves(own, tmp_path):
    t = offline_trainer(own, tmp_path, save_interval=1000, keep_checkpoints=2)
    t.step = 1
    t.save()
    pending = t.request_rollback(1)
    for step in range(2, 6):  # each save prunes to the 2 newest, but never the pinned target
        t.step = step
        t.save()
    kept = sorted(p.name for p in t.learner.checkpoints.glob("step_*"))
    assert kept == ["step_000001", "step_000004", "step_000005"]
    assert not pending.done()
    t.operator.between_batches()  # the trainer thread's turn: it loads the pinned checkpoint
    assert pending.result(timeout=1)["checkpoint_step"] == 1
    t.stop()


def test_the_default_memory_budget_leaves_room_for_the_loaded_weights(own, tmp_path):
    """No train_memory_gb: 3/4 of physical memory less the weights (the KL reference model's
    too) and the serving reserve, not half of physical memory whatever is loaded."""
    from mlx.utils import tree_flatten

    from rlproxy.training import chunked_grad

    model = training_copy(own)
    alone = Trainer(make_settings(tmp_path, train=True), model, own.lora_config,
                    data_dir=tmp_path)
    alone.stop()
    ref = load_serving_model(ModelSettings(model="tiny")).model
    with_ref = Trainer(make_settings(tmp_path, train=True), model, own.lora_config,
                       data_dir=tmp_path, ref_model=ref)
    with_ref.stop()
    weights = sum(v.nbytes for _, v in tree_flatten(ref.parameters()))
    free = chunked_grad.physical_memory_bytes() - chunked_grad.SERVING_RESERVE
    budget, budget_with_ref = alone.learner.memory_budget, with_ref.learner.memory_budget
    assert budget == int(0.75 * (free - weights))  # the same base: counted once
    assert budget - budget_with_ref in range(int(0.75 * weights) - 1, int(0.75 * weights) + 2)


def test_the_step_estimate_covers_a_measured_kv_heavy_long_turn():
    """Measured (/tmp/review9/mem.py 24576 none|full f32, NOTES_trainfix): one step on a 24k-token
    turn of a 4-layer llama with 2 KV heads of dim 256 peaked at 1690 MB (none) and 1976 MB
    (full) over the loaded model; the estimate without its runtime slack must not be below."""
    from mlx_lm.models import llama

    from rlproxy.training import chunked_grad

    m = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=128, num_hidden_layers=4, intermediate_size=256,
        num_attention_heads=2, num_key_value_heads=2, head_dim=256, rms_norm_eps=1e-5,
        vocab_size=512, tie_word_embeddings=False))
    for mode, peak_mb in (("none", 1690), ("full", 1976)):
        est = chunked_grad.estimate_step_bytes(chunked_grad.model_shape(m), 24576, 128, mode, 64)
        assert est - chunked_grad.RUNTIME_SLACK >= peak_mb * 2**20, mode
