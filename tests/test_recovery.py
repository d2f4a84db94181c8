"""Start-up recovery (rlproxy/recovery.py) on a data dir a real server wrote: each record file is
read once, the constructors read none, and the state rebuilt is the state the server had when it
stopped (the scorer's ledger, held and recent turns, the judge's counts; the store's pending turn
and numbering) and the items `released_turns` rebuilds for the trainer."""

from __future__ import annotations

import builtins
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import requests

import rlproxy.records as records
from rlproxy.appkeys import SCORER, SESSIONS
from rlproxy.paths import CONVERSATIONS, JOURNAL, PENDING, SCORES, TRAINING
from rlproxy.recovery import recover
from rlproxy.scoring.scorer import Scorer
from rlproxy.sessions.store import SessionStore
from rlproxy.training.items import released_turns

from conftest import ServerThread, make_settings, read_records

RECORD_FILES = (CONVERSATIONS, SCORES, PENDING, TRAINING, JOURNAL)


def by_parity(turn, next_state):
    """A verifier's reward: +1 on even turns, -1 on odd ones (held while the session is open)."""
    return 1.0 if turn["index"] % 2 == 0 else -1.0


def ledger_state(ledger) -> dict:
    return {"done": dict(ledger.done.items()), "pending": ledger.pending,
            "tallies": {sid: (sorted(t.pending), dict(t.scored), sorted(t.held),
                              sorted(t.liftable), t.closed) for sid, t in ledger.tallies.items()}}


def scorer_state(scorer: Scorer) -> dict:
    return {"ledger": ledger_state(scorer.ledger), "held": sorted(scorer.held),
            "recent": sorted(scorer.recent), "summaries": sorted(scorer.summaries),
            "judge": scorer.health()["judge"], "pending": scorer.pending}


@pytest.fixture(scope="module")
def history(tiny, tmp_path_factory):
    """A real server's data dir, and its scorer's and store's state when it stopped: session a
    (3 turns, done; feedback on its first), b (3 turns, open: the first released, the second
    held, the last pending in the journal), c (one turn of 2 choices, done)."""
    data = tmp_path_factory.mktemp("history")
    settings = make_settings(data, judge=False, reward_functions=["test_recovery:by_parity"])
    with ServerThread(settings, tiny) as s:
        c = s.client()
        for sid, turns in (("a", 3), ("b", 3)):
            messages = [{"role": "user", "content": f"count with {sid}"}]
            for i in range(turns):
                done = {"X-Session-Done": "1"} if sid == "a" and i == turns - 1 else {}
                reply = c.chat.completions.create(
                    model="m", messages=messages, max_tokens=6, seed=i,
                    extra_headers={"X-Session-Id": sid, **done})
                messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                             {"role": "user", "content": f"go on {i}"}]
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "two"}],
                                  max_tokens=6, n=2, seed=7,
                                  extra_headers={"X-Session-Id": "c", "X-Session-Done": "1"})
        scorer = s.app[SCORER]
        deadline = time.time() + 60
        while scorer.stats.scored < 6 or scorer.pending:  # a0-a2, b0, b1, c0
            assert time.time() < deadline, scorer.stats
            time.sleep(0.05)
        r = requests.post(s.base_url + "/feedback", timeout=30,
                          json={"session_id": "a", "turn_index": 0, "reward": 0.5})
        assert r.status_code == 200, r.text
        s.app[SESSIONS].flushed().result(timeout=30)
        live = scorer_state(scorer)
        store = s.app[SESSIONS]
        pending = [t.pending.uid for sess in store.open.values()
                   for t in sess.threads.values() if t.pending is not None]
    return data, settings, live, pending


def test_recovery_rebuilds_what_the_server_had_when_it_stopped(history, tmp_path):
    data, settings, live, pending = history
    data = Path(shutil.copytree(data, tmp_path / "data"))
    state = recover(data, settings)
    assert live["held"] and live["ledger"]["tallies"] and live["recent"]  # something to rebuild
    scorer = Scorer(settings.scoring, data, None, None, None, state.scorer, fsync=False)
    try:
        assert scorer_state(scorer) == live
        assert scorer.queue.empty()  # every trainable turn was scored
    finally:
        scorer.close()
    assert [e["uid"] for e in state.store.pending] == pending and len(pending) == 1
    store = SessionStore(data, 60.0, fsync=False, start=state.store)
    try:
        b = store.open["b"]
        assert [t.pending.uid for t in b.threads.values() if t.pending] == pending
        assert b.turn_count == 3 and store._reopen.peek("a") == (3, False)
    finally:
        store.close()
    assert state.trainer is None  # no trainer: no items rebuilt


def test_the_trainer_gets_what_released_turns_rebuilds(history, tmp_path):
    data, settings, _, _ = history
    items = released_turns(data, settings.scoring.w_opd, settings.scoring.w_rl)
    keys = [i["key"] for i in items]
    assert len(keys) == len(set(keys)) >= 5 and any("/" in k for k in keys)  # c's 2nd choice
    assert recover(data, settings, handled=set()).trainer.released == items
    handled = {keys[0], keys[-1]}
    assert recover(data, settings, handled=handled).trainer.released == \
        released_turns(data, settings.scoring.w_opd, settings.scoring.w_rl, skip=handled)


def count_opens(monkeypatch) -> Counter:
    opened: Counter = Counter()
    real_open = builtins.open

    def counting(file, mode="r", *args, **kw):
        if "r" in mode and Path(file).name in RECORD_FILES:
            opened[Path(file).name] += 1
        return real_open(file, mode, *args, **kw)

    monkeypatch.setattr(builtins, "open", counting)
    return opened


def count_whole_reads(monkeypatch) -> Counter:
    """Every reader of a record file goes through records.numbered_jsonl (read_jsonl and
    load_pending call it; others import it by name), or for conversations.jsonl at start-up
    through records.IndexedFile.lines (its index): count their calls per file."""
    reads: Counter = Counter()
    whole = records.numbered_jsonl

    def counted(path, *args, **kw):
        reads[Path(path).name] += 1
        return whole(path, *args, **kw)

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("rlproxy") and \
                getattr(module, "numbered_jsonl", None) is whole:
            monkeypatch.setattr(module, "numbered_jsonl", counted)
    through_index = records.IndexedFile.lines  # conversations.jsonl's reader (its index)

    def counted_index(self):
        reads[self.path.name] += 1
        return through_index(self)

    monkeypatch.setattr(records.IndexedFile, "lines", counted_index)
    return reads


def test_each_record_file_is_opened_once_and_the_constructors_read_none(history, tmp_path,
                                                                        monkeypatch):
    data, settings, _, _ = history
    data = Path(shutil.copytree(data, tmp_path / "data"))
    opened = count_opens(monkeypatch)
    state = recover(data, settings, handled=set())
    assert opened == Counter({CONVERSATIONS: 1, SCORES: 1, PENDING: 1})
    assert read_records(data, PENDING) == state.store.pending  # compacted to what is pending
    reads = count_whole_reads(monkeypatch)
    store = SessionStore(data, 60.0, fsync=False, start=state.store)
    scorer = Scorer(settings.scoring, data, None, None, None, state.scorer, fsync=False)
    store.close()
    scorer.close()
    assert reads == Counter()


def test_start_up_reads_each_record_file_once(history, tiny, tmp_path, monkeypatch):
    """The real composition (pipeline.build_pipeline, with a trainer): the store's, the
    scorer's and the trainer's files each read whole once, the trainer's own two included."""
    from rlproxy.pipeline import build_pipeline
    from rlproxy.serving.engine import Engine
    from rlproxy.training.loop import Trainer

    data, _, _, _ = history
    data = Path(shutil.copytree(data, tmp_path / "data"))
    settings = make_settings(data, judge=False, train=True,
                             reward_functions=["test_recovery:by_parity"])
    expected = [i["key"] for i in released_turns(data, settings.scoring.w_opd,
                                                 settings.scoring.w_rl)]
    submitted = []
    offer = Trainer.submit
    monkeypatch.setattr(Trainer, "submit",
                        lambda self, item: (submitted.append(item["key"]), offer(self, item)))
    reads = count_whole_reads(monkeypatch)
    p = build_pipeline(settings, tiny, Engine(tiny.model, tiny.tokenizer.eos_token_ids))
    try:
        assert {name: reads[name] for name in RECORD_FILES} == dict.fromkeys(RECORD_FILES, 1), \
            reads
        assert submitted == expected  # nothing trained yet: every release, in order
        assert len(p.store.open) == 1 and p.scorer.held
    finally:
        p.store.close()
        p.trainer.stop()
        p.scorer.close()
