"""conversations.jsonl's index (records.py: `JsonlWriter(index=True)`, `IndexedFile`): what
start-up reads instead of every turn line. Recovery through the index rebuilds exactly the
state that reading every line does, on a history written as a server writes it (bench/startup.py's
synthetic agent sessions, extending lines); an index that is missing, torn, cut short, holed,
stale or another file's is trusted only as far as it matches, the rest is read from the file,
and the index is brought up to date; a writer's index entries name its lines' offsets, and a
write that fails leaves none."""

from __future__ import annotations

import errno
import shutil
import sys
from pathlib import Path

import orjson
import pytest

from rlproxy import records
from rlproxy.paths import CONVERSATIONS
from rlproxy.records import AT, LENGTH, JsonlWriter, index_path, indexed_lines, numbered_jsonl
from rlproxy.recovery import recover
from rlproxy.settings import load_settings
from rlproxy.training.restart import handled_keys, read_start

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from startup import write_history  # noqa: E402


@pytest.fixture(scope="module")
def history(tmp_path_factory) -> Path:
    """300 turns of 15 agent sessions (the last 4 open), lines that extend the turn before."""
    data = tmp_path_factory.mktemp("history") / "data"
    write_history(data, 300, 800, extend=True)
    return data


def state(data: Path) -> dict:
    """What recovery rebuilds from DATA (a fresh copy of its journal each time: start-up
    compacts it), in comparable form."""
    shutil.copy(data / "pending_turns.pristine", data / "pending_turns.jsonl")
    settings = load_settings({"data_dir": str(data), "model": "tiny", "judge": False}, environ={})
    # the scorer keeps the last 32 released turns whole (not 4,096: most of a long history is
    # neither kept nor trained)
    r = recover(data, settings, set(handled_keys(read_start(data).lines)), keep_recent=32)
    s = r.scorer
    return {"reopen": list(r.store.reopen.items()),
            "pending": [orjson.dumps(e) for e in r.store.pending],
            "unscored": [orjson.dumps(t) for t in s.unscored],
            "held": {u: v[1] for u, v in s.held.items()},
            "recent": [(u, v[1]) for u, v in s.recent.items()],
            "summaries": list(s.summaries.items()),
            "items": [orjson.dumps(i, option=orjson.OPT_SERIALIZE_NUMPY)
                      for i in r.trainer.released]}


def entries(data: Path) -> list[dict]:
    return [orjson.loads(ln) for ln in index_path(data / CONVERSATIONS).read_bytes().splitlines()]


def lines_of(data: Path) -> list[tuple[int, int]]:
    """(offset, length) of each line of conversations.jsonl."""
    out, at = [], 0
    for raw in (data / CONVERSATIONS).read_bytes().splitlines(keepends=True):
        out.append((at, len(raw)))
        at += len(raw)
    return out


@pytest.fixture(scope="module")
def expected(history, tmp_path_factory) -> dict:
    """The state read from every line (no index), and the index that first start wrote."""
    first = tmp_path_factory.mktemp("first") / "data"
    shutil.copytree(history, first)
    assert not index_path(first / CONVERSATIONS).exists()
    whole = state(first)
    assert whole["items"] and whole["unscored"] and whole["recent"] and whole["pending"]
    return {"state": whole, "index": index_path(first / CONVERSATIONS).read_bytes()}


def copy(history: Path, tmp_path: Path, index: bytes | None) -> Path:
    data = tmp_path / "data"
    shutil.copytree(history, data)
    if index is not None:
        index_path(data / CONVERSATIONS).write_bytes(index)
    return data


def test_the_first_start_writes_an_index_that_tiles_the_file(history, expected, tmp_path):
    data = copy(history, tmp_path, expected["index"])
    got = entries(data)
    assert [(e[AT], e[LENGTH]) for e in got] == lines_of(data)
    whole = [line for _, line in numbered_jsonl(data / CONVERSATIONS)]
    for entry, line in zip(got, whole):
        assert entry["uid"] == line["uid"] and entry.get("extends") == line.get("extends")
        assert entry["trainable"] == line["trainable"] and entry["index"] == line["index"]
        assert len(orjson.dumps(entry)) < len(orjson.dumps(line)) / 20  # few fields of it


def test_recovery_through_the_index_rebuilds_the_same_state(history, expected, tmp_path,
                                                             monkeypatch):
    data = copy(history, tmp_path, expected["index"])
    read = []
    whole = records.IndexedFile.whole
    monkeypatch.setattr(records.IndexedFile, "whole",
                        lambda self, entry: read.append(entry["uid"]) or whole(self, entry))
    assert state(data) == expected["state"]
    turns = len(lines_of(data))
    assert 0 < len(read) < turns / 2, (len(read), turns)  # only what a part takes, read whole
    assert index_path(data / CONVERSATIONS).read_bytes() == expected["index"]  # left as it was


def cut_at(index: bytes, n: int) -> bytes:
    return b"".join(index.splitlines(keepends=True)[:n])


@pytest.mark.parametrize("damage", ["missing", "torn", "short", "hole", "garbage", "foreign",
                                    "longer"])
def test_an_index_that_does_not_match_is_trusted_only_as_far_as_it_does(
        history, expected, tmp_path, damage):
    index = expected["index"]
    n = len(index.splitlines())
    bad = {"missing": None,
           "torn": index[:-7],  # its last entry cut
           "short": cut_at(index, n // 3),  # lines appended without it (an older rlproxy)
           "hole": cut_at(index, n // 2) + b"".join(index.splitlines(keepends=True)[n // 2 + 1:]),
           "garbage": cut_at(index, n // 2) + b"not json\n" + index,
           # an index of another file: the same offsets, other turns
           "foreign": index.replace(b'"uid":"agent-', b'"uid":"other-'),
           # entries past the file's end (the file was cut back after a failed write)
           "longer": index + orjson.dumps({
               AT: (history / CONVERSATIONS).stat().st_size, LENGTH: 100, "uid": "x"}) + b"\n",
           }[damage]
    data = copy(history, tmp_path, bad)
    assert state(data) == expected["state"]
    assert index_path(data / CONVERSATIONS).read_bytes() == index  # brought up to date


def test_a_writers_entries_name_its_lines_and_a_failed_write_leaves_none(tmp_path, monkeypatch):
    path = tmp_path / CONVERSATIONS
    writer = JsonlWriter(path, fsync=False, index=True)

    def line(i):
        return {"uid": f"u{i}", "session_id": "s", "index": i, "turn_type": "main",
                "trainable": True, "prompt_ids": list(range(50))}

    at = [writer.write_nowait(line(i)).result() for i in range(2)]
    real = records.os_write

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(records, "os_write", full)  # the disk is full: no line, no entry
    with pytest.raises(OSError):
        writer.write_nowait(line(99)).result()
    monkeypatch.setattr(records, "os_write", real)
    at.append(writer.write_nowait(line(2)).result())
    got = entries(tmp_path)
    assert [e["uid"] for e in got] == ["u0", "u1", "u2"]
    assert [(e[AT], e[LENGTH]) for e in got] == lines_of(tmp_path) and [e[AT] for e in got] == at
    assert "prompt_ids" not in got[0] and got[0]["trainable"] is True

    # the index alone fails (its own file): it is given up for the run, the line is kept
    monkeypatch.setattr(records, "os_write",
                        lambda fd, data: full(fd, data) if fd == writer._index_fd
                        else real(fd, data))
    writer.write_nowait(line(3)).result()
    monkeypatch.setattr(records, "os_write", real)
    writer.write_nowait(line(4)).result()
    writer.close()
    assert [e["uid"] for e in entries(tmp_path)] == ["u0", "u1", "u2"]
    # the next start reads the lines the index lacks, and the index covers the file again
    read = list(indexed_lines(path))
    assert [line["uid"] for _, line in read] == [f"u{i}" for i in range(5)]
    assert [AT in line for _, line in read] == [True] * 3 + [False] * 2
    assert [(e[AT], e[LENGTH]) for e in entries(tmp_path)] == lines_of(tmp_path)
    assert [AT in line for _, line in indexed_lines(path)] == [True] * 5


def test_an_entry_that_names_another_line_is_looked_for_and_the_index_rewritten(
        history, expected, tmp_path, caplog):
    """An index damaged in its middle (an entry's offset names another line): the turn is
    found all the same, the state is the same, and the index is written again next start."""
    lines = expected["index"].splitlines(keepends=True)
    entries_ = [orjson.loads(ln) for ln in lines]
    # two entries in the middle swap what they say of their lines: both still tile the file
    i = len(lines) - 40
    a, b = entries_[i], entries_[i + 1]
    entries_[i], entries_[i + 1] = ({**b, AT: a[AT], LENGTH: a[LENGTH]},
                                    {**a, AT: b[AT], LENGTH: b[LENGTH]})
    data = copy(history, tmp_path, b"".join(orjson.dumps(e) + b"\n" for e in entries_))
    got, want = state(data), expected["state"]
    # the same state, but for the two turns' order in the scorer's queue (the index's order)
    assert sorted(got.pop("unscored")) == sorted(want["unscored"])
    assert got == {k: v for k, v in want.items() if k != "unscored"}
    assert "which holds another" in caplog.text
    assert not index_path(data / CONVERSATIONS).read_bytes()  # dropped: rewritten next start
    assert state(data) == expected["state"]
    assert index_path(data / CONVERSATIONS).read_bytes() == expected["index"]
