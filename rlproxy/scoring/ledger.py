"""The at-least-one ledger: which scored turns are held back, and when each is released.

Pure and synchronous: events in (a turn submitted, scored, restored from the records, given
feedback), `Release`s out. No I/O, no asyncio, no threads (the Scorer calls it from the event
loop only). It knows turns by uid and session only: rewards here are those of a turn's chosen
choice (the one its conversation continued from); the Scorer expands a turn's release into one
release per choice.

The rule (README "At least one"): a scored turn with reward > 0, or no reward, is released at
once. One with reward <= 0 is held while its session may still be lifted: when the session's
last turn is scored and nothing of it is still pending, if no turn of it scored > 0, its best
liftable turn (the latest among equals) is released with +1 and the rest with their own
rewards. Liftable: the reward is the judge's decided verdict alone. A turn with explicit
feedback (a person's word) or a reward function's score is never lifted, and an undecided
turn has no reward, so it is released at once and never lifted either. With
at-least-one off every turn is released when scored.

Bounded: a session's state lives until it closes; then only its uids are kept, in an LRU of
`keep_done`, so a late duplicate is still recognised and late feedback still re-releases.

`readable` sorts the records read back at start-up: a line of prm_scores.jsonl that is JSON but
not a score, release or feedback line the ledger can take is skipped with a WARNING naming the
file and line, so an odd line never stops the server (records.py skips lines that are not JSON).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from rlproxy.lru import LRU
from rlproxy.scoring.judging import at_least_one


log = logging.getLogger("rlproxy.scoring")
# what each kind of line read back must carry (scorer.py reads these keys)
NEEDS = {"score": ("uid", "session_id", "index", "reward", "final", "judge_reward",
                   "function_reward", "feedback"),
         "release": ("uid", "reward"), "feedback": ("uid", "reward")}


def readable(lines: Iterable[dict], path: Path) -> Iterator[dict]:
    """The lines of PATH (prm_scores.jsonl) the ledger can take back; each other one is
    skipped with a WARNING naming the file and line."""
    for number, line in enumerate(lines, 1):
        needs = NEEDS.get(line.get("kind"), ()) if isinstance(line, dict) else None
        if needs is None or not all(map(line.__contains__, needs)) or not isinstance(
                line.get("uid", ""), str) or (line.get("kind") == "score"
                                              and not isinstance(line["index"], int)):
            log.warning("%s: entry %d is not a score, release or feedback line; skipped: "
                        "%.120r", path, number, line)
            continue
        yield line


@dataclass(frozen=True)
class Release:
    uid: str
    reward: float | None
    reason: str  # scored | session_closed | at_least_one | feedback


@dataclass
class Tally:
    """One open session's turns."""

    pending: set[str] = field(default_factory=set)  # submitted, not scored yet
    scored: dict[str, tuple[int, float | None]] = field(default_factory=dict)  # uid -> (index, r)
    held: set[str] = field(default_factory=set)  # scored, waiting for the session to close
    liftable: set[str] = field(default_factory=set)  # rewarded by the judge's verdict alone
    closed: bool = False  # its last turn has been scored


class Ledger:
    def __init__(self, at_least_one: bool = True, keep_done: int = 65536):
        self.at_least_one = at_least_one
        self.tallies: dict[str, Tally] = {}
        self.session_of: dict[str, str] = {}  # uid -> its session, while that session is open
        self.done: LRU[str, float | None] = LRU(keep_done)  # closed sessions' uids -> reward
        self.pending = 0  # turns submitted and not scored yet

    # ---- what it knows ----

    def known(self, uid: str) -> bool:
        return uid in self.session_of or uid in self.done

    def known_uids(self) -> set[str]:
        return set(self.session_of) | set(self.done)

    def is_pending(self, uid: str) -> bool:
        sid = self.session_of.get(uid)
        return sid is not None and uid in self.tallies[sid].pending

    def is_held(self, uid: str) -> bool:
        sid = self.session_of.get(uid)
        return sid is not None and uid in self.tallies[sid].held

    # ---- events ----

    def submit(self, uid: str, session_id: str) -> bool:
        """A turn to score; False if it is known already (a duplicate: score it once)."""
        if self.known(uid):
            return False
        self.tallies.setdefault(session_id, Tally()).pending.add(uid)
        self.session_of[uid] = session_id
        self.pending += 1
        return True

    def score(self, uid: str, index: int, reward: float | None, final: bool,
              liftable: bool = True) -> list[Release]:
        """A submitted turn was scored; `final`: it is the last turn of its session;
        `liftable`: its reward is the judge's decided verdict alone (no feedback, no reward
        function), so at-least-one may lift it."""
        sid = self.session_of[uid]
        tally = self.tallies[sid]
        tally.pending.discard(uid)
        self.pending -= 1
        tally.scored[uid] = (index, reward)
        if liftable:
            tally.liftable.add(uid)
        tally.closed |= final
        out = []
        if self.at_least_one and reward is not None and reward <= 0:
            tally.held.add(uid)
        else:
            out.append(Release(uid, reward, "scored"))
        return out + self._maybe_close(sid)

    def feedback(self, uid: str, reward: float) -> tuple[str, list[Release]]:
        """A scored turn's reward changed to REWARD (feedback). Status: applied (it was held;
        released now if positive), rescored (released already: released again), or unknown
        (not scored, or forgotten)."""
        if uid in self.done:
            self.done.assign(uid, reward)
            return "rescored", [Release(uid, reward, "feedback")]
        sid = self.session_of.get(uid)
        if sid is None or uid not in self.tallies[sid].scored:
            return "unknown", []
        tally = self.tallies[sid]
        tally.scored[uid] = (tally.scored[uid][0], reward)
        tally.liftable.discard(uid)  # a person said what it is worth: never lifted over that
        if uid not in tally.held:
            return "rescored", [Release(uid, reward, "feedback")]
        if reward > 0:
            tally.held.discard(uid)
            return "applied", [Release(uid, reward, "feedback")]
        return "applied", []

    def close(self, session_id: str) -> list[Release]:
        """The session closed: its held turns need wait for no later turn (its last main turn
        may never be scored, e.g. one that X-RL-Train: 0 kept out of training)."""
        tally = self.tallies.get(session_id)
        if tally is None:
            return []
        tally.closed = True
        return self._maybe_close(session_id)

    # ---- start-up: the records read back ----

    def restore(self, uid: str, session_id: str, index: int, reward: float | None,
                final: bool, liftable: bool = True) -> None:
        """A `score` line read back: held until its `release` line is read too."""
        if uid in self.done:
            return
        tally = self.tallies.get(session_id)
        if tally is None:  # (not setdefault: a Tally made per line read back)
            tally = self.tallies[session_id] = Tally()
        self.session_of[uid] = session_id
        tally.scored[uid] = (index, reward)
        if liftable:
            tally.liftable.add(uid)
        else:
            tally.liftable.discard(uid)
        tally.held.add(uid)
        tally.closed |= final

    def restore_feedback(self, uid: str, reward: float | None) -> None:
        """A `feedback` line read back for a scored turn of an open session: it is never
        lifted, and its reward is REWARD (what the feedback made it)."""
        sid = self.session_of.get(uid)
        if sid is not None and uid in self.tallies[sid].scored:
            tally = self.tallies[sid]
            tally.liftable.discard(uid)
            tally.scored[uid] = (tally.scored[uid][0], reward)

    def restore_release(self, uid: str, reward: float | None) -> None:
        """A `release` line read back (its latest reward wins)."""
        if uid in self.done:
            self.done.assign(uid, reward)
            return
        sid = self.session_of.get(uid)
        if sid is None:
            return
        tally = self.tallies[sid]
        tally.held.discard(uid)
        tally.scored[uid] = (tally.scored[uid][0], reward)
        if tally.closed and not tally.pending and not tally.held:
            self._forget(sid)

    def settle(self) -> list[Release]:
        """After restoring: close every session that can close (a crash between a session's
        last score line and its release lines)."""
        out = []
        for sid in list(self.tallies):
            out += self._maybe_close(sid)
        return out

    # ---- closing ----

    def _maybe_close(self, sid: str) -> list[Release]:
        tally = self.tallies[sid]
        if not tally.closed or tally.pending:
            return []
        rewards = {u: (i, r) for u, (i, r) in tally.scored.items() if r is not None}
        lift = at_least_one(rewards, tally.liftable) if self.at_least_one else None
        out = []
        for uid in sorted(tally.held, key=lambda u: tally.scored[u][0]):
            if uid == lift:
                tally.scored[uid] = (tally.scored[uid][0], 1.0)
                out.append(Release(uid, 1.0, "at_least_one"))
            else:
                out.append(Release(uid, tally.scored[uid][1], "session_closed"))
        tally.held.clear()
        self._forget(sid)
        return out

    def _forget(self, sid: str) -> None:
        tally = self.tallies.pop(sid)
        for uid, (_, reward) in tally.scored.items():
            del self.session_of[uid]
            self.done.assign(uid, reward)
