"""Durable JSONL files under the data directory: append-only, one complete line per write.

Each writer has one writer thread that does all of its file I/O: lines queued while it writes
and fsyncs one batch go out together in the next, with one `os.write` of whole lines (O_APPEND)
and one fsync (group commit). So a killed process never leaves half a line, `tail -f` only ever
sees whole lines, and the event loop never waits on the disk. Three ways to write:

- `write(record)`: returns once the line is on disk (worker threads: trainer, judge).
- `write_nowait(record)`: queues the line and returns at once (the event loop, when nothing
  waits on the line); its future says when the line is on disk, or why it is not.
- `await write_async(record)`: the event loop, when a reply must wait for the line (durable
  before acknowledged).

`flushed()` is a future done once every line queued so far is on disk (`all_written` joins
those of several writers): a reply that acknowledges several lines waits on it.

Lines of one writer reach the file in the order they were queued. The program never truncates or
rewrites a record file. Readers still skip a final line without its newline (power loss can tear
one); nothing else.

The pending-turn journal (`pending_turns.jsonl`) is the one internal file: turns whose response
completed but whose next state is not known yet. It holds "turn" entries and "done" tombstones
and is compacted (rewritten to a temp file + renamed) only at start-up.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Iterator

import orjson

log = logging.getLogger("rlproxy.records")

SCHEMA_VERSION = 1


def dumps_line(record: dict) -> bytes:
    # OPT_NON_STR_KEYS: e.g. logit_bias maps int token ids; JSON keys are strings
    return orjson.dumps({"schema_version": SCHEMA_VERSION, **record},
                        option=orjson.OPT_NON_STR_KEYS) + b"\n"


class JsonlWriter:
    """Appends whole lines to one file; safe to call from any thread."""

    def __init__(self, path: Path, fsync: bool = True):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._torn = self._ends_mid_line()
        self._cond = threading.Condition()
        # (line, ours, the caller's): `ours` is never handed out, so a caller cancelling its
        # future cannot make flushed() report a line written that is not
        self._queue: list[tuple[bytes, Future, Future]] = []
        self._inflight: list[Future] = []  # ours, of the batch being written
        self._closing = False
        self._thread: threading.Thread | None = None  # started by the first line

    def _ends_mid_line(self) -> bool:
        # A line torn by power loss must not glue itself to the next record.
        size = os.fstat(self._fd).st_size
        if not size:
            return False
        with open(self.path, "rb") as f:
            f.seek(size - 1)
            return f.read(1) != b"\n"

    # ---- the three ways in ----

    def write_nowait(self, record: dict) -> Future:
        """Queue one line; the future is done once it is on disk (fsynced unless turned off).
        Serialized here, so a record that cannot be written raises in its caller."""
        line, ours, done = dumps_line(record), Future(), Future()
        with self._cond:
            if self._closing:
                raise RuntimeError(f"{self.path.name}: the writer is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"records-{self.path.name}")
                self._thread.start()
            self._queue.append((line, ours, done))
            self._cond.notify()
        return done

    def flushed(self) -> Future:
        """Done once every line queued so far is on disk; failed if any of them failed."""
        with self._cond:
            unwritten = self._inflight + [ours for _, ours, _ in self._queue]
        return all_written(*unwritten)

    def write(self, record: dict) -> None:
        """Append one line and return once it is on disk. Not from the event loop."""
        self.write_nowait(record).result()

    async def write_async(self, record: dict) -> None:
        """Append one line; returns once it is on disk, without blocking the event loop."""
        await asyncio.wrap_future(self.write_nowait(record))

    def close(self) -> None:
        """Write what is queued, then close the file."""
        with self._cond:
            self._closing = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # ---- the writer thread ----

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                batch, self._queue = self._queue, []
                self._inflight = [ours for _, ours, _ in batch]
            if not batch:
                return  # closing, and everything queued is written
            # a line whose waiter went away (cancelled) is written all the same
            waiting = [done for _, _, done in batch if done.set_running_or_notify_cancel()]
            error = self._commit(b"".join(line for line, _, _ in batch))
            for done in self._inflight + waiting:
                if error is None:
                    done.set_result(None)
                else:
                    done.set_exception(error)
            with self._cond:
                self._inflight = []

    def _commit(self, data: bytes) -> OSError | None:
        """One write of whole lines, then one fsync: the group commit."""
        if self._torn:
            data = b"\n" + data
        view = memoryview(data)
        try:
            while view:  # os.write may write less than asked (rare, for regular files)
                view = view[os.write(self._fd, view):]
            self._torn = False
            if self.fsync:
                os.fsync(self._fd)
        except OSError as e:  # e.g. a full disk: the waiters hear of it; the thread goes on
            if len(view) < len(data):  # part of a line went out: the next batch starts afresh
                self._torn = len(view) > 0
            log.error("writing %s failed: %s", self.path, e)
            return e
        return None


def written() -> Future:
    """A future that is already done: nothing to wait for."""
    done = Future()
    done.set_result(None)
    return done


def all_written(*futures: Future) -> Future:
    """Done once every one of `futures` is; it fails with the first failure among them."""
    out, lock, left = Future(), threading.Lock(), [len(futures)]

    def one_done(f: Future) -> None:
        error = asyncio.CancelledError() if f.cancelled() else f.exception()
        with lock:
            left[0] -= 1
            if out.done():
                return
            if error is not None:
                out.set_exception(error)
            elif left[0] == 0:
                out.set_result(None)

    if not futures:
        out.set_result(None)
    for f in futures:
        f.add_done_callback(one_done)
    return out


def read_jsonl(path: Path) -> Iterator[dict]:
    """Every complete, parseable line; a torn or corrupt line is skipped, never fatal."""
    path = Path(path)
    if not path.exists():
        return
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                return
            try:
                yield orjson.loads(line)
            except orjson.JSONDecodeError:
                continue


def follow_jsonl(path: Path, poll_s: float = 0.5) -> Iterator[dict]:
    """Like `tail -f`: existing lines, then new ones as they are appended."""
    import time

    path = Path(path)
    while not path.exists():
        time.sleep(poll_s)
    with open(path, "rb") as f:
        buffer = b""
        while True:
            chunk = f.readline()
            if not chunk:
                time.sleep(poll_s)
                continue
            buffer += chunk
            if buffer.endswith(b"\n"):
                try:
                    yield orjson.loads(buffer)
                except orjson.JSONDecodeError:
                    pass
                buffer = b""


def load_pending(path: Path) -> list[dict]:
    """Turns journaled as pending and not yet tombstoned, in journal order."""
    pending: dict[str, dict] = {}
    for entry in read_jsonl(path):
        if entry.get("kind") == "turn":
            pending[entry["uid"]] = entry
        elif entry.get("kind") == "done":
            pending.pop(entry["uid"], None)
    return list(pending.values())


def compact_pending(path: Path, live: list[dict]) -> None:
    """Rewrite the journal with only the live entries (start-up only; temp file + rename)."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        for entry in live:
            f.write(orjson.dumps(entry, option=orjson.OPT_NON_STR_KEYS) + b"\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
