"""Durability: SIGKILL the real server during multi-session traffic, restart it on the same data
directory, and check that no record line is torn and no acknowledged turn is lost.

A turn counts as acknowledged when its client received the whole response (the JSON body, or the
stream up to `data: [DONE]`). Each such turn must end up in conversations.jsonl exactly once:
written before the kill, or pending in the journal, reloaded on restart, and linked to the next
state that the session's first request after the restart adds. A request that was in flight at
the kill may or may not have been journaled; nothing is required of it.

The server runs as a real subprocess (`python -m rlproxy.cli serve`) so that SIGKILL hits it
exactly as it would in production. A second test aims the kill at the narrowest window, between a
turn's record line and its journal tombstone, which random kills hit only now and then. The last
ones slow every fsync down (in-process server) to show a reply waits for its journal line while
the event loop does not.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from rlproxy.ops.served import free_port, server_env, wait_healthy
from rlproxy.records import TurnLines

SESSIONS = 6  # the even ones pause ("a long tool call") after a few turns; the odd ones don't
KILL_AFTER = 20  # acknowledged turns, over all sessions, before the SIGKILL
MAX_TOKENS = 8
REPO = Path(__file__).resolve().parents[1]
SERVE = ["-m", "rlproxy.cli"]
# `rlproxy serve`, killed by SIGKILL right after a turn's record line is on disk (the tombstone
# is queued only then) and before its "done" tombstone reaches the pending-turn journal.
SERVE_DYING_BEFORE_TOMBSTONE = ["-c", """
import os, signal, sys
from rlproxy import records
write_nowait = records.JsonlWriter.write_nowait
def write_or_die(self, record):
    if record.get("kind") == "done":
        os.kill(os.getpid(), signal.SIGKILL)
    return write_nowait(self, record)
records.JsonlWriter.write_nowait = write_or_die
from rlproxy.cli import main
sys.exit(main())
"""]


@dataclass
class Acked:
    """A response its client received in full."""
    session: str
    k: int  # the session's k-th request (0-based)
    messages: list[dict]
    text: str
    uid: str | None  # X-Turn-Uid; None when streamed (headers go out before the turn exists)


def start_server(data_dir: Path, log_path: Path,
                 python_args: list[str] = SERVE) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = server_env()
    log = open(log_path, "ab")
    proc = subprocess.Popen(
        [sys.executable, *python_args, "serve", "--model", "tiny", "--port", str(port),
         "--data-dir", str(data_dir), "--log-level", "WARNING"],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, log_path)
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


def user_message(sid: str, k: int, note: str = "") -> dict:
    return {"role": "user", "content": f"{sid}: question {k}{note}. Answer briefly."}


def chat(url: str, sid: str, messages: list[dict], stream: bool) -> tuple[str, str | None]:
    """(text, X-Turn-Uid) of a response received in full; raises if it was not."""
    body = {"model": "m", "messages": messages, "max_tokens": MAX_TOKENS, "stream": stream}
    r = requests.post(url + "/v1/chat/completions", json=body, headers={"X-Session-Id": sid},
                      timeout=60, stream=stream)
    if r.status_code != 200:
        raise AssertionError(f"{sid}: HTTP {r.status_code}: {r.text}")
    assert r.headers["X-Session-Id"] == sid
    if not stream:
        return r.json()["choices"][0]["message"]["content"], r.headers["X-Turn-Uid"]
    text = ""
    for line in r.iter_lines():
        if not line:
            continue
        assert line.startswith(b"data: "), line
        if line == b"data: [DONE]":
            return text, None
        chunk = json.loads(line[len(b"data: "):])
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            text += choice["delta"].get("content") or ""
    raise requests.ConnectionError(f"{sid}: stream ended without [DONE]")


def pauses_after(n: int) -> int | None:
    """Turns session n takes before it pauses until the kill, its last turn left pending.
    Without pauses, a kill almost never finds a turn pending: each session's next request
    follows its response within a millisecond."""
    return 3 + n // 2 if n % 2 == 0 else None


def converse(url: str, sid: str, n: int, acked: list[Acked], lock: threading.Lock,
             failures: list[str], paused: set[str], killed: threading.Event) -> None:
    """One agent: turns until the server dies, each request continuing the last reply."""
    messages, k = [user_message(sid, 0)], 0
    while True:
        if k == pauses_after(n):
            with lock:
                paused.add(sid)
            killed.wait()
            return
        stream = (k + n) % 2 == 1  # every session mixes streamed and plain responses
        try:
            text, uid = chat(url, sid, messages, stream)
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError,
                requests.Timeout):
            return  # the kill
        except Exception as e:  # an error before the kill is a bug: surface it
            failures.append(f"{sid} request {k}: {e!r}")
            return
        with lock:
            acked.append(Acked(sid, k, messages, text, uid))
        messages = messages + [{"role": "assistant", "content": text}, user_message(sid, k + 1)]
        k += 1


def read_lines(path: Path) -> list[dict]:
    """Every line of a record file; each must be complete and parse."""
    data = path.read_bytes()
    assert data == b"" or data.endswith(b"\n"), f"{path.name}: last line is torn: {data[-200:]!r}"
    out = []
    for i, line in enumerate(data.splitlines()):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise AssertionError(f"{path.name} line {i + 1} does not parse ({e}): {line[:200]!r}")
    if path.name in ("conversations.jsonl", "pending_turns.jsonl"):  # whole, as readers see them
        turns = TurnLines(path.with_name("conversations.jsonl"))
        out = [turns.full(r) if r.get("kind") == "turn" else r for r in out]
        assert None not in out, f"{path.name}: a line names a turn that cannot be read"
    return out


def live_pending(journal: list[dict]) -> dict[str, dict]:
    live: dict[str, dict] = {}
    for entry in journal:
        if entry["kind"] == "turn":
            live[entry["uid"]] = entry
        elif entry["kind"] == "done":
            live.pop(entry["uid"], None)
    return live


def test_sigkill_during_traffic_loses_no_acknowledged_turn(tmp_path):
    data, log = tmp_path / "data", tmp_path / "server.log"
    conversations, journal = data / "conversations.jsonl", data / "pending_turns.jsonl"
    sids = [f"dur-{i}" for i in range(SESSIONS)]
    acked: list[Acked] = []
    failures: list[str] = []
    lock = threading.Lock()
    procs = []
    try:
        # ---- traffic, then SIGKILL while requests are in flight ----
        proc, url = start_server(data, log)
        procs.append(proc)
        paused: set[str] = set()
        killed = threading.Event()
        threads = [threading.Thread(target=converse, daemon=True,
                                    args=(url, sid, n, acked, lock, failures, paused, killed))
                   for n, sid in enumerate(sids)]
        for t in threads:
            t.start()
        pausing = {sid for n, sid in enumerate(sids) if pauses_after(n) is not None}
        deadline = time.monotonic() + 60
        while ((len(acked) < KILL_AFTER or paused != pausing) and not failures
               and time.monotonic() < deadline):
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        killed.set()
        for t in threads:
            t.join(timeout=60)
        assert not failures, failures
        assert len(acked) >= KILL_AFTER and paused == pausing, \
            f"too slow: {len(acked)} turns in 60 s, paused: {sorted(paused)}"
        assert not any(t.is_alive() for t in threads)

        # ---- every line of both files parses, the last one included ----
        before = read_lines(conversations)
        written_before = {r["uid"] for r in before}
        # pending = journaled, not tombstoned and not yet recorded (a kill between the record
        # line and its tombstone leaves a turn in both files: the record wins)
        pending_before = {u: e for u, e in live_pending(read_lines(journal)).items()
                          if u not in written_before}
        last = {}  # session -> its last acknowledged turn
        for a in acked:
            last[a.session] = a
        assert set(last) == set(sids), "a session completed no turn before the kill"
        pending_at = {(e["session_id"], e["index"]) for e in pending_before.values()}
        assert all((sid, last[sid].k) in pending_at for sid in pausing), pending_at

        # ---- restart on the same data directory; each session continues its last reply ----
        proc, url = start_server(data, log)
        procs.append(proc)
        after_uids = {}
        for sid, a in last.items():
            if (sid, a.k) in pending_at:  # reloaded: open again, its turn still pending
                s = requests.get(f"{url}/v1/sessions/{sid}", timeout=10).json()
                assert s["open"], s
                pending = [t for t in s["turn_list"] if t["index"] == a.k]
                assert len(pending) == 1 and pending[0]["next_state"] is None, s
            messages = a.messages + [{"role": "assistant", "content": a.text},
                                     user_message(sid, a.k + 1, " after the restart")]
            _, after_uids[sid] = chat(url, sid, messages, stream=False)
        for sid in sids:
            r = requests.post(f"{url}/v1/sessions/{sid}/end", timeout=10)
            assert r.status_code == 200, r.text
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)  # its exit status is not this test's business

        # ---- every acknowledged turn is recorded exactly once, with its next state ----
        records = read_lines(conversations)
        assert all(r["kind"] == "turn" and r["schema_version"] == 1 for r in records)
        dupes = {uid for uid, n in Counter(r["uid"] for r in records).items() if n > 1}
        assert not dupes, "turns recorded more than once: " + "; ".join(
            f"{uid} (written before the kill: {uid in written_before}, pending at the kill: "
            f"{uid in pending_before}) as " + str([(r["session_id"], r["index"], r["next_state"],
                                                   r["end"]) for r in records if r["uid"] == uid])
            for uid in dupes)
        by_uid = {r["uid"]: r for r in records}
        after = set(after_uids.values())
        for a in acked:
            if a.uid is not None:
                assert a.uid in by_uid, f"acknowledged turn {a} was lost"
                r = by_uid[a.uid]
            else:  # streamed: find it by session and index among the pre-restart turns
                found = [r for r in records if r["session_id"] == a.session
                         and r["index"] == a.k and r["uid"] not in after]
                assert len(found) == 1, f"acknowledged streamed turn {a}: {found}"
                r = found[0]
            assert (r["session_id"], r["index"]) == (a.session, a.k)
            assert r["messages"] == a.messages
            assert r["choices"][0]["text"] == a.text

            if a is not last[a.session]:  # its session's next request came before the kill
                assert r["uid"] in written_before
                assert r["next_state"] == [user_message(a.session, a.k + 1)], r["next_state"]
                assert r["end"] is None
            elif r["uid"] in written_before:  # the next request was in flight at the kill
                assert r["uid"] not in pending_before
                assert r["next_state"] == [user_message(a.session, a.k + 1)], r["next_state"]
                assert r["end"] is None
            else:  # pending at the kill: linked by the first request after the restart
                assert r["uid"] in pending_before, f"turn {a} neither written nor journaled"
                assert r["next_state"] == [user_message(a.session, a.k + 1,
                                                        " after the restart")], r["next_state"]
                assert r["next_state_link"] == "prefix" and r["end"] is None

        for sid, uid in after_uids.items():  # the last turn of each session: ended, no next
            assert by_uid[uid]["next_state"] is None and by_uid[uid]["end"] == "ended"
        assert live_pending(read_lines(journal)) == {}  # every session ended: nothing pending
    finally:
        for p in procs:
            stop(p)


def test_kill_between_record_line_and_tombstone_records_the_turn_once(tmp_path):
    data, log = tmp_path / "data", tmp_path / "server.log"
    sid, procs = "crash", []
    try:
        proc, url = start_server(data, log, SERVE_DYING_BEFORE_TOMBSTONE)
        procs.append(proc)
        first = [user_message(sid, 0)]
        text, uid = chat(url, sid, first, stream=False)
        reply = {"role": "assistant", "content": text}
        with pytest.raises((requests.ConnectionError, requests.exceptions.ChunkedEncodingError)):
            chat(url, sid, first + [reply, user_message(sid, 1)], stream=False)  # links `uid`
        assert proc.wait(timeout=30) == -signal.SIGKILL

        proc, url = start_server(data, log)
        procs.append(proc)
        chat(url, sid, first + [reply, user_message(sid, 1, " after the restart")], stream=False)
        assert requests.post(f"{url}/v1/sessions/{sid}/end", timeout=10).status_code == 200
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)

        # The line written before the kill stands (records are never rewritten); no second one.
        records = [r for r in read_lines(data / "conversations.jsonl") if r["uid"] == uid]
        assert [r["next_state"] for r in records] == [[user_message(sid, 1)]]
    finally:
        for p in procs:
            stop(p)


# ---- durable before acknowledged, without the event loop waiting on the disk ----

@pytest.fixture(scope="module")
def inproc(tiny, tmp_path_factory):
    from conftest import ServerThread, make_settings

    with ServerThread(make_settings(tmp_path_factory.mktemp("data")), tiny) as s:
        yield s


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "plain"])
def test_reply_waits_for_its_journal_line_but_the_loop_does_not(inproc, monkeypatch, stream):
    """With a slow disk (1 s per fsync), a reply's last bytes come only after its turn's
    journal line was fsynced, and /healthz answers meanwhile (the fsync runs on the writer
    thread)."""
    real, durable_at = os.fsync, {}
    sid = f"slow-disk-{stream}"
    journal = Path(inproc.settings.records.data_dir) / "pending_turns.jsonl"

    def slow_fsync(fd):
        time.sleep(1.0)
        real(fd)
        if sid.encode() in journal.read_bytes():
            durable_at.setdefault(sid, time.monotonic())

    monkeypatch.setattr(os, "fsync", slow_fsync)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "stream": stream}
    answered, health = {}, []

    def ask():
        r = requests.post(inproc.base_url + "/chat/completions", json=body, timeout=60,
                          headers={"X-Session-Id": sid}, stream=stream)
        content = r.content  # all of it: the stream up to [DONE], or the whole body
        answered["at"] = time.monotonic()
        answered["ok"] = r.status_code == 200 and (not stream or b"data: [DONE]" in content)

    client = threading.Thread(target=ask)
    client.start()
    while client.is_alive():
        requests.get(inproc.url + "/healthz", timeout=30)
        health.append(time.monotonic())  # when it was answered
        time.sleep(0.02)
    client.join()
    assert answered["ok"]
    assert sid in durable_at and durable_at[sid] <= answered["at"]
    # /healthz answered while the journal line's fsync ran (edges left out); the old way
    # (the fsync on the loop) answered none in that second. Counted, not timed: a loaded
    # machine slows every answer.
    during = [t for t in health if durable_at[sid] - 0.9 < t < durable_at[sid] - 0.1]
    assert len(during) >= 3, f"{len(during)} /healthz answered during a 1 s fsync"
