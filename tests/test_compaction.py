"""`rlproxy records compact` (compaction.py) on a history written as a server writes it
(bench/startup.py's agent sessions, lines that extend the turn before): closed, trained sessions
move to a segment and nothing else does; every turn is still there exactly once, rebuilt to the
same record; `rlproxy train --from`'s items and start-up's state are the same after as before;
the live files start-up reads shrink; a second run moves nothing; a data dir in use is refused."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import orjson
import pytest
import requests

from rlproxy.cli import main
from rlproxy.compaction import compact
from rlproxy.paths import CONVERSATIONS, PENDING, SCORES, lock_data_dir, segment_dirs
from rlproxy.records import AT, index_path, indexed_lines, numbered_jsonl, read_turns
from rlproxy.recovery import recover
from rlproxy.settings import load_settings
from rlproxy.training.items import item_key, released_turns
from rlproxy.training.restart import handled_keys, read_start

from conftest import ServerThread, make_settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from startup import write_history  # noqa: E402

KEEP_RECENT = 32  # the scorer's window of recent turns (4,096 by default: all of this history)


@pytest.fixture(scope="module")
def history(tmp_path_factory) -> Path:
    data = tmp_path_factory.mktemp("history") / "data"
    write_history(data, 300, 800, extend=True)
    (data / "pending_turns.pristine").unlink()
    return data


def settings(data: Path):
    return load_settings({"data_dir": str(data), "model": "tiny", "judge": False}, environ={})


def turns(data: Path) -> dict[str, bytes]:
    """uid -> the whole record, from the live files and every segment; each uid once."""
    out = {}
    for folder in [*segment_dirs(data), data]:
        for _, record in read_turns(folder / CONVERSATIONS):
            assert record["uid"] not in out, record["uid"]
            record.pop("schema_version", None)
            out[record["uid"]] = orjson.dumps(record)
    return out


def items(data: Path) -> dict[str, bytes]:
    return {item_key(i): orjson.dumps(i, option=orjson.OPT_SERIALIZE_NUMPY)
            for i in released_turns(data, 1.0, 1.0)}


def state(data: Path) -> dict:
    r = recover(data, settings(data), set(handled_keys(read_start(data).lines)),
                keep_recent=KEEP_RECENT)
    s = r.scorer
    return {"pending": sorted(orjson.dumps(e) for e in r.store.pending),
            "unscored": [t["uid"] for t in s.unscored], "held": sorted(s.held),
            "recent": list(s.recent), "tallies": sorted(s.ledger.tallies),
            "items": [item_key(i) for i in r.trainer.released],
            "reopen": dict(r.store.reopen.items())}  # each session's next index, moved or not


@pytest.fixture(scope="module")
def compacted(history, tmp_path_factory):
    data = tmp_path_factory.mktemp("compacted") / "data"
    shutil.copytree(history, data)
    before = {"turns": turns(data), "items": items(data), "state": state(data),
              "scores": [ln for _, ln in numbered_jsonl(data / SCORES)]}
    done = compact(data, settings(data), keep="agent-000003", keep_recent=KEEP_RECENT)
    return data, before, done


def test_closed_trained_sessions_move_and_every_turn_stays_exactly_once(compacted):
    data, before, done = compacted
    assert done["turns"] > 150 and done["segment"], done
    [segment] = segment_dirs(data)
    assert turns(data) == before["turns"]  # the same records, each once, in one file or another
    moved = {r["session_id"] for _, r in read_turns(segment / CONVERSATIONS)}
    assert len(moved) == done["sessions"]
    live = {r["session_id"] for _, r in read_turns(data / CONVERSATIONS)}
    assert not moved & live
    assert "agent-000003" in live and "agent-000002" in moved  # kept by --keep-sessions
    st = before["state"]
    still = set(st["tallies"]) | {u.rsplit("-", 1)[0] for u in st["unscored"] + st["held"]
                                  + st["recent"] + st["items"]}
    assert still <= live and not still & moved
    # the scores moved with their turns, none lost or doubled
    scores = [ln for folder in (segment, data) for _, ln in numbered_jsonl(folder / SCORES)]
    assert sorted(map(orjson.dumps, scores)) == sorted(map(orjson.dumps, before["scores"]))
    assert {ln["session_id"] for _, ln in numbered_jsonl(segment / SCORES)
            if ln["kind"] == "score"} == moved
    assert done["after"][CONVERSATIONS] < done["before"][CONVERSATIONS] / 2, done


def test_train_from_and_start_up_see_the_same_after(compacted):
    data, before, _ = compacted
    assert items(data) == before["items"]
    assert state(data) == before["state"]
    # the live file's index was written with it: start-up reads no line whole but those wanted
    assert index_path(data / CONVERSATIONS).exists()
    assert all("line_at" in line for _, line in indexed_lines(data / CONVERSATIONS))
    # the pending journal is whole now: it names no offset of the file that was rewritten
    assert not any("extends" in e for _, e in numbered_jsonl(data / PENDING))


def test_a_second_compaction_moves_nothing_and_a_data_dir_in_use_is_refused(
        compacted, tmp_path, capsys):
    data, before, _ = compacted
    copy = tmp_path / "data"
    shutil.copytree(data, copy)
    assert compact(copy, settings(copy), keep="agent-000003",
                   keep_recent=KEEP_RECENT)["turns"] == 0
    assert turns(copy) == before["turns"] and len(segment_dirs(copy)) == 1
    fd = lock_data_dir(copy)
    try:
        assert main(["records", "compact", "--data-dir", str(copy), "--model", "tiny"]) == 3
    finally:
        os.close(fd)
    assert "in use" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["records", "compact", "--data-dir", str(empty), "--model", "tiny"]) == 1
    assert main(["records", "compact", "--data-dir", str(copy), "--model", "tiny",
                 "--keep-sessions", "agent-(("]) == 2  # a usage error, in one line
    err = capsys.readouterr().err
    assert "--keep-sessions" in err and "Traceback" not in err, err


def test_serve_compact_records_compacts_before_start_up_reads_them(tiny, tmp_path):
    """`--compact-records`: the server compacts at start (here a history longer than the
    scorer's default window of 4,096 recent turns), then serves; /healthz counts the segment."""
    data = tmp_path / "data"
    write_history(data, 4400, 300, extend=True)
    shutil.copy(data / "pending_turns.pristine", data / PENDING)
    (data / "pending_turns.pristine").unlink()
    before = turns(data)
    with ServerThread(make_settings(data, compact_records=True), tiny) as server:
        [segment] = segment_dirs(data)
        health = requests.get(server.url + "/healthz", timeout=10).json()
        assert health["records"]["files"]["segments"] > 0, health["records"]
        r = server.client().chat.completions.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
            extra_headers={"X-Session-Id": "after", "X-Session-Done": "1"})
        assert r.choices[0].message is not None
    moved = {r["uid"] for _, r in read_turns(segment / CONVERSATIONS)}
    assert len(moved) > 200
    after = turns(data)
    assert {u: after[u] for u in before} == before and len(after) == len(before) + 1
    # the server's writer indexed its new line right after the compacted file's entries
    assert [AT in line for _, line in indexed_lines(data / CONVERSATIONS)] == \
        [True] * sum(1 for _ in numbered_jsonl(data / CONVERSATIONS))


@pytest.mark.parametrize("dies_at", [CONVERSATIONS, SCORES])
def test_a_compaction_that_dies_midway_loses_nothing_and_scores_nothing_again(
        history, tmp_path, monkeypatch, dies_at):
    """Killed at the rename of the live conversations or of the live scores (after the segment
    and the journal are in place): start-up and train --from see what they saw before, and the
    next compaction finishes the job."""
    import rlproxy.compaction as compaction

    data = tmp_path / "data"
    shutil.copytree(history, data)
    before = {"turns": turns(data), "items": items(data), "state": state(data)}
    real = os.replace

    def dies(src, dst):
        if Path(dst).name == dies_at:
            raise OSError(5, "Input/output error")
        return real(src, dst)

    monkeypatch.setattr(compaction.os, "replace", dies)
    with pytest.raises(OSError):
        compact(data, settings(data), keep_recent=KEEP_RECENT)
    monkeypatch.setattr(compaction.os, "replace", real)
    assert state(data) == before["state"] and items(data) == before["items"]
    done = compact(data, settings(data), keep_recent=KEEP_RECENT)
    [segment] = segment_dirs(data)  # the first one undone, or finished
    assert (done["turns"] > 150) == (dies_at == CONVERSATIONS)
    assert state(data) == before["state"] and items(data) == before["items"]
    assert turns(data) == before["turns"]  # each turn once: in the segment or live
    segment_uids = {r["uid"] for _, r in read_turns(segment / CONVERSATIONS)}
    assert not [ln for _, ln in numbered_jsonl(data / SCORES) if ln["uid"] in segment_uids]
