"""Hostile restarts (issue 24 rows 5 and 9): the real server starts through corrupt files, and
kills by an operator do not get innocent turns quarantined.

Row 9 runs `rlproxy serve` as a subprocess and SIGKILLs it five times in a row inside training
steps over four innocent long turns: none is quarantined, and all four train once the kills
stop; a turn that dies with every process that trains it is still quarantined. Row 5 corrupts
each file rlproxy reads at start (the newest checkpoint's adapter, an optimizer file,
trainer_state.json, the prefix cache's SQLite file, the stored responses, a journal line, a cut
last record line) and starts the real server on it: it starts, names each file in a WARNING,
sets it aside as `<name>.corrupt-<time>` and goes on from what is intact.
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

import pytest
import requests

from rlproxy.ops.served import Served, free_port
from rlproxy.records import read_jsonl

from test_poison import (
    COMMON, REPO, REWARD_MODULE, chat, health, journal, kill_inside, serve, trained_uids,
)
from test_durability import stop

# ~1,500 prompt tokens: a step over one takes a few seconds on the tiny model with
# --prompt-grad full (2-core CPU), long enough to see its start and kill inside it
LONG_WORDS = 1500


def long_text(seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(COMMON) for _ in range(LONG_WORDS))


def next_start(data: Path, after: int, timeout: float = 90) -> dict:
    """The first step_start numbered above AFTER."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in journal(data):
            if line["kind"] == "step_start" and line["n"] > after:
                return line
        time.sleep(0.01)
    raise AssertionError(f"no step after {after} in {timeout} s: {journal(data)}")


def start_of(data: Path, uid: str, after: int, timeout: float = 90) -> dict:
    """The first step_start over UID alone numbered above AFTER."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in journal(data):
            if line["kind"] == "step_start" and line["n"] > after and line["uids"] == [uid]:
                return line
        time.sleep(0.01)
    raise AssertionError(f"no step over {uid} after {after} in {timeout} s: {journal(data)}")


def wait_trained(data: Path, uids: set[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not uids <= set(trained_uids(data)):
        assert time.monotonic() < deadline, (
            uids, trained_uids(data), list(read_jsonl(data / "train_journal.jsonl")))
        time.sleep(0.1)


@pytest.mark.slow
def test_five_kills_in_a_row_during_steps_quarantine_no_innocent_turn(tmp_path):
    (tmp_path / "poison_reward.py").write_text(REWARD_MODULE)
    data, log = tmp_path / "data", tmp_path / "server.log"
    procs, last = [], 0
    try:
        proc, url = serve(data, tmp_path, log)
        procs.append(proc)
        innocent = [chat(url, f"long-{i}", long_text(i)) for i in range(4)]
        # kills 1-4: each in the first step after a (re)start, as an operator's restarts land
        for _ in range(4):
            start = next_start(data, last)
            kill_inside(proc, data, start)
            last = start["n"]
            proc, url = serve(data, tmp_path, log)
            procs.append(proc)
        # kill 5: in a suspect's retry, after a clean step made this process proven: charged
        # once, which is not enough to quarantine it
        short = chat(url, "short-1", "A short question.")
        wait_trained(data, {short})
        start = start_of(data, innocent[0], last)
        assert start["proven"] and start["attempt"] == 2, start
        kill_inside(proc, data, start)
        last = start["n"]
        # no more kills: every innocent turn trains
        proc, url = serve(data, tmp_path, log)
        procs.append(proc)
        assert health(url)["trainer"]["quarantined"] == 0
        chat(url, "short-2", "Another short question.")
        wait_trained(data, set(innocent), timeout=180)
        assert health(url)["trainer"]["quarantined"] == 0
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        for p in procs:
            stop(p)
    lines = journal(data)
    assert not [ln for ln in lines if ln["kind"] == "quarantined"], lines
    died = [ln for ln in lines if ln["kind"] == "step_end" and ln.get("died")]
    assert [ln["charged"] for ln in died] == [False] * 4 + [True], died


@pytest.mark.slow
def test_a_turn_that_kills_every_process_that_trains_it_is_still_quarantined(tmp_path):
    (tmp_path / "poison_reward.py").write_text(REWARD_MODULE)
    data, log = tmp_path / "data", tmp_path / "server.log"
    procs = []
    try:
        proc, url = serve(data, tmp_path, log)
        procs.append(proc)
        poison = chat(url, "poison", long_text(99))
        start = start_of(data, poison, 0)
        kill_inside(proc, data, start)  # unproven: a suspect, not charged
        for i in range(2):  # each restart: a clean step, then the poison alone, which kills
            proc, url = serve(data, tmp_path, log)
            procs.append(proc)
            chat(url, f"short-{i}", "A short question.")
            start = start_of(data, poison, start["n"])
            assert start["proven"], start
            ends = {ln["n"]: ln for ln in journal(data) if ln["kind"] == "step_end"}
            assert ends[start["n"] - 1]["ok"], "the suspect ran before a clean step"
            kill_inside(proc, data, start)
        proc, url = serve(data, tmp_path, log)
        procs.append(proc)
        trainer = health(url)["trainer"]
        assert (trainer["quarantined"], trainer["alive"], trainer["error"]) == (1, True, None)
        after = chat(url, "after", "And one after.")
        wait_trained(data, {after})
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        for p in procs:
            stop(p)
    quarantined = [ln for ln in journal(data) if ln["kind"] == "quarantined"]
    assert [(q["uid"], q["attempts"]) for q in quarantined] == [(poison, 2)], quarantined
    assert poison not in trained_uids(data)


def serve_with(data: Path, tmp: Path, log: Path, *flags: str):
    """`rlproxy serve` with training (one turn per step, a checkpoint each step) and the
    prefix cache on, once /healthz answers 200: (process, url)."""
    server = Served(data, "--log-level", "WARNING", "--batch-size", "1", "--no-judge",
                    "--no-at-least-one", "--reward-function", "poison_reward:reward",
                    "--baseline", "none", "--save-interval", "1", "--keep-checkpoints", "5",
                    *flags, log=log, python_path=(tmp, REPO))
    return server.proc, server.url


def sigterm(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


@pytest.mark.slow  # three starts of the real server: about 20 s
def test_the_server_starts_through_corrupt_files_and_sets_them_aside(tmp_path):
    (tmp_path / "poison_reward.py").write_text(REWARD_MODULE)
    data, log = tmp_path / "data", tmp_path / "server.log"
    ckpt = data / "checkpoints"
    proc, url = serve_with(data, tmp_path, log)
    try:
        uids = [chat(url, f"s{i}", f"question {i}") for i in range(3)]
        wait_trained(data, set(uids))
        r = requests.post(url + "/v1/responses", timeout=60, json={
            "model": "m", "input": "hello", "max_output_tokens": 4, "store": True})
        assert r.status_code == 200, r.text
        sigterm(proc)
    finally:
        stop(proc)
    assert [p.name for p in sorted(ckpt.glob("step_*"))][-3:] == [
        "step_000001", "step_000002", "step_000003"]

    # the damage
    (ckpt / "step_000003" / "adapters.safetensors").write_bytes(b"garbage" * 100)
    opt = ckpt / "step_000002" / "optimizer.safetensors"
    opt.write_bytes(opt.read_bytes()[: opt.stat().st_size // 2])
    (ckpt / "step_000002" / "trainer_state.json").write_text("{")
    (data / "prefix_cache" / "cache.db").write_bytes(os.urandom(8192))
    (data / "responses" / "cache.db").write_bytes(os.urandom(8192))
    with open(data / "train_journal.jsonl", "ab") as f:
        f.write(b'{"kind": "step_end", "n": "x"}\n{"kind": "quarantined"}\nnot json\n')
    with open(data / "pending_turns.jsonl", "ab") as f:
        f.write(b'{"kind": "turn"}\n')
    with open(data / "prm_scores.jsonl", "ab") as f:
        f.write(b'{"kind": "score", "uid": "odd"}\n')
    conversations = data / "conversations.jsonl"
    cut_at = conversations.stat().st_size
    with open(conversations, "ab") as f:
        f.write(b'{"uid": "cut-short", "session_id": "x"')

    before = log.read_text()
    proc, url = serve_with(data, tmp_path, log)
    try:
        h = health(url)
        assert h["status"] == "ok" and h["trainer"]["alive"], h
        assert h["trainer"]["error"] is None, h["trainer"]
        resumed = [ln for ln in read_jsonl(data / "train_journal.jsonl")
                   if ln.get("kind") == "resumed"]
        assert resumed[-1]["step"] == 2, resumed  # from the intact weights of step 2
        after = chat(url, "after", "one more")  # it serves and trains on
        wait_trained(data, {after})
        sigterm(proc)
    finally:
        stop(proc)
    text = log.read_text()[len(before):]
    assert "Traceback" not in text, text
    warnings = [ln for ln in text.splitlines() if " WARNING " in ln]
    for needle in (f"{ckpt / 'step_000003'} cannot be read",
                   f"{ckpt / 'step_000002'} cannot be read (optimizer.safetensors",
                   "trainer_state.json", "fresh optimizer",
                   f"{data / 'prefix_cache'} cannot be read",
                   f"{data / 'responses'} cannot be read",
                   "is not a journal line", f"{data / 'train_journal.jsonl'}: line",
                   f"{data / 'pending_turns.jsonl'}: line",
                   f"{data / 'prm_scores.jsonl'}: entry",
                   f"{conversations}: its last line",
                   f"byte offset {cut_at}"):
        assert any(needle in w for w in warnings), (needle, warnings)
    names = sorted(p.name for p in ckpt.iterdir())
    assert any(n.startswith("step_000003.corrupt-") for n in names), names
    assert any(n.startswith("step_000002.corrupt-") for n in names), names
    assert (ckpt / "step_000002" / "trainer_state.json").exists()  # saved again, whole
    assert len(list(data.glob("prefix_cache.corrupt-*"))) == 1
    assert len(list(data.glob("responses.corrupt-*"))) == 1
    # the cut line was moved aside before the first append, not left in the middle
    assert b"cut-short" not in conversations.read_bytes()
    (torn,) = data.glob("conversations.jsonl.torn-*")
    assert torn.read_bytes() == b'{"uid": "cut-short", "session_id": "x"'
    # a second restart on what the first left: nothing new to set aside, no warning of it
    mark = log.read_text()
    proc, url = serve_with(data, tmp_path, log)
    try:
        assert health(url)["trainer"]["step"] >= 3
        sigterm(proc)
    finally:
        stop(proc)
    assert "cannot be read" not in log.read_text()[len(mark):]


def test_a_store_that_cannot_be_opened_is_kept_and_a_damaged_one_set_aside(tmp_path):
    """Out of file descriptors at start (a real EMFILE: RLIMIT_NOFILE at the count open): the
    intact prefix cache is kept and turned off with a WARNING, the stored Responses refuse to
    open, saying why; neither is set aside. A damaged cache.db is set aside."""
    script = tmp_path / "open_stores.py"
    script.write_text(
        "import os, resource, sys\n"
        "from pathlib import Path\n"
        "from rlproxy.api.response_store import open_response_store\n"
        "from rlproxy.kv.prefix_cache import PrefixCache\n"
        "from rlproxy.settings import CacheSettings\n"
        "from rlproxy.stores import StoreUnavailable\n"
        "data = Path(sys.argv[1])\n"
        "PrefixCache(data / 'prefix_cache', CacheSettings(), 'm').close()\n"
        "open_response_store(data / 'responses', 1).close()\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "open_now = len(os.listdir('/proc/self/fd')) - 1\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (open_now, hard))\n"
        "cache = PrefixCache(data / 'prefix_cache', CacheSettings(), 'm')\n"
        "try:\n"
        "    open_response_store(data / 'responses', 1)\n"
        "    print('responses opened')\n"
        "except StoreUnavailable as e:\n"
        "    print('responses:', e)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))\n"
        "print('prefix:', cache.health()['enabled'], cache.health()['reason'])\n"
        "cache.close()\n")
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "data")], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "prefix: False off: the prefix cache at" in out.stdout, out.stdout
    assert "serving without the prefix cache" in out.stderr, out.stderr
    assert "responses: the stored Responses at" in out.stdout, out.stdout
    assert "ulimit -n" in out.stdout and "unable to open database file" in out.stdout
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["prefix_cache", "responses"]

    from rlproxy.api.response_store import open_response_store
    from rlproxy.kv.prefix_cache import PrefixCache
    from rlproxy.settings import CacheSettings

    (tmp_path / "data" / "prefix_cache" / "cache.db").write_bytes(os.urandom(8192))
    (tmp_path / "data" / "responses" / "cache.db").write_bytes(os.urandom(8192))
    cache = PrefixCache(tmp_path / "data" / "prefix_cache", CacheSettings(), "m")
    assert cache.health()["enabled"]
    cache.close()
    open_response_store(tmp_path / "data" / "responses", 1).close()
    names = sorted(p.name for p in (tmp_path / "data").iterdir())
    assert [n.split(".corrupt-")[0] for n in names] == [
        "prefix_cache", "prefix_cache", "responses", "responses"], names


def odd_trainer(data: Path, **flags):
    from rlproxy.serving.model import load_serving_model
    from rlproxy.settings import ModelSettings
    from rlproxy.training.loop import Trainer, training_copy
    from conftest import make_settings

    own = load_serving_model(ModelSettings(model="tiny"))
    return Trainer(make_settings(data, train=True, batch_size=1, baseline="none", **flags),
                   training_copy(own), own.lora_config, data_dir=data,
                   vocab_size=own.vocab_size)


def test_start_time_readers_skip_what_they_cannot_use(tmp_path, caplog, monkeypatch):
    """JSON that is not a line of its file (0, [1], null, missing fields) in training.jsonl,
    train_journal.jsonl, pending_turns.jsonl and prm_scores.jsonl, and a trainer_state.json
    without its adapter version: the trainer starts and resumes, each named in a WARNING. The
    checkpoint is saved again whole; while that save fails (a full disk at start) it stays where
    it is, so its weights are still the newest listed."""
    import errno
    import logging

    from rlproxy.paths import complete_checkpoints
    from rlproxy.records import load_pending
    from rlproxy.training.items import released_turns

    first = odd_trainer(tmp_path)
    first.step, first.version = 1, 1
    first.save()
    first.stop()
    ckpt = tmp_path / "checkpoints" / "step_000001"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    del state["adapter_version"]
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    (tmp_path / "training.jsonl").write_text(
        '0\n[1]\nnull\n{"kind": "step", "uids": 5}\n{"kind": "step"}\n'
        '{"kind": "step", "step": 1, "adapter_version": 1, "uids": ["a", 7]}\n')
    (tmp_path / "train_journal.jsonl").write_text(
        '0\n[1]\n{"kind": "step_start", "n": 5}\n{"kind": "step_start", "n": 6, "uids": [1]}\n'
        '{"kind": "step_end", "n": 2}\n{"kind": "quarantined"}\n')
    (tmp_path / "pending_turns.jsonl").write_text('0\n{"kind": "turn"}\n{"uid": "x"}\n')
    (tmp_path / "prm_scores.jsonl").write_text('[1]\n{"kind": "release"}\n')
    caplog.set_level(logging.WARNING)

    trainer = odd_trainer(tmp_path)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trainer.learner, "save_state", no_space)
    try:
        assert trainer.resume() == ckpt
        assert (trainer.step, trainer.version) == (1, 1) and "a" in trainer.trained
        assert complete_checkpoints(tmp_path / "checkpoints") == [ckpt]  # put back
        assert not list(ckpt.parent.glob("*.corrupt-*"))
        assert not trainer.journal.failures and not trainer.journal.quarantined
        assert released_turns(tmp_path, 0.0, 1.0) == []
        assert load_pending(tmp_path / "pending_turns.jsonl") == []
    finally:
        trainer.stop()
    monkeypatch.undo()
    trainer = odd_trainer(tmp_path)
    try:  # space again: saved whole, the partly unreadable one set aside
        assert trainer.resume() == ckpt
    finally:
        trainer.stop()
    assert json.loads((ckpt / "trainer_state.json").read_text())["adapter_version"] == 1
    assert len(list(ckpt.parent.glob("step_000001.corrupt-*"))) == 1
    text = caplog.text
    for needle in ("training.jsonl: line 1 is not a JSON object",
                   "train_journal.jsonl: line 3 is not a journal line",
                   "train_journal.jsonl: line 4 is not a journal line",
                   "pending_turns.jsonl: line 2 is not a pending turn",
                   "prm_scores.jsonl: line 2 has no uid",
                   "no step number or adapter version", "is back in place"):
        assert needle in text, (needle, text)


def test_a_stop_that_gives_up_on_a_slow_step_charges_none_of_its_turns(tmp_path, monkeypatch):
    """stop() waits --drain-timeout-s and then STOP_WAIT_S for a step that reaches no unit
    (where a stop would end it), then ends it uncharged (`stopped`) before the process exits in
    it: the next start finds no open step to book as a death."""
    from rlproxy.training import loop
    from rlproxy.serving.model import load_serving_model
    from rlproxy.settings import ModelSettings
    from rlproxy.training.journal import StepJournal, read_journal
    from test_poison import make_scored

    trainer = odd_trainer(tmp_path)
    trainer.journal.clean_steps = 1  # proven: a death now would charge its turns
    real = trainer.learner.forward_backward

    def slow(*args, **kwargs):  # a step longer than the stop waits for
        time.sleep(2.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer.learner, "forward_backward", slow)
    monkeypatch.setattr(loop, "STOP_WAIT_S", 0.2)
    trainer.settings.server.drain_timeout_s = 0.1
    model = load_serving_model(ModelSettings(model="tiny"))
    trainer.start()
    thread = trainer._thread
    trainer.submit(make_scored(model, "slow", [5, 6, 7]))
    deadline = time.monotonic() + 30
    while not [ln for ln in journal(tmp_path) if ln["kind"] == "step_start"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    trainer.stop()
    thread.join(timeout=60)  # it finds its files closed and ends
    ends = [ln for ln in journal(tmp_path) if ln["kind"] == "step_end"]
    assert [(e["ok"], e["charged"], e.get("stopped")) for e in ends] == [(False, False, True)]
    assert not read_journal(tmp_path).open_steps
    restarted = StepJournal(tmp_path)
    try:
        assert not restarted.failures and not restarted.suspects
    finally:
        restarted.close()


def test_a_start_up_error_ends_the_engine_thread_before_the_error_goes_up(tiny, tmp_path,
                                                                           monkeypatch):
    """A refusal while the pipeline starts (here --trainer tinker without a key) comes after
    the engine started: run_app still runs the started contexts' cleanup, so the engine's MLX
    thread has ended when `rlproxy serve` exits 2 (alive at exit, it could abort the process:
    a -6 instead of 2, seen once in CI)."""
    import threading

    from rlproxy.api import server
    from rlproxy.app import create_app

    from conftest import make_settings

    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    settings = make_settings(tmp_path, train=True, trainer="tinker", judge=False,
                             tinker_url="http://127.0.0.1:9", prefix_cache=False)
    before = set(threading.enumerate())
    with pytest.raises(ValueError, match="need a key"):
        server.run_app(create_app(settings, tiny), host="127.0.0.1", port=free_port(),
                       print=lambda msg: None)
    left = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
    assert "rlproxy-engine" not in left, left
