"""`rlproxy records compact`: sessions that are closed and trained move out of the live record
files into a segment, so the files start-up reads (recovery.py) hold what is still in play and
stop growing with the whole history.

A segment is a folder `segments/NNNNNN/` with its own `conversations.jsonl` (a line that extends
another names an offset in the same file) and `prm_scores.jsonl` (the moved turns' score,
release and feedback lines) and `reopen.json` (each moved session's next turn index: an id
used again numbers on). Start-up reads only a segment's reopen.json; `rlproxy train --from`
and the trainer's resume read every segment and then the live files (training/items.py
`released_turns`), so training on a compacted data dir gives the same items.

What stays live, read from the same state start-up builds (`recover`): a session still open in
the scorer's ledger, with a turn pending its next state, a trainable turn not scored yet, a
release not trained yet (training.jsonl's steps and the journal's quarantined keys are what is
handled), a turn among the scorer's recent ones (kept whole for feedback that trains it again),
and a session whose id matches KEEP. Nothing is dropped: every line of the live files ends up
either still there or in the segment, rebuilding to the same record (a line whose parent moves
to the other file is written whole, one whose parent moves with it names the parent's new
offset; score lines move byte for byte). A line that cannot be read stays where it was.

Crash safety: every new file (the segment's, and the live files' replacements) is written and
fsynced first; then the segment folder is renamed into place, and the pending journal
(rewritten whole: its entries no longer name offsets), the live conversations (with a fresh
index) and the live scores each replace their file by rename, in that order. A crash between
two steps leaves a turn in both the segment and a live file, never in neither (readers take a
uid once), and never a live turn without its score lines; a segment gets its COMPLETE mark
last, and the next compaction finishes or undoes one without it (`finish_or_undo`). Offline
only: the data dir must not be in use (cli.py takes its lock).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import orjson

from rlproxy.paths import CONVERSATIONS, PENDING, REOPEN, SCORES, SEGMENTS, segment_dirs
from rlproxy.records import (AT, LENGTH, IndexedFile, TurnLines, dumps_line, index_entry,
                             index_path, numbered_jsonl)
from rlproxy.recovery import recover, trainer_start
from rlproxy.scoring.scorer import KEEP_RECENT
from rlproxy.settings import Settings
from rlproxy.training.restart import handled_keys

COMPLETE = "complete"  # in a segment: its compaction replaced every live file


def live_sessions(data_dir: Path, settings: Settings, keep_recent: int = KEEP_RECENT) -> set[str]:
    """The sessions that stay in the live files (the module docstring), from recovery's state
    (KEEP_RECENT: the scorer's window of recent turns, scoring/scorer.py)."""
    start = trainer_start(data_dir)
    handled = set(handled_keys(start.lines)) | set(start.journal.quarantined)
    state = recover(data_dir, settings, handled, keep_recent=keep_recent)
    scorer = state.scorer
    live = set(scorer.ledger.tallies)
    live |= {e.get("session_id") for e in state.store.pending}
    live |= {t.get("session_id") for t in scorer.unscored}
    live |= {i["turn"].get("session_id") for i in state.trainer.released}
    live |= {line.get("session_id") for line, _ in scorer.recent.values()}
    live |= {line.get("session_id") for line, _ in scorer.held.values()}
    return live


def compact(data_dir: Path, settings: Settings, keep: str | None = None,
            keep_recent: int = KEEP_RECENT) -> dict:
    """Move DATA_DIR's closed, trained sessions (less those whose id matches the regex KEEP) into
    a new segment; what was done (sessions and turns moved, bytes before and after)."""
    data_dir = Path(data_dir)
    keep_re = re.compile(keep) if keep else None
    finish_or_undo(data_dir)
    live = live_sessions(data_dir, settings, keep_recent)
    conv = data_dir / CONVERSATIONS
    before = {n: (data_dir / n).stat().st_size if (data_dir / n).exists() else 0
              for n in (CONVERSATIONS, SCORES, PENDING)}

    def moves(sid) -> bool:
        return isinstance(sid, str) and sid not in live and not (keep_re and keep_re.search(sid))

    done = sorted(segment_dirs(data_dir))
    number = int(done[-1].name) + 1 if done else 1
    final = data_dir / SEGMENTS / f"{number:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a compaction that died before its rename
    tmp.mkdir(parents=True)
    fsync_dir(data_dir)  # segments/ itself, made by the first compaction
    out = {"segment": Files(tmp / CONVERSATIONS, index=False),
           "live": Files(conv.with_name(CONVERSATIONS + ".compact"), index=True)}
    moved_uids, sessions = set(), {}  # session -> the index its next turn would get
    turns = TurnLines(conv)
    where: dict[int, tuple[str, int, int]] = {}  # old offset -> (file, new offset, depth)
    at = 0
    with open(conv, "rb") if conv.exists() else open(os.devnull, "rb") as f:
        for raw in f:
            old, at = at, at + len(raw)
            line = parse(raw)
            if line is None:  # not a line that can be read: it stays as it was
                out["live"].raw(raw)
                continue
            name = "segment" if moves(line.get("session_id")) else "live"
            ext = line.get("extends")
            depth = 0
            if isinstance(ext, dict):
                parent = where.get(ext.get("at"))
                if parent is not None and parent[0] == name:
                    ext = line["extends"] = {**ext, "at": parent[1], "depth": parent[2] + 1}
                    depth = ext["depth"]
                else:  # its parent is in the other file (or unreadable): written whole
                    full = turns.full(line)
                    if full is None:  # reported; it stays as it was
                        out["live"].raw(raw)
                        continue
                    line = full
            else:
                turns.full(line)  # kept at hand as a parent of the lines after it
            where[old] = (name, out[name].write(line), depth)
            if name == "segment":
                moved_uids.add(line.get("uid"))
                sid, index = line.get("session_id"), line.get("index")
                if isinstance(index, int):
                    sessions[sid] = max(sessions.get(sid, 0), index + 1)
    if not moved_uids:
        for files in out.values():
            files.discard()
        shutil.rmtree(tmp, ignore_errors=True)
        return {"sessions": 0, "turns": 0, "segment": None, "before": before, "after": before}

    scores_out = {"segment": Files(tmp / SCORES, index=False),
                  "live": Files(data_dir / (SCORES + ".compact"), index=False)}
    scores = data_dir / SCORES
    if scores.exists():
        with open(scores, "rb") as f:
            for raw in f:
                line = parse(raw)
                name = "segment" if line is not None and line.get("uid") in moved_uids else "live"
                scores_out[name].raw(raw)
    with open(tmp / REOPEN, "wb") as f:  # a moved session's id used again numbers on
        f.write(orjson.dumps(sessions))
        f.flush()
        os.fsync(f.fileno())
    for files in (*out.values(), *scores_out.values()):  # every new file whole on disk first:
        files.close()  # what follows is renames only
    pending = rewrite_pending(data_dir, turns)
    fsync_dir(tmp)
    os.replace(tmp, final)  # the segment is whole before any live file changes
    fsync_dir(final.parent)
    if pending is not None:  # whole entries: they read the same against either file
        os.replace(pending, data_dir / PENDING)
    # conversations before its scores: a crash between the two leaves the moved turns' score
    # lines in both files (inert: their turns are not live), never turns without their scores
    # (which start-up would score again)
    index_path(conv).unlink(missing_ok=True)  # the old one names the old offsets
    os.replace(out["live"].path, conv)
    os.replace(index_path(out["live"].path), index_path(conv))  # (start-up checks it anyway)
    os.replace(scores_out["live"].path, scores)
    fsync_dir(data_dir)
    mark_complete(final)
    after = {n: (data_dir / n).stat().st_size if (data_dir / n).exists() else 0 for n in before}
    return {"sessions": len(sessions), "turns": len(moved_uids), "segment": str(final),
            "before": before, "after": after}


def mark_complete(segment: Path) -> None:
    (segment / COMPLETE).touch()
    fsync_dir(segment)


def finish_or_undo(data_dir: Path) -> None:
    """A compaction that died after renaming its segment into place (the newest one has no
    COMPLETE mark): if the live conversations still hold its turns (it died before replacing
    them), the segment is a copy of what the live files hold and goes; else only the live
    scores may still hold its turns' lines (copies of the segment's), and they go."""
    done = segment_dirs(data_dir)
    if not done or (done[-1] / COMPLETE).exists():
        return
    segment = done[-1]
    uids = {line.get("uid") for _, line in numbered_jsonl(segment / CONVERSATIONS)}
    with IndexedFile(data_dir / CONVERSATIONS) as f:
        if any(line.get("uid") in uids for _, line in f.lines()):
            shutil.rmtree(segment)
            fsync_dir(segment.parent)
            return
    scores = data_dir / SCORES
    if scores.exists():
        kept = Files(scores.with_name(SCORES + ".compact"), index=False)
        with open(scores, "rb") as f:
            for raw in f:
                line = parse(raw)
                if line is None or line.get("uid") not in uids:
                    kept.raw(raw)
        kept.close()
        os.replace(kept.path, scores)
        fsync_dir(data_dir)
    mark_complete(segment)


def rewrite_pending(data_dir: Path, turns: TurnLines) -> Path | None:
    """The pending journal (recovery compacted it to its live entries) written whole to a temp
    file beside it (an entry that extends a line names its old offset), fsynced: its path."""
    path = data_dir / PENDING
    if not path.exists():
        return None
    tmp = path.with_name(PENDING + ".compact")
    with open(tmp, "wb") as f:
        with open(path, "rb") as old:
            for raw in old:
                line = parse(raw)
                full = turns.full(line) if line is not None and "extends" in line else None
                f.write(dumps_line(full) if full is not None else raw)
        f.flush()
        os.fsync(f.fileno())
    return tmp


class Files:
    """One output file being written (and its index): its size so far is the next offset."""

    def __init__(self, path: Path, index: bool):
        self.path, self.size = path, 0
        self.f = open(path, "wb")
        self.index = open(index_path(path), "wb") if index else None
        self.indexing = index

    def write(self, line: dict) -> int:
        data, at = dumps_line(line), self.size
        self.f.write(data)
        if self.indexing:
            self.index.write(orjson.dumps({**index_entry(line), AT: at, LENGTH: len(data)})
                             + b"\n")
        self.size += len(data)
        return at

    def raw(self, data: bytes) -> None:
        self.f.write(data)
        self.size += len(data)
        self.indexing = False  # the index stops before a line it cannot name (records.py)

    def close(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        if self.index is not None:
            self.index.close()

    def discard(self) -> None:
        self.f.close()
        os.unlink(self.path)
        if self.index is not None:
            self.index.close()
            os.unlink(self.index.name)


def parse(raw: bytes) -> dict | None:
    try:
        line = orjson.loads(raw) if raw.endswith(b"\n") else None
    except orjson.JSONDecodeError:
        return None
    return line if isinstance(line, dict) else None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
