"""Durable JSONL files under the data directory: append-only, one complete line per write.

Each line is written with a single `os.write` on a file opened with O_APPEND, so a killed process
never leaves half a line, and it is fsync'ed (unless turned off) before the caller goes on, so a
line the program acknowledged is on disk. The program never truncates or rewrites a record file.
Readers still skip a final line without its newline (power loss can tear one); nothing else.

The pending-turn journal (`pending_turns.jsonl`) is the one internal file: turns whose response
completed but whose next state is not known yet. It holds "turn" entries and "done" tombstones
and is compacted (rewritten to a temp file + renamed) only at start-up.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Iterator

import orjson

SCHEMA_VERSION = 1
CONVERSATIONS = "conversations.jsonl"
PENDING = "pending_turns.jsonl"


class JsonlWriter:
    """Appends whole lines to one file; safe to call from any thread."""

    def __init__(self, path: Path, fsync: bool = True):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self._lock = threading.Lock()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._start_on_fresh_line()

    def _start_on_fresh_line(self) -> None:
        # A line torn by power loss must not glue itself to the next record.
        size = os.fstat(self._fd).st_size
        if size:
            with open(self.path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    os.write(self._fd, b"\n")

    def write(self, record: dict) -> None:
        # OPT_NON_STR_KEYS: e.g. logit_bias maps int token ids; JSON keys are strings
        line = orjson.dumps({"schema_version": SCHEMA_VERSION, **record},
                            option=orjson.OPT_NON_STR_KEYS) + b"\n"
        with self._lock:
            view = memoryview(line)
            while view:  # os.write may write less than asked (rare, for regular files)
                view = view[os.write(self._fd, view):]
            if self.fsync:
                os.fsync(self._fd)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


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
