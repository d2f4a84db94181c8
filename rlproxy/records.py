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

Lines of one writer reach the file in the order they were queued. A write that fails (a full
disk: ENOSPC, EIO) is cut back to the last whole line (`os.ftruncate` to the size before it), so
no torn line is ever left between whole ones; its waiters get a `WriteFailed` naming the file,
and `failing()` lists the files whose last write failed until one succeeds again (/healthz,
/metrics). Apart from that the program never truncates or rewrites a record file. Readers skip a
final line without its newline (power loss can tear one; start-up readers warn of it, live ones
may see a line being appended) and a line that does not parse or is not a JSON object, each with
one WARNING naming the file and the byte offset; nothing else. `set_aside` renames a file or
folder that cannot be read at start to `<name>.corrupt-<time>` (never deleted), with one WARNING.

A writer made with `index=` (conversations.jsonl's) also appends, after each batch is on disk,
a short entry per line to `<name>.index` beside it: the fields start-up needs of a turn line
(`INDEX_FIELDS`), its byte offset and length. The index is derived and never fsynced; the JSONL
stays the truth. `IndexedFile` reads a file through it (start-up: a long history's prompts and
log-probs are most of its bytes, and recovery wants a few of its lines whole), checking it
against the file and reading past its end, and brings it up to date.

The pending-turn journal (`pending_turns.jsonl`) is the one internal file: turns whose response
completed but whose next state is not known yet. It holds "turn" entries and "done" tombstones
and is compacted (rewritten to a temp file + renamed) only at start-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Container, Iterator

import orjson

from rlproxy.lru import LRU

log = logging.getLogger("rlproxy.records")

SCHEMA_VERSION = 1
DISK_FULL = (errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EFBIG)
# The one fault-injection seam (tests only): tests/test_hostile_disk.py replaces it with a write
# that raises OSError(ENOSPC) where it cannot mount a small tmpfs.
os_write = os.write


# what `IndexedFile.lines` yields of an indexed turn line: the fields start-up recovery reads of
# every line (recovery.py: TurnLines.note, StoreStart.recorded, ScorerReplay.wants), with the
# line's byte offset and length (AT, LENGTH) to read it whole (`IndexedFile.whole`)
INDEX_FIELDS = ("uid", "session_id", "index", "turn_type", "trainable", "extends")
AT, LENGTH = "line_at", "line_bytes"


def index_path(path: Path) -> Path:
    return Path(path).with_name(Path(path).name + ".index")


def index_entry(record: dict) -> dict:
    return {k: record[k] for k in INDEX_FIELDS if k in record}


class WriteFailed(OSError):
    """Lines that could not be written; nothing of them is left in the file. `disk_full`: the
    cause is space (ENOSPC, EIO, quota), not a bug: the API answers 507."""

    def __init__(self, path: Path, cause: OSError):
        self.path, self.cause = Path(path), cause
        self.disk_full = cause.errno in DISK_FULL
        what = "the disk is full or failing" if self.disk_full else "writing failed"
        super().__init__(cause.errno, f"{what}: could not write {self.path} "
                         f"({cause.strerror or cause}); nothing of it was kept")


# path -> {"path", "error", "since", "errors"} of the files whose last write failed: process-wide
# like the metrics (one server per process); /healthz and /metrics read it (`failing`).
_failing: dict[str, dict] = {}
_errors_total: dict[str, int] = {}  # path -> failed writes since start, for /metrics
_worked: dict[int, float] = {}  # device -> when a write on it last worked (while any failed)
_failing_lock = threading.Lock()
FREE_AGAIN_BYTES = 2**20  # a file that ran out of space is fine again once this much is free


def failing() -> list[dict]:
    """The record files whose last write failed, oldest failure first. One that ran out of
    space counts as fine again once its disk has FREE_AGAIN_BYTES free and a write to another
    file on it has worked since (a rarely written file need not wait for its own next line)."""
    with _failing_lock:
        for key, e in list(_failing.items()):
            if e["space"] and _worked.get(e["dev"], 0) > e["last"] and _free(key) >= \
                    FREE_AGAIN_BYTES:
                del _failing[key]
        if not _failing:
            _worked.clear()
        return sorted(({k: v for k, v in e.items() if k not in ("dev", "space", "last")}
                       for e in _failing.values()), key=lambda e: e["since"])


def _free(path: str) -> int:
    try:
        st = os.statvfs(os.path.dirname(path))
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def write_errors() -> dict[str, int]:
    """Failed writes per file since start (/metrics: rlproxy_disk_write_errors_total)."""
    with _failing_lock:
        return dict(_errors_total)


def _note(path: Path, fd: int, error: OSError | None) -> None:
    """Book one write's outcome (the writer thread, after each batch)."""
    if error is None and not _failing:  # the usual case: nothing to clear, no fstat
        return
    key, now = str(path), time.time()
    try:
        dev = os.fstat(fd).st_dev
    except OSError:
        dev = -1
    with _failing_lock:
        if error is None:
            _worked[dev] = now
            if _failing.pop(key, None) is not None:
                log.warning("writing %s works again", path)
            return
        _errors_total[key] = _errors_total.get(key, 0) + 1
        entry = _failing.setdefault(key, {"path": key, "since": now, "errors": 0, "dev": dev})
        entry["errors"] += 1
        entry["error"] = error.strerror or str(error)
        entry["space"] = error.errno in (errno.ENOSPC, errno.EDQUOT)
        entry["last"] = now


def dumps_line(record: dict) -> bytes:
    # OPT_NON_STR_KEYS: e.g. logit_bias maps int token ids; JSON keys are strings
    return orjson.dumps({"schema_version": SCHEMA_VERSION, **record},
                        option=orjson.OPT_NON_STR_KEYS) + b"\n"


class JsonlWriter:
    """Appends whole lines to one file; safe to call from any thread."""

    def __init__(self, path: Path, fsync: bool = True, stamp: dict | None = None,
                 index: bool = False):
        self.path = Path(path)
        self.stamp = stamp or {}  # fields every line carries (e.g. the trainer's backend)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        # INDEX: the `<name>.index` entries of each line written (-1: none, or given up)
        self._index_fd = -1
        if index:
            try:
                self._index_fd = os.open(index_path(self.path),
                                         os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            except OSError as e:  # derived: the next start-up reads the lines it lacks
                log.warning("%s: its index cannot be opened (%s); lines are written without "
                            "it", self.path, e)
        self._torn = False  # the file ends mid-line: the next batch starts on a new line
        try:
            self._set_aside_torn_tail()
        except OSError as e:  # no room for the copy: the torn line stays, ended, as before
            log.error("could not move %s's cut last line aside (%s); it stays, ended by a "
                      "newline, and readers skip it", self.path, e)
            self._torn = True
        self._cond = threading.Condition()
        # (line, ours, the caller's, its index entry): `ours` is never handed out, so a caller
        # cancelling its future cannot make flushed() report a line written that is not
        self._queue: list[tuple[bytes, Future, Future, dict | None]] = []
        self._inflight: list[Future] = []  # ours, of the batch being written
        self._closing = False
        self._thread: threading.Thread | None = None  # started by the first line

    def _set_aside_torn_tail(self) -> None:
        """A last line without its newline (power loss, a full disk while another program
        wrote) is moved out before the first append, so it never stays in the middle of the
        file: its bytes go to `<name>.torn-<time>` beside it (fsynced), then the file is cut
        back to its last whole line, with one WARNING. No line of ours is ever acknowledged
        before its newline is on disk, so nothing acknowledged is in it."""
        size = os.fstat(self._fd).st_size
        if not size:
            return
        with open(self.path, "rb") as f:
            back = min(size, 1 << 16)
            f.seek(size - back)
            tail = f.read(back)
            while b"\n" not in tail and back < size:  # a torn line longer than 64 KiB
                back = min(size, back * 4)
                f.seek(size - back)
                tail = f.read(back)
        if tail.endswith(b"\n"):
            return
        keep = size - back + tail.rfind(b"\n") + 1  # 0 when the file is one torn line
        torn = self.path.with_name(f"{self.path.name}.torn-{time.strftime('%Y%m%d-%H%M%S')}")
        with open(torn, "ab") as out:
            with open(self.path, "rb") as f:
                f.seek(keep)
                out.write(f.read())
            out.flush()
            os.fsync(out.fileno())
        os.ftruncate(self._fd, keep)
        if self.fsync:
            os.fsync(self._fd)
        log.warning("%s: its last line was cut short (%d bytes without a newline: a write a "
                    "crash or a full disk cut); moved to %s before appending", self.path,
                    size - keep, torn.name)

    # ---- the three ways in ----

    def write_nowait(self, record: dict) -> Future:
        """Queue one line; the future is done once it is on disk (fsynced unless turned off),
        with the byte offset its line starts at (what a line that extends it names).
        Serialized here, so a record that cannot be written raises in its caller."""
        line, ours, done = dumps_line({**record, **self.stamp}), Future(), Future()
        entry = index_entry(record) if self._index_fd >= 0 else None
        with self._cond:
            if self._closing:
                raise RuntimeError(f"{self.path.name}: the writer is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"records-{self.path.name}")
                self._thread.start()
            self._queue.append((line, ours, done, entry))
            self._cond.notify()
        return done

    def flushed(self) -> Future:
        """Done once every line queued so far is on disk; failed if any of them failed."""
        with self._cond:
            unwritten = self._inflight + [ours for _, ours, _, _ in self._queue]
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
        if self._index_fd >= 0:
            os.close(self._index_fd)
            self._index_fd = -1

    # ---- the writer thread ----

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                batch, self._queue = self._queue, []
                self._inflight = [ours for _, ours, _, _ in batch]
            if not batch:
                return  # closing, and everything queued is written
            # a line whose waiter went away (cancelled) is written all the same
            running = [done.set_running_or_notify_cancel() for _, _, done, _ in batch]
            error, at = self._commit(b"".join(line for line, _, _, _ in batch))
            if error is None and self._index_fd >= 0:  # before the waiters hear of it
                self._index(at, batch)
            for (line, ours, done, _), waits in zip(batch, running):
                for future in (ours, done) if waits else (ours,):
                    if error is None:
                        future.set_result(at)  # the byte offset where its line starts
                    else:
                        future.set_exception(error)
                at += len(line)
            with self._cond:
                self._inflight = []

    def _index(self, at: int, batch: list) -> None:
        """Append the index entries of BATCH, whose first line starts at byte AT (not fsynced:
        start-up checks the index against the file and reads what it lacks). A write that
        fails stops the index for this run, as a gap would make every entry after it useless;
        the next start-up brings it up to date."""
        entries = []
        for line, _, _, entry in batch:
            if entry is not None:
                entries.append(orjson.dumps({**entry, AT: at, LENGTH: len(line)}) + b"\n")
            at += len(line)
        try:
            view = memoryview(b"".join(entries))
            while view:
                view = view[os_write(self._index_fd, view):]
        except OSError as e:
            log.warning("%s: writing its index failed (%s); start-up reads the lines it lacks "
                        "and brings it up to date", self.path, e)
            fd, self._index_fd = self._index_fd, -1
            with contextlib.suppress(OSError):
                os.close(fd)

    def _commit(self, data: bytes) -> tuple[OSError | None, int]:
        """One write of whole lines, then one fsync: the group commit; (None, the byte offset
        its first line starts at). On a failure (a full disk) the file is cut back to its size
        before, so no part of the batch stays: (the error, -1)."""
        ended = self._torn
        if ended:
            data = b"\n" + data
        view = memoryview(data)
        before = -1
        try:
            before = os.fstat(self._fd).st_size  # O_APPEND: the batch starts here
            while view:  # os.write may write less than asked (a disk filling up)
                view = view[os_write(self._fd, view):]
            if self.fsync:
                os.fsync(self._fd)
        except OSError as e:  # the waiters hear of it; the thread goes on
            self._cut_back(before)
            log.error("writing %s failed: %s", self.path, e)
            _note(self.path, self._fd, e)
            return WriteFailed(self.path, e), -1
        self._torn = False
        _note(self.path, self._fd, None)
        return None, before + ended

    def _cut_back(self, size: int) -> None:
        """Truncate to SIZE (the last whole line) after a failed write; if even that fails,
        the next batch starts on a new line so that the torn one stays apart."""
        try:
            if size < 0:
                raise OSError("the file's size before the write is unknown")
            os.ftruncate(self._fd, size)
        except OSError as e:
            log.error("could not cut %s back to its last whole line (%s); the torn line "
                      "stays, and readers skip it", self.path, e)
            self._torn = True


def set_aside(path: Path, why: str) -> Path:
    """Rename PATH (a file or folder rlproxy could not read at start) to
    `<name>.corrupt-<time>` beside it, never deleting it, with one WARNING naming it; the new
    path."""
    path = Path(path)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
    os.replace(path, target)
    log.warning("%s cannot be read (%s); set aside as %s", path, why, target.name)
    return target


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


_warned = LRU(max_items=1024)  # (path, offset) of bad lines warned of: each once, bounded


def read_jsonl(path: Path, report_cut: bool = False) -> Iterator[dict]:
    """Every complete line that is a JSON object; a torn or corrupt line, or JSON that is not
    an object, is skipped, never fatal, with one WARNING naming the file, the line and its byte
    offset. REPORT_CUT: warn of a last line without its newline too (start-up readers: a write a
    crash or a full disk cut); a live reader (a file still written) sees one being appended."""
    for _, record in numbered_jsonl(path, report_cut):
        yield record


def numbered_jsonl(path: Path, report_cut: bool = False) -> Iterator[tuple[int, dict]]:
    """`read_jsonl` with each object's line number, for readers that warn of a line in turn."""
    for number, _, _, record in _lines(Path(path), report_cut):
        yield number, record


def _lines(path: Path, report_cut: bool, start: int = 0, number: int = 1,
           opened=None) -> Iterator[tuple[int, int, int, dict]]:
    """(line number, byte offset, length, object) of each line of PATH from byte START (line
    NUMBER), as `numbered_jsonl` reads them (from OPENED, PATH opened already, if given)."""
    if opened is None and not path.exists():
        return
    offset = start
    with contextlib.nullcontext(opened) if opened is not None else open(path, "rb") as f:
        f.seek(start)
        for number, line in enumerate(f, number):
            at, offset = offset, offset + len(line)
            if not line.endswith(b"\n"):
                if report_cut:
                    _warn_once(path, at, line, f"its last line ({number}) is cut short "
                               f"({len(line)} bytes without a newline: a write a crash or a "
                               "full disk cut)")
                return
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                if line.strip():
                    _warn_once(path, at, line, f"line {number} is not JSON ({e})")
                continue
            if isinstance(record, dict):
                yield number, at, len(line), record
            else:
                _warn_once(path, at, line, f"line {number} is not a JSON object")


def indexed_lines(path: Path) -> Iterator[tuple[int, dict]]:
    """`IndexedFile(path).lines()`, for a reader that needs no line whole."""
    with IndexedFile(path) as f:
        yield from f.lines()


class IndexedFile:
    """A file read through its index (conversations.jsonl's), opened once: `lines()` yields
    (line number, line) of each of its lines as `numbered_jsonl(path, report_cut=True)` does,
    but an indexed line comes as its index entry (INDEX_FIELDS as far as the line has them,
    AT, LENGTH), which `whole(entry)` reads whole; a line past the index's end comes as read.
    The index is trusted as far as its entries are whole and tile the file from its first byte
    (each starts where the one before ends), and only if the last of those names the line the
    file holds there; once the lines are all read, the index is cut to what was trusted and the
    entries of the lines read are appended (up to a line that is not a JSON object: lines past
    one are read whole at every start)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._f = open(self.path, "rb") if self.path.exists() else None
        self.damaged = False  # an entry named another line (`whole`)

    def __enter__(self) -> IndexedFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def whole(self, entry: dict) -> dict | None:
        """The line an index ENTRY stands for, read whole (without moving the file's position).
        An entry that does not name the line there (an index damaged in its middle) is looked
        for through the file, and the index is dropped once the lines are read (the next start
        writes it again); None if the file has no line with its uid."""
        line = self._at(entry)
        if line is None:
            self.damaged = True
            log.warning("%s: its index names line %s at byte %s, which holds another; the line "
                        "is looked for, and the index written again at the next start",
                        self.path, entry.get("uid"), entry.get(AT))
            line = next((ln for _, _, _, ln in _lines(self.path, False)
                         if ln.get("uid") == entry.get("uid")), None)
        return line

    def _at(self, entry: dict) -> dict | None:
        try:
            raw = os.pread(self._f.fileno(), entry[LENGTH], entry[AT])
            line = orjson.loads(raw) if raw.endswith(b"\n") else None
        except (OSError, AttributeError, orjson.JSONDecodeError, KeyError, TypeError,
                ValueError):
            return None
        return line if isinstance(line, dict) and line.get("uid") == entry.get("uid") else None

    def lines(self) -> Iterator[tuple[int, dict]]:
        ipath = index_path(self.path)
        if self._f is None:  # no file: an index left of it names nothing
            with contextlib.suppress(OSError):
                ipath.unlink()
            return
        size = os.fstat(self._f.fileno()).st_size
        count, covered, kept, last = _trusted(ipath, size)
        if last is not None and self._at(last) is None:  # not this file's index
            count = covered = kept = 0
        number = 0
        if count:
            with open(ipath, "rb") as f:
                for number, raw in zip(range(1, count + 1), f):
                    yield number, orjson.loads(raw)
        entries = []
        for number, at, n, line in _lines(self.path, True, covered, number + 1, self._f):
            if at == covered:
                entries.append(orjson.dumps({**index_entry(line), AT: at, LENGTH: n}) + b"\n")
                covered += n
            yield number, line
        indexed = ipath.stat().st_size if ipath.exists() else 0
        if self.damaged:  # written again, whole, at the next start
            kept, entries = 0, []
        elif kept == indexed and not entries:
            return
        try:
            with open(ipath, "ab") as f:
                f.truncate(kept)
                f.write(b"".join(entries))
        except OSError as e:
            log.warning("%s: could not bring it up to date (%s); the next start reads the lines "
                        "it lacks again", ipath, e)


def _trusted(ipath: Path, size: int) -> tuple[int, int, int, dict | None]:
    """(entries, bytes of the file they cover, bytes of the index they take, the last entry)
    of the index IPATH that tile a file of SIZE bytes from its start."""
    count = covered = kept = 0
    last = None
    try:
        f = open(ipath, "rb")
    except OSError:
        return 0, 0, 0, None
    with f:
        for raw in f:
            try:
                entry = orjson.loads(raw) if raw.endswith(b"\n") else None
                at, n = entry[AT], entry[LENGTH]
            except (orjson.JSONDecodeError, KeyError, TypeError):
                break
            if at != covered or not isinstance(n, int) or n <= 0 or at + n > size:
                break
            count, covered, kept, last = count + 1, covered + n, kept + len(raw), entry
    return count, covered, kept, last


def _warn_once(path: Path, at: int, line: bytes, what: str) -> None:
    key = (str(path.resolve()), at)
    if key not in _warned:
        _warned.add(key)
        log.warning("%s: %s, at byte offset %d; skipped: %r", path, what, at, line[:80])


# ---- turn lines that extend an earlier turn ----
#
# An agent's next prompt is its last prompt plus the reply and the next state, so a turn line
# (conversations.jsonl, pending_turns.jsonl) that continues an earlier turn of its thread keeps
# only what is new: `extends` names that turn (its uid, and the byte offset of its line in
# conversations.jsonl, so a reader that has not seen it lately reads it back), how many prompt ids
# and messages they share, and whether its tools are the same; `prompt_ids_tail` and
# `messages_tail` hold the rest. A line is written this way only once the line it names is on
# disk, and at most MAX_DEPTH lines in a row: then one is written in full, so a reader never
# walks far. Everything else of the turn is in the line as before.

EXTEND_MIN_IDS = 256  # shared prompt ids below which a line is written in full
MAX_DEPTH = 32


def common_prefix(a: list, b: list) -> int:
    """How many leading items A and B share (slices compared in C: linear, not per item)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def extending_line(record: dict, parent: dict, at: int, depth: int) -> dict | None:
    """RECORD (a full turn line) as a line that extends PARENT (the full record of an earlier
    turn: uid, prompt_ids, messages, tools), whose line starts at byte AT of conversations.jsonl
    and is DEPTH lines from a full one; None when it should be written in full (they share under
    EXTEND_MIN_IDS prompt ids, or the chain is MAX_DEPTH long)."""
    if depth >= MAX_DEPTH or at < 0:
        return None
    ids = record["prompt_ids"]
    n = common_prefix(ids, parent["prompt_ids"])
    if n < EXTEND_MIN_IDS:
        return None
    m = common_prefix(record["messages"], parent["messages"])
    line = {k: v for k, v in record.items() if k not in ("prompt_ids", "messages", "tools")}
    same_tools = record.get("tools") == parent.get("tools")
    if not same_tools:
        line["tools"] = record.get("tools")
    line["extends"] = {"uid": parent["uid"], "at": at, "depth": depth + 1, "ids": n,
                       "messages": m, "tools": same_tools}
    line["prompt_ids_tail"] = ids[n:]
    line["messages_tail"] = record["messages"][m:]
    return line


class TurnLines:
    """Full turn records from turn lines in either form (`extending_line`'s or whole), for
    readers of conversations.jsonl and pending_turns.jsonl: `full(line)` rebuilds one exactly
    (the same prompt ids, messages and tools). The turns it saw lately are kept (KEEP of them);
    one further back is read again from CONVERSATIONS by its offset. Read the lines in file
    order where you can: a parent then comes from memory."""

    def __init__(self, conversations: Path, keep: int = 64):
        self.path = Path(conversations)
        self.recent: LRU[str, dict] = LRU(keep)  # uid -> its full record (main turns only)
        self.lines: LRU[str, dict] = LRU(keep)  # uid -> its line as read (`note`)
        self.missing = 0  # lines whose parent could not be read

    def full(self, line: dict) -> dict | None:
        """LINE as a full record (LINE itself when it is whole); None, with a WARNING naming
        both, when the turn it extends cannot be read (the line stays in its file)."""
        return self._full(line, 0)

    def note(self, line: dict, seen: Container[str]) -> bool:
        """LINE read in file order by a reader that needs only its other fields for now (start-up
        recovery: rebuilding every prompt of a long history is most of its time): kept as it is,
        to be rebuilt if a later line needs it (`full` of a line that extends it). False, with
        `full`'s WARNING, when the turn it extends is neither in SEEN (the uids read before it)
        nor readable back."""
        ext = line.get("extends")
        if isinstance(ext, dict) and ext.get("uid") not in seen and (
                self._parent(ext, 0) is None):
            self._report(line, ext)
            return False
        if line.get("turn_type") == "main" and isinstance(line.get("uid"), str) \
                and AT not in line:  # an index entry: its line is read back by its offset
            self.lines.put(line["uid"], line)
        return True

    def _report(self, line: dict, ext: dict) -> None:
        self.missing += 1
        log.warning("%s: turn %.40s extends turn %.40s (at byte %s), which cannot be read; it "
                    "is skipped, and its line kept", self.path, line.get("uid"), ext.get("uid"),
                    ext.get("at"))

    def _full(self, line: dict, hops: int) -> dict | None:
        ext = line.get("extends")
        if ext is None:
            record = line
        else:
            parent = self._parent(ext, hops)
            if parent is None:
                self._report(line, ext)
                return None
            record = {k: v for k, v in line.items()
                      if k not in ("extends", "prompt_ids_tail", "messages_tail")}
            record["prompt_ids"] = parent["prompt_ids"][:ext["ids"]] + line["prompt_ids_tail"]
            record["messages"] = parent["messages"][:ext["messages"]] + line["messages_tail"]
            if ext["tools"]:
                record["tools"] = parent.get("tools")
        if record.get("turn_type") == "main" and isinstance(record.get("uid"), str):
            self.recent.put(record["uid"], record)
        return record

    def _parent(self, ext: dict, hops: int) -> dict | None:
        try:
            uid, at = ext["uid"], int(ext["at"])
        except (KeyError, TypeError, ValueError):
            return None
        found = self.recent.get(uid)
        if found is not None or hops >= MAX_DEPTH:
            return found
        noted = self.lines.peek(uid)
        if noted is not None:
            return self._full(noted, hops + 1)
        try:
            with open(self.path, "rb") as f:
                f.seek(at)
                raw = f.readline()
            line = orjson.loads(raw) if raw.endswith(b"\n") else None
        except (OSError, orjson.JSONDecodeError):
            return None
        if not isinstance(line, dict) or line.get("uid") != uid:
            return None
        return self._full(line, hops + 1)


def prompt_length(line: dict) -> int:
    """The prompt ids of a turn line, in either form."""
    ext = line.get("extends")
    if isinstance(ext, dict):
        return int(ext.get("ids") or 0) + len(line.get("prompt_ids_tail") or ())
    return len(line.get("prompt_ids") or ())


def read_turns(path: Path, conversations: Path | None = None,
               report_cut: bool = False) -> Iterator[tuple[int, dict]]:
    """(line number, full record) of each turn line of PATH (conversations.jsonl, or a file
    whose lines extend its lines: CONVERSATIONS), rebuilt by `TurnLines`; a line that cannot be
    rebuilt is skipped with a WARNING."""
    lines = TurnLines(conversations or path)
    for number, line in numbered_jsonl(path, report_cut):
        record = lines.full(line)
        if record is not None:
            yield number, record


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
    """Turns journaled as pending and not yet tombstoned, in journal order (start-up)."""
    pending: dict[str, dict] = {}
    for number, entry in numbered_jsonl(path, report_cut=True):
        uid = entry.get("uid")
        if not isinstance(uid, str) or entry.get("kind") not in ("turn", "done"):
            log.warning("%s: line %d is not a pending turn or its tombstone; skipped: %.80r",
                        path, number, entry)  # JSON, but not a journal entry: never fatal
        elif entry["kind"] == "turn":
            pending[uid] = entry
        else:
            pending.pop(uid, None)
    return list(pending.values())


def compact_pending(path: Path, live: list[dict]) -> None:
    """Rewrite the journal with only the live entries (start-up only; temp file + rename)."""
    path = Path(path)
    if not live and not path.exists():  # nothing to compact (a fresh data dir, maybe not made)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        for entry in live:
            f.write(orjson.dumps(entry, option=orjson.OPT_NON_STR_KEYS) + b"\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
