"""Start-up recovery in one place: each record file is read once, in one known order, and the
state each component starts from is rebuilt from it, as a database replays its log at start.

Which file rebuilds which state, in the order read:

0. train_journal.jsonl and training.jsonl, once each (`trainer_start`, first: which released
   choices are still to train depends on what the trainer's resume makes of them):
   `TrainerStart` (training/restart.py), the journal's books and the steps recorded, from
   which the trainer takes the keys it has handled and its resume the steps a kill lost.
1. prm_scores.jsonl, once: `ScorerStart` (the ledger from score, release and feedback lines;
   the judge's counts; summaries; feedback for turns not scored yet), and which released
   choices the trainer has not handled yet (their release lines and score lines).
2. each segment's reopen.json (compaction.py: sessions moved out number on), then
   conversations.jsonl, once, through its index (records.py `IndexedFile`: the few fields of
   each line, and past the index's end the lines themselves; a line is read whole only when a
   part below takes it): `StoreStart.reopen` (each session's next turn index) and the
   uids recorded; `ScorerStart.unscored` (trainable turns without a score line, scored again),
   `.held` and `.recent` (packed turns); `TrainerItems.released` (the items of those choices).
3. pending_turns.jsonl, once, then compacted (its one rewrite): `StoreStart.pending`, the turns
   still waiting for their next state, less those recorded since.

What the trainer made of 0 (keys trained or quarantined) comes in to `recover` as `handled`, so
neither file is read again for the released items.

Owns how those lines are read back, and nothing else: the constructors take the state
(`SessionStore(start=...)`, `Scorer(start)`, `Trainer(start=...)`) and read no file;
pipeline.py calls `trainer_start` and `recover` once each and hands the trainer its items. What the state means is the components' own
(sessions/store.py, scoring/scorer.py, scoring/ledger.py, scoring/judging.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Container, Iterable, Iterator

import orjson

from rlproxy.lru import LRU
from rlproxy.paths import CONVERSATIONS, PENDING, REOPEN, SCORES, segment_dirs
from rlproxy.records import AT, IndexedFile, TurnLines, numbered_jsonl
from rlproxy.scoring.judging import final_reward, released_item
from rlproxy.scoring.ledger import readable
from rlproxy.scoring.scorer import (KEEP_FEEDBACK, KEEP_RECENT, KEEP_SCORED, RECENT_MB,
                                    ScorerStart, liftable, pack, summary)
from rlproxy.sessions.store import StoreStart, live_journal
from rlproxy.settings import ScoringSettings, Settings
from rlproxy.training.restart import TrainerStart, read_start

log = logging.getLogger("rlproxy.records")
trainer_log = logging.getLogger("rlproxy.trainer")  # its items' warnings, as before
# what a released item needs of its score line (scoring/judging.py: released_item)
ITEM_NEEDS = ("chosen_choice", "teacher_logprobs", "other_choices")


def trainer_start(data_dir: Path) -> TrainerStart:
    """0 in the module docstring: the trainer's own two files, read once each."""
    return read_start(data_dir)


@dataclass
class TrainerItems:
    """What the trainer is handed at start: every choice released for training and not handled
    yet, as the scorer hands it live (scoring/judging.py: released_item), in the records' order
    (the latest release of a key wins)."""

    released: list[dict] = field(default_factory=list)


@dataclass
class Recovered:
    """What each part of the pipeline starts from."""

    store: StoreStart
    scorer: ScorerStart
    trainer: TrainerItems | None  # None: no trainer to hand items to (`handled` was None)


def recover(data_dir: Path, settings: Settings, handled: Container[str] | None = None, *,
            keep_recent: int = KEEP_RECENT, recent_mb: float = RECENT_MB,
            keep_scored: int = KEEP_SCORED) -> Recovered:
    """Read DATA_DIR's records once each and rebuild what the store, the scorer and the trainer
    start from (the module docstring's list); compacts the pending journal. HANDLED: the keys
    the trainer has trained or quarantined (None: no trainer, no items rebuilt). KEEP_*: the
    scorer's bounds (scoring/scorer.py)."""
    data_dir, s = Path(data_dir), settings.scoring
    scorer = ScorerReplay(ScorerStart.fresh(s, keep_recent, recent_mb, keep_scored), s)
    released = Released(handled, s.w_opd, s.w_rl) if handled is not None else None
    path = data_dir / SCORES
    numbered = numbered_jsonl(path, report_cut=True)
    lines = (released.index(numbered, path) if released is not None
             else (line for _, line in numbered))
    for line in readable(lines, path):  # an odd line: skipped, with a WARNING
        scorer.score_line(line)
    scorer.scores_read()
    if released is not None:
        released.scores_read()
    store, recorded = StoreStart(), set()
    for folder in segment_dirs(data_dir):  # compacted sessions number on (compaction.py)
        for sid, nxt in read_reopen(folder / REOPEN).items():
            store.reopen.put(sid, (max(nxt, store.reopen.peek(sid, (0, False))[0]), False))
    path = data_dir / CONVERSATIONS
    turns = TurnLines(path)  # whole records from lines that extend an earlier turn
    # through its index (records.py): a line the index covers comes as its few fields
    with IndexedFile(path) as conversations:
        read_conversations(conversations, turns, recorded, store, scorer, released)
    store.pending = live_journal(data_dir / PENDING, recorded, turns)
    return Recovered(store, scorer.start,
                     TrainerItems(released.items) if released is not None else None)


def read_conversations(conversations: IndexedFile, turns: TurnLines, recorded: set,
                       store: StoreStart, scorer: ScorerReplay,
                       released: Released | None) -> None:
    """2 in the module docstring: each line of conversations.jsonl, once, into RECORDED (the
    uids read), STORE, SCORER and RELEASED."""
    path = conversations.path
    for number, line in conversations.lines():
        # A turn is rebuilt whole only if the scorer or the trainer takes it (most of a long
        # history is scored, released and trained: its session and index are all it gives)
        if not turns.note(line, recorded):  # its parent cannot be read: warned, its line kept
            continue
        uid = line.get("uid")
        recorded.add(uid)
        store.recorded(line)
        if scorer.wants(line) or (released is not None and released.wants(uid)):
            whole = conversations.whole(line) if AT in line else line
            if whole is None:
                log.warning("%s: line %d changed while it was read; skipped", path, number)
                continue
            record = turns.full(whole)
            if record is None:
                continue
            scorer.turn(record)
            if released is not None:
                released.turn(number, record, path)


def read_reopen(path: Path) -> dict[str, int]:
    """A segment's reopen.json: session id -> the index its next turn gets; {} (with a
    WARNING) if it cannot be read."""
    try:
        data = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as e:
        log.warning("%s cannot be read (%s); its sessions' ids, used again, number from 0",
                    path, e)
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, int)} \
        if isinstance(data, dict) else {}


class ScorerReplay:
    """prm_scores.jsonl, then conversations.jsonl, into a ScorerStart: turns not scored go to
    the queue; sessions not finished get their tallies back, with their held turns; the latest
    released turns stay at hand for feedback. Keeps the set of scored uids only while reading."""

    def __init__(self, start: ScorerStart, settings: ScoringSettings):
        self.start, self.s = start, settings
        self.scored: set[str] = set()
        self.held: dict[str, dict] = {}  # uid -> score line, until its release line is read
        self.recent: LRU[str, dict] = LRU(start.recent.max_items)  # released lately -> line
        self.feedback: dict[str, tuple[float, str | None, bool]] = {}  # (.., after its score)

    def score_line(self, line: dict) -> None:
        start, uid, kind = self.start, line.get("uid"), line.get("kind")
        if kind == "score":
            line.setdefault("chosen_choice", 0)
            self.scored.add(uid)
            self.held[uid] = line
            start.summaries.put(uid, summary(line))
            start.ledger.restore(uid, line["session_id"], line["index"], line["reward"],
                                 line["final"], liftable(line))
            start.judge_health.count(line)
        elif kind == "release" and line.get("key", uid) == uid:  # the chosen choice's
            start.ledger.restore_release(uid, line["reward"])
            if line.get("reason") != "feedback":
                start.judge_health.released += 1
            start.judge_health.lifted += line.get("reason") == "at_least_one"
            score = self.held.pop(uid, None) or self.recent.pop(uid, None)
            if score is not None:
                self.recent.put(uid, score)
        elif kind == "feedback":
            self.feedback[uid] = (line["reward"], line.get("comment"), uid in self.scored)

    def scores_read(self) -> None:
        """Feedback read back: a turn not scored yet gets it when scored; one scored takes it
        now (given after its score line, or while that line was being written): a person's
        word, so the turn is never lifted, and a held turn keeps its reward."""
        start = self.start
        start.feedback.max_items = None  # all of it, as written; the next one trims
        for uid, (reward, comment, after) in self.feedback.items():
            line = self.held.get(uid) or self.recent.peek(uid)
            if uid not in self.scored:
                start.feedback.assign(uid, (reward, comment))
            elif line is not None and (after or line["feedback"] is None):
                start.judge_health.compare(line["judge_reward"], reward)
                new = final_reward(line["judge_reward"], line["function_reward"], reward,
                                   self.s.feedback_mode)
                line["feedback"], line["reward"] = reward, new
                start.ledger.restore_feedback(uid, new)
        start.feedback.max_items = KEEP_FEEDBACK
        self.feedback = {}

    def wants(self, line: dict) -> bool:
        """Whether `turn` keeps anything of LINE's turn (from its fields that are not its
        prompt: a line that extends another has them all)."""
        uid = line.get("uid")
        return bool(line.get("trainable") and uid not in self.scored) or (
            uid in self.held or uid in self.recent)

    def turn(self, record: dict) -> None:
        start, uid = self.start, record.get("uid")
        if record.get("trainable") and uid not in self.scored:
            if start.ledger.submit(uid, record["session_id"]):  # a duplicate: scored once
                start.unscored.append(record)
        elif uid in self.held and start.ledger.is_held(uid):
            start.held[uid] = (self.held[uid], pack(record))
        elif uid in self.recent:
            packed = pack(record)
            start.recent.put(uid, (self.recent.peek(uid), packed), len(packed))


class Released:
    """The items `released_turns` (training/items.py) rebuilds, from the same two passes: one
    per released choice whose key the trainer has not handled. A line it cannot use is skipped
    with a WARNING naming it, as there."""

    def __init__(self, handled: Container[str], w_opd: float, w_rl: float):
        self.handled, self.w_opd, self.w_rl = handled, w_opd, w_rl
        self.scores: dict[str, dict] = {}  # uid -> what an item needs of its score line
        self.releases: dict[str, dict[str, dict]] = {}  # uid -> key -> its latest release line
        self.items: list[dict] = []

    def index(self, numbered: Iterable[tuple[int, dict]], path: Path) -> Iterator[dict]:
        """Each line of prm_scores.jsonl, indexed here on its way on to the scorer."""
        for number, line in numbered:
            uid = line.get("uid")
            if not isinstance(uid, str):
                trainer_log.warning("%s: line %d has no uid; skipped", path, number)
            elif line.get("kind") == "score":  # a copy: the scorer's replay changes its line
                self.scores[uid] = {k: line[k] for k in ITEM_NEEDS if k in line}
            elif line.get("kind") == "release":
                key = line.get("key") or uid
                if key not in self.handled:  # handled: no item, whichever release is latest
                    self.releases.setdefault(uid, {})[key] = line
            yield line

    def scores_read(self) -> None:
        """Keep only the score lines of the releases still to train."""
        self.scores = {u: self.scores[u] for u in self.releases if u in self.scores}

    def wants(self, uid) -> bool:
        """Whether the turn UID has a release still to train."""
        return isinstance(uid, str) and uid in self.releases

    def turn(self, number: int, record: dict, path: Path) -> None:
        uid = record.get("uid")
        for release in (self.releases.get(uid, {}) if isinstance(uid, str) else {}).values():
            try:
                item = released_item(record, self.scores.get(uid, {}), release, self.w_opd,
                                     self.w_rl)
            except (KeyError, IndexError, TypeError, ValueError) as e:
                trainer_log.warning("%s: line %d is not a turn that can be trained (%s: %s); "
                                    "skipped", path, number, type(e).__name__, e)
                break
            if item is not None:
                self.items.append(item)
