"""An incremental index over the record files, for the dashboard.

Each `refresh()` reads only the bytes appended to conversations.jsonl, prm_scores.jsonl and
training.jsonl since the last call (complete lines only: a line still being written is read
next time), and keeps small per-turn entries: where its line is, its session, times and token
counts, its score and release, the step that trained it; and the step lines and the eval
gate's verdicts (`eval_entry`) for the charts. A session page then reads just its turns' lines
by offset, so the dashboard stays fast with 100k turns on disk. Knows nothing of HTTP;
records.py owns the files' format, paths.py their names.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from rlproxy.paths import CONVERSATIONS, SCORES, TRAINING
from rlproxy.records import TurnLines, prompt_length


@dataclass(slots=True)
class TurnEntry:
    uid: str
    session_id: str
    index: int
    offset: int  # where its line starts in conversations.jsonl
    length: int
    received: float
    first_token_s: float
    turn_type: str
    prompt_tokens: int
    completion_tokens: int


@dataclass(slots=True)
class SessionEntry:
    id: str
    first: float
    last: float
    turns: list[str] = field(default_factory=list)  # uids, in record order


def day(t: float) -> str:
    return time.strftime("%Y-%m-%d", time.localtime(t))


def eval_entry(r: dict) -> dict:
    """An `eval` line (training/gate.py) as the held-out chart needs it: the candidate's probe
    reward and the served adapter's (None when not measured: no reward function, or the
    evaluation failed), its KLs and the verdict."""
    cand, served = r.get("candidate") or {}, r.get("served") or {}
    return {"step": r.get("step"), "time": r.get("time"), "passed": r.get("passed"),
            "candidate_version": r.get("candidate_version"),
            "served_version": r.get("served_version"), "reward": cand.get("reward"),
            "served_reward": served.get("reward"), "kl_served": cand.get("kl_served"),
            "kl_base": cand.get("kl_base"), "refused": r.get("refused")}


class RecordIndex:
    """Thread-safe: `refresh` and the readers take one lock (the server calls them from a
    worker thread, so a long first scan never blocks the event loop)."""

    def __init__(self, data_dir: Path):
        self.data_dir = Path(data_dir)
        self.lock = threading.Lock()
        self._clear()

    def _clear(self) -> None:
        self.offsets: dict[str, int] = {}
        self.turn_lines = TurnLines(self.data_dir / CONVERSATIONS)
        self.inodes: dict[str, int] = {}
        self.turns: dict[str, TurnEntry] = {}
        self.sessions: dict[str, SessionEntry] = {}
        self.scores: dict[str, tuple[int, int, float | None]] = {}  # uid -> offset, len, reward
        self.releases: dict[str, dict] = {}  # uid -> {"reward", "reason"}
        self.feedback: dict[str, dict] = {}
        self.steps: list[dict] = []  # compact step lines, in order
        self.events: list[dict] = []  # rollbacks, pauses
        self.evals: list[dict] = []  # the eval gate's verdicts, compact, in order
        self.trained: dict[str, tuple[int, float | None]] = {}  # uid -> (step, time)
        self.skipped: dict[str, str] = {}
        self.by_day: dict[str, Counter] = defaultdict(Counter)

    # ---- reading new bytes ----

    def refresh(self) -> None:
        with self.lock:
            if any(self._replaced(name) for name in (CONVERSATIONS, SCORES, TRAINING)):
                self._clear()  # truncated or rotated: every offset we hold may be stale
            self._read_new(CONVERSATIONS, self._on_turn)
            self._read_new(SCORES, self._on_score)
            self._read_new(TRAINING, self._on_training)

    def _replaced(self, name: str) -> bool:
        """Whether NAME shrank or is another file than the one indexed (logrotate's
        copytruncate, a hand-made rotation, a restore from a backup)."""
        if name not in self.offsets:
            return False
        try:
            st = (self.data_dir / name).stat()
        except FileNotFoundError:
            return True
        return st.st_size < self.offsets[name] or st.st_ino != self.inodes.get(name)

    def _read_new(self, name: str, handle) -> None:
        path = self.data_dir / name
        start = self.offsets.get(name, 0)
        try:
            st = path.stat()
        except FileNotFoundError:
            return
        self.inodes[name] = st.st_ino
        if st.st_size <= start:
            self.offsets[name] = start
            return
        with open(path, "rb") as f:
            f.seek(start)
            pos = start
            for line in f:
                if not line.endswith(b"\n"):
                    break  # still being written (or torn): read it next time
                try:
                    record = orjson.loads(line)
                except orjson.JSONDecodeError:
                    record = None
                if isinstance(record, dict):
                    handle(record, pos, len(line))
                pos += len(line)
        self.offsets[name] = pos

    def _on_turn(self, r: dict, offset: int, length: int) -> None:
        try:
            choice = r["choices"][r.get("chosen_choice", 0)]
            timings = r.get("timings") or {}
            e = TurnEntry(r["uid"], r["session_id"], int(r.get("index", 0)), offset, length,
                          float(timings.get("received") or 0.0),
                          float(timings.get("first_token_s") or 0.0), r.get("turn_type", "main"),
                          prompt_length(r), len(choice.get("completion_ids") or ()))
        except (KeyError, IndexError, TypeError, ValueError):
            return  # not a turn line this dashboard can show
        self.turns[e.uid] = e
        s = self.sessions.get(e.session_id)
        if s is None:
            s = self.sessions[e.session_id] = SessionEntry(e.session_id, e.received, e.received)
            self.by_day[day(e.received)]["sessions"] += 1
        s.turns.append(e.uid)
        s.first, s.last = min(s.first, e.received), max(s.last, e.received)
        today = self.by_day[day(e.received)]
        today["turns"] += 1
        today["prompt_tokens"] += e.prompt_tokens
        today["completion_tokens"] += e.completion_tokens

    def _on_score(self, r: dict, offset: int, length: int) -> None:
        kind, uid = r.get("kind"), r.get("uid")
        if kind == "score":
            self.scores[uid] = (offset, length, r.get("reward"))
        elif kind == "release" and r.get("key", uid) == uid:  # the continued choice's
            self.releases[uid] = {"reward": r.get("reward"), "reason": r.get("reason")}
        elif kind == "feedback":
            self.feedback[uid] = {"reward": r.get("reward"), "comment": r.get("comment"),
                                  "at": r.get("at")}

    def _on_training(self, r: dict, offset: int, length: int) -> None:
        kind = r.get("kind")
        if kind == "step":
            at = r.get("time")
            self.steps.append({k: r.get(k) for k in (
                "step", "adapter_version", "loss", "kl", "entropy", "reward_mean", "reward_std",
                "grad_norm", "tokens", "turns", "step_time_s", "time")})
            for uid in r.get("uids") or ():
                self.trained[uid] = (r.get("step"), at)
            if at:
                self.by_day[day(at)]["steps"] += 1
        elif kind == "skipped":
            self.skipped[r.get("uid")] = r.get("reason")
        elif kind == "eval":
            self.evals.append(eval_entry(r))
        elif kind in ("rollback", "pause", "resume"):
            self.events.append(r)

    # ---- reading whole lines back ----

    def _line(self, name: str, offset: int, length: int) -> dict | None:
        """The record at OFFSET, or None when the file changed under us since the last
        refresh (rotated between refresh and read): the next refresh rebuilds the index."""
        try:
            with open(self.data_dir / name, "rb") as f:
                f.seek(offset)
                record = orjson.loads(f.read(length))
        except (OSError, orjson.JSONDecodeError):
            return None
        return record if isinstance(record, dict) else None

    def session_turns(self, session_id: str, start: int = 0, limit: int = 100) -> list[dict]:
        """Full records of one session's turns [start, start + limit), each with its score."""
        with self.lock:
            s = self.sessions.get(session_id)
            uids = s.turns[start:start + limit] if s else []
            out = []
            for uid in uids:
                e = self.turns[uid]
                record = self._line(CONVERSATIONS, e.offset, e.length)
                if record is None or record.get("uid") != uid:
                    continue
                record = self.turn_lines.full(record)  # whole, from the turn it extends
                if record is None:
                    continue
                score = self.scores.get(uid)
                record["score"] = self._line(SCORES, *score[:2]) if score else None
                record["release"] = self.releases.get(uid)
                record["feedback"] = self.feedback.get(uid)
                record["trained"] = self.trained.get(uid)
                record["skipped"] = self.skipped.get(uid)
                out.append(record)
            return out

    def session_list(self, limit: int = 200, only: set[str] | None = None) -> list[dict]:
        """The LIMIT most recently active sessions (or those named in ONLY), with totals."""
        with self.lock:
            if only is not None:
                recent = [self.sessions[i] for i in only if i in self.sessions]
            else:
                recent = sorted(self.sessions.values(), key=lambda s: s.last,
                                reverse=True)[:limit]
            out = []
            for s in recent:
                rewards = [self.releases[u]["reward"] for u in s.turns
                           if u in self.releases and self.releases[u]["reward"] is not None]
                out.append({"id": s.id, "first": s.first, "last": s.last, "turns": len(s.turns),
                            "trained": sum(1 for u in s.turns if u in self.trained),
                            "reward_mean": sum(rewards) / len(rewards) if rewards else None})
            return out

    def today(self) -> dict:
        with self.lock:
            return dict(self.by_day.get(day(time.time()), {}))
