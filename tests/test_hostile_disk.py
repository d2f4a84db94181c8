"""A full disk (issue 24 row 4): the real server on a data directory that runs out of space.

A turn whose record cannot be written gets 507 in its API's error shape, naming the file; no
torn line is left in any record file; /healthz says `degraded` and names the file, /metrics
counts it; once space is back the next turn is filed and health is ok again, with no restart;
every turn acknowledged before, during and after is on disk exactly once.

The first test mounts a real 8 MB tmpfs (root here) and runs `rlproxy serve` on it as a
subprocess; where mounting is not allowed it is skipped and the second test carries the
checks: the in-process app with records.py's one fault-injection seam (`records.os_write`)
raising ENOSPC after a partial write, which is what a filling disk does.
"""

from __future__ import annotations

import errno
import logging
import subprocess
import time
import uuid
from pathlib import Path

import orjson
import pytest
import requests

from rlproxy import records
from conftest import ServerThread, make_settings
from test_durability import start_server, stop

RECORD_FILES = ("conversations.jsonl", "pending_turns.jsonl", "prm_scores.jsonl")


def turn(url: str, sid: str, api: str = "chat", done: bool = True) -> requests.Response:
    headers = {"X-Session-Id": sid, **({"X-Session-Done": "1"} if done else {})}
    if api == "chat":
        body = {"model": "m", "max_tokens": 6,
                "messages": [{"role": "user", "content": f"{sid}: say something."}]}
        return requests.post(url + "/v1/chat/completions", json=body, headers=headers,
                             timeout=60)
    if api == "responses":  # store: true (the default) keeps it in SQLite too
        body = {"model": "m", "max_output_tokens": 16, "input": f"{sid}: say something."}
        return requests.post(url + "/v1/responses", json=body, headers=headers, timeout=60)
    body = {"model": "m", "max_tokens": 6,
            "messages": [{"role": "user", "content": f"{sid}: say something."}]}
    return requests.post(url + "/v1/messages", json=body, timeout=60,
                         headers={**headers, "anthropic-version": "2023-06-01"})


def assert_whole_lines(data: Path) -> dict[str, list[dict]]:
    """Every record file is whole JSON lines, each ending in a newline: nothing torn."""
    out = {}
    for name in RECORD_FILES + ("train_journal.jsonl", "training.jsonl"):
        path = data / name
        raw = path.read_bytes() if path.exists() else b""
        assert not raw or raw.endswith(b"\n"), f"{name} ends mid-line: {raw[-80:]!r}"
        lines = raw.split(b"\n")[:-1]
        for i, line in enumerate(lines):
            try:
                orjson.loads(line)
            except orjson.JSONDecodeError:
                raise AssertionError(f"{name} line {i + 1} is torn: {line[:120]!r}") from None
        out[name] = [orjson.loads(ln) for ln in lines]
    return out


def assert_acknowledged_on_disk(data: Path, acked: list[str]) -> None:
    """Each acknowledged turn is recorded once, or (its session still open) in the journal."""
    files = assert_whole_lines(data)
    uids = [r["uid"] for r in files["conversations.jsonl"]]
    uids += [e["uid"] for e in records.load_pending(data / "pending_turns.jsonl")
             if e["uid"] not in uids]
    missing = [u for u in acked if u not in uids]
    assert not missing, f"acknowledged turns lost: {missing}"
    assert all(uids.count(u) == 1 for u in acked), "an acknowledged turn recorded twice"


def fill(path: Path) -> None:
    """Write PATH until the disk says it is full."""
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    with open(path, "ab", buffering=0) as f:  # the last few bytes too
        try:
            while True:
                f.write(b"\0" * 512)
        except OSError:
            pass


def check_full(url: str, data: Path, acked: list[str], refill=None) -> None:
    """While the disk is full: 507 in both shapes naming a record file, health degraded. A
    file's last page may still hold a few lines: turns are sent until one fails. The server
    also frees a little space of its own now and then (SQLite's journal, a prefix-cache entry
    dropped), so REFILL takes that back before each checked request; a turn that still finds
    room is filed (200) and counted as acknowledged, and the request is sent again."""
    for i in range(200):
        r = turn(url, f"filling-{i}")
        if r.status_code != 200:
            break
        acked.append(r.headers["X-Turn-Uid"])
    for api, sid in (("chat", "full-chat"), ("messages", "full-messages"),
                     ("responses", "full-responses")):
        for attempt in range(5):
            if refill:
                refill()
            r = turn(url, f"{sid}-{attempt}", api)
            if r.status_code != 200:
                break
            acked.append(r.headers["X-Turn-Uid"])
        assert r.status_code == 507, (api, r.status_code, r.text)
        assert r.headers["Retry-After"].isdigit()
        body = r.json()
        error = body["error"]  # both shapes nest it; the Anthropic one also says "type": "error"
        if api == "messages":
            assert body["type"] == "error" and error["type"] == "api_error", body
        else:
            assert error["code"] == "insufficient_storage", body
        assert "disk is full" in error["message"] and str(data) in error["message"], error
    # streamed: the 200 went out before the turn was filed; the stream must not end as if
    # the turn were kept (no finish event), but with an error chunk that says why, then [DONE]
    body = {"model": "m", "max_tokens": 6, "stream": True,
            "messages": [{"role": "user", "content": "full-stream: say something."}]}
    text = ""
    try:
        with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=60,
                           headers={"X-Session-Id": "full-stream", "X-Session-Done": "1"}) as r:
            for chunk in r.iter_content(None):
                text += chunk.decode()
    except requests.exceptions.RequestException:
        pass
    assert '"finish_reason":"length"' not in text and '"finish_reason":"stop"' not in text, text
    events = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]", text
    error = orjson.loads(events[-2])["error"]
    assert error["code"] == "insufficient_storage" and "disk is full" in error["message"], error
    body = {"model": "m", "max_tokens": 6, "stream": True,
            "messages": [{"role": "user", "content": "full-stream-messages: say something."}]}
    with requests.post(url + "/v1/messages", json=body, stream=True, timeout=60,
                       headers={"X-Session-Id": "full-stream-m", "X-Session-Done": "1"}) as r:
        text = b"".join(r.iter_content(None)).decode()
    assert "message_stop" not in text and "event: error" in text, text
    assert "disk is full" in text.split("event: error")[-1], text
    h = requests.get(url + "/healthz", timeout=10)
    assert h.status_code == 200 and h.json()["status"] == "degraded", h.text
    failing = h.json()["disk"]["failing"]
    assert failing and all(f["path"].startswith(str(data)) for f in failing), failing
    m = requests.get(url + "/metrics", timeout=10).text
    assert f'rlproxy_disk_write_errors_total{{path="{data}/' in m, m[-2000:]


def check_resumed(url: str, data: Path, acked: list[str]) -> None:
    """Space is back: the next turns are filed, health is ok, nothing torn or lost."""
    for i in range(2):
        r = turn(url, f"after-{i}")
        assert r.status_code == 200, r.text
        acked.append(r.headers["X-Turn-Uid"])
    deadline = time.monotonic() + 10  # a scorer retry that began while full may land late
    while (h := requests.get(url + "/healthz", timeout=10).json())["status"] != "ok" and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert h["status"] == "ok" and h["disk"]["failing"] == [], h
    assert_acknowledged_on_disk(data, acked)


@pytest.fixture
def tmpfs(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
                       check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot mount a tmpfs here ({e}); test_a_write_that_fails... covers it")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def test_a_full_tmpfs_gives_507_no_torn_line_and_recovers_without_restart(tmpfs, tmp_path):
    data, log = tmpfs / "data", tmp_path / "server.log"
    proc, url = start_server(data, log)
    try:
        acked = []
        for i in range(3):
            r = turn(url, f"before-{i}", done=i != 1)  # one stays pending in the journal
            assert r.status_code == 200, r.text
            acked.append(r.headers["X-Turn-Uid"])
        fill(tmpfs / "filler")
        fillers = []

        def refill() -> None:
            fillers.append(tmpfs / f"filler-{len(fillers)}")
            fill(fillers[-1])

        check_full(url, data, acked, refill)
        assert_whole_lines(data)
        for path in [tmpfs / "filler", *fillers]:
            path.unlink()
        check_resumed(url, data, acked)
        assert proc.poll() is None
    finally:
        stop(proc)
    text = log.read_text()
    assert "Future exception was never retrieved" not in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


def test_a_write_that_fails_is_cut_back_and_the_server_recovers(tiny, tmp_path, monkeypatch,
                                                                caplog):
    """The fault-injection fallback: each write while `full` writes a few bytes, then fails
    with ENOSPC, as a filling disk does."""
    real_write, full = records.os_write, [False]

    def write_on_a_filling_disk(fd, data):
        if not full[0]:
            return real_write(fd, data)
        if len(data) > 1:  # a partial write first ...
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")  # ... then no space

    monkeypatch.setattr(records, "os_write", write_on_a_filling_disk)
    # the failing-files book is process-wide (one server per process): an earlier test in this
    # worker may have left an entry for a file of its own, long deleted
    monkeypatch.setattr(records, "_failing", {})
    monkeypatch.setattr(records, "_worked", {})
    caplog.set_level(logging.ERROR, logger="asyncio")
    settings = make_settings(tmp_path, prefix_cache=False)
    with ServerThread(settings, tiny) as s:
        acked = []
        for i in range(3):
            r = turn(s.url, f"before-{i}", done=i != 1)
            assert r.status_code == 200, r.text
            acked.append(r.headers["X-Turn-Uid"])
        full[0] = True
        check_full(s.url, tmp_path, acked)
        assert_whole_lines(tmp_path)
        full[0] = False
        check_resumed(s.url, tmp_path, acked)
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


def test_a_cut_last_line_is_reported_with_its_offset(tmp_path, caplog):
    """At start (report_cut) a cut last line is named with its offset; a live reader, which may
    see a line still being appended, skips it without a word. JSON that is not an object is
    skipped too, named; each bad line is warned of once."""
    path = tmp_path / "conversations.jsonl"
    path.write_bytes(b'{"uid": "a"}\nnot json\n0\n{"uid": "b"}\n[1]\nnull\n{"uid": "c", "cut')
    caplog.set_level(logging.WARNING, logger="rlproxy.records")
    assert [r["uid"] for r in records.read_jsonl(path)] == ["a", "b"]  # a live reader
    text = caplog.text
    assert f"{path}: line 2 is not JSON" in text and "byte offset 13" in text, text
    assert "line 3 is not a JSON object" in text and "line 5 is not a JSON object" in text
    assert "cut short" not in text, text
    caplog.clear()
    assert [r["uid"] for r in records.read_jsonl(path, report_cut=True)] == ["a", "b"]
    assert "last line (7) is cut short" in caplog.text and "byte offset 46" in caplog.text
    assert "line 2" not in caplog.text, "warned twice of one line"
    w = records.JsonlWriter(path)  # the next line starts on a line of its own
    w.write({"uid": uuid.uuid4().hex})
    w.close()
    assert len(list(records.read_jsonl(path))) == 3


def test_training_waits_for_space_and_charges_no_turn(tmp_path, monkeypatch):
    """The trainer thread on a full disk: its journal lines are refused, the batch waits (the
    error on /healthz says so) and trains once there is space; no turn is charged. Then a step
    whose start is written but whose end the disk refuses: the end is written before the next
    step's start, so a restart finds no open step to charge, though the process was proven."""
    from rlproxy.serving.model import load_serving_model
    from rlproxy.settings import ModelSettings
    from rlproxy.training import control, loop
    from rlproxy.training.journal import StepJournal, read_journal
    from test_poison import make_scored, trained_uids

    own = load_serving_model(ModelSettings(model="tiny"))
    real_write, full, ends_refused = records.os_write, [False], [False]

    def write(fd, data):
        if full[0] or (ends_refused[0] and b'"kind":"step_end"' in bytes(data)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    def wait(check, what):
        deadline = time.monotonic() + 60
        while not check():
            assert time.monotonic() < deadline, (what, trainer.error)
            time.sleep(0.05)

    monkeypatch.setattr(records, "os_write", write)
    monkeypatch.setattr(control, "DISK_RETRY_S", 0.2)
    trainer = loop.Trainer(make_settings(tmp_path, train=True, batch_size=1, baseline="none"),
                           loop.training_copy(own), own.lora_config, data_dir=tmp_path,
                           vocab_size=own.vocab_size)
    trainer.start()
    try:
        full[0] = True
        trainer.submit(make_scored(own, "a", [5, 6, 7]))
        wait(lambda: (trainer.error or "").startswith("training waits for disk space"), "wait")
        assert trainer.alive and "train_journal.jsonl" in trainer.error
        full[0] = False
        # the error clears when the step returns, a moment after its line is written
        wait(lambda: "a" in trained_uids(tmp_path) and trainer.error is None, "a trained")
        assert not trainer.journal.failures
        assert not trainer.journal.quarantined and trainer.journal.proven
        ends_refused[0] = True  # b's start is written, its end refused
        trainer.submit(make_scored(own, "b", [6, 7, 8]))
        wait(lambda: "b" in trained_uids(tmp_path), "b trained")
        ends_refused[0] = False  # space again: c's start writes b's end first
        trainer.submit(make_scored(own, "c", [7, 8, 9]))
        wait(lambda: "c" in trained_uids(tmp_path), "c trained")
    finally:
        trainer.stop()
    files = assert_whole_lines(tmp_path)
    lines = [(ln["kind"], ln.get("n")) for ln in files["train_journal.jsonl"]
             if ln["kind"].startswith("step_")]
    b = next(ln["n"] for ln in files["train_journal.jsonl"]
             if ln["kind"] == "step_start" and ln["uids"] == ["b"])
    assert lines.index(("step_end", b)) < lines.index(("step_start", b + 1)), lines
    assert not read_journal(tmp_path).open_steps
    restarted = StepJournal(tmp_path)  # a restart on the same data dir: nothing is charged
    try:
        assert not restarted.failures and not restarted.quarantined, restarted.failures
    finally:
        restarted.close()
    assert not [ln for ln in records.read_jsonl(tmp_path / "train_journal.jsonl")
                if ln.get("died")]
