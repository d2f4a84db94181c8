"""The record writer on real files: group commit, order, whole lines for `tail -f` readers,
durable before a caller is told, a full disk, and an event loop that never waits on the disk."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import orjson
import pytest

from rlproxy import records
from rlproxy.records import JsonlWriter, all_written, follow_jsonl, read_jsonl, written


@pytest.fixture
def fsyncs(monkeypatch):
    """Counts fsyncs (the real one still runs); `delay_s` makes each one slower."""
    real, spy = os.fsync, {"n": 0, "delay_s": 0.0}

    def counting(fd):
        time.sleep(spy["delay_s"])
        real(fd)
        spy["n"] += 1

    monkeypatch.setattr(os, "fsync", counting)
    return spy


def lines(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert data.endswith(b"\n")
    return [orjson.loads(line) for line in data.splitlines()]


def test_concurrent_async_writes_share_fsyncs(tmp_path, fsyncs):
    fsyncs["delay_s"] = 0.005  # a disk about as slow as this machine's ext4
    writer = JsonlWriter(tmp_path / "a.jsonl")

    async def many():
        await asyncio.gather(*[writer.write_async({"i": i, "pad": "x" * 500})
                               for i in range(300)])

    asyncio.run(many())
    got = lines(tmp_path / "a.jsonl")
    assert [r["i"] for r in got] == list(range(300))  # whole lines, in the order queued
    assert all(r["schema_version"] == 1 for r in got)
    assert fsyncs["n"] <= 30, f"{fsyncs['n']} fsyncs for 300 lines: no group commit"
    writer.close()


def test_write_async_returns_after_fsync_and_never_blocks_the_loop(tmp_path, fsyncs):
    fsyncs["delay_s"] = 0.2
    writer = JsonlWriter(tmp_path / "a.jsonl")
    gaps = []

    async def ticker(stop: asyncio.Event):
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async def run():
        stop = asyncio.Event()
        tick = asyncio.create_task(ticker(stop))
        for i in range(3):
            before = fsyncs["n"]
            await writer.write_async({"i": i})
            assert fsyncs["n"] > before  # told only once its fsync returned
        writer.write_nowait({"i": 3})  # returns at once
        stop.set()
        await tick

    tic = time.perf_counter()
    asyncio.run(run())
    assert time.perf_counter() - tic >= 0.6  # three fsyncs of 0.2 s were waited for ...
    # ... but never on the loop: it ticked all along (blocked, it would tick once per fsync;
    # counted, not timed, as a loaded machine delays every tick)
    assert len(gaps) >= 30, f"{len(gaps)} ticks in 0.6 s, the longest gap {max(gaps):.3f} s"
    writer.close()  # writes what was queued
    assert [r["i"] for r in lines(tmp_path / "a.jsonl")] == [0, 1, 2, 3]


def test_sync_writes_from_many_threads(tmp_path):
    writer = JsonlWriter(tmp_path / "a.jsonl", fsync=False)

    def work(t):
        for i in range(100):
            writer.write({"t": t, "i": i})

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    got = lines(tmp_path / "a.jsonl")
    assert len(got) == 800
    for t in range(8):  # each thread's lines in its own order
        assert [r["i"] for r in got if r["t"] == t] == list(range(100))
    writer.close()


def test_tail_f_reader_sees_whole_lines_only(tmp_path):
    path = tmp_path / "a.jsonl"
    writer = JsonlWriter(path, fsync=False)
    seen = []

    def follow():
        for record in follow_jsonl(path, poll_s=0.001):
            seen.append(record)
            if len(seen) == 200:
                return

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    for i in range(200):  # big lines, so a reader often catches one half written
        writer.write_nowait({"i": i, "ids": list(range(i * 100, i * 100 + 20_000))})
    writer.close()
    reader.join(timeout=60)
    assert [r["i"] for r in seen] == list(range(200))
    assert all(r["ids"][0] == r["i"] * 100 and len(r["ids"]) == 20_000 for r in seen)


def test_a_torn_last_line_never_glues_to_the_next(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"i": 0}\n{"i": 1, "torn')  # power loss in the middle of a line
    writer = JsonlWriter(path)
    writer.write({"i": 2})
    writer.close()
    assert [r["i"] for r in read_jsonl(path)] == [0, 2]
    # moved aside before the first append, not left in the middle of the file
    assert path.read_bytes().startswith(b'{"i": 0}\n{"schema_version"') and \
        b"torn" not in path.read_bytes()
    (torn,) = tmp_path.glob("a.jsonl.torn-*")
    assert torn.read_bytes() == b'{"i": 1, "torn'


def test_a_file_that_is_one_torn_line_is_emptied_first(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"i": 1, "to')
    writer = JsonlWriter(path)
    writer.write({"i": 2})
    writer.close()
    assert [r["i"] for r in read_jsonl(path)] == [2] and b"to" not in path.read_bytes()
    assert next(tmp_path.glob("a.jsonl.torn-*")).read_bytes() == b'{"i": 1, "to'


def test_a_full_disk_is_reported_and_the_writer_goes_on(tmp_path, monkeypatch):
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full (Linux)")
    # the failing-files book is process-wide: /dev/full (never any space) must not stay in it
    # for the tests that run after this one in the same worker
    monkeypatch.setattr(records, "_failing", {})
    monkeypatch.setattr(records, "_worked", {})
    writer = JsonlWriter(Path("/dev/full"))
    with pytest.raises(OSError):
        writer.write({"i": 0})
    future = writer.write_nowait({"i": 1})
    assert isinstance(future.exception(timeout=10), OSError)
    with pytest.raises(OSError):  # the thread survived and still answers
        writer.write({"i": 2})
    writer.close()


def test_close_writes_what_is_queued_then_refuses(tmp_path):
    writer = JsonlWriter(tmp_path / "a.jsonl")
    futures = [writer.write_nowait({"i": i}) for i in range(100)]
    writer.close()
    assert all(f.done() and f.exception() is None for f in futures)
    assert len(lines(tmp_path / "a.jsonl")) == 100
    with pytest.raises(RuntimeError):
        writer.write_nowait({"i": 100})


def test_flushed_covers_every_line_queued_before_it(tmp_path, fsyncs):
    fsyncs["delay_s"] = 0.05
    a, b = JsonlWriter(tmp_path / "a.jsonl"), JsonlWriter(tmp_path / "b.jsonl")
    assert a.flushed().done()  # nothing queued
    for i in range(20):
        a.write_nowait({"i": i})
        b.write_nowait({"i": i})
    both = all_written(a.flushed(), b.flushed())
    assert not both.done()
    both.result(timeout=30)
    assert len(lines(tmp_path / "a.jsonl")) == len(lines(tmp_path / "b.jsonl")) == 20
    assert all_written().done() and written().done()
    a.close()
    b.close()
