"""The training journal: which turns each optimizer step is about to train, and how it ended.

Before the trainer runs a step it appends `{"kind": "step_start", "n", "uids", "attempt"}` (uids:
the items' keys, `item_key`: a turn's uid, or uid/i for another of its choices), and
after it `{"kind": "step_end", "n", "ok", "error"}`; both are on disk (fsync'ed, like every record
line unless --no-fsync) before the trainer goes on, so a start without an end means the process
died inside that step (killed, out of memory, crashed). The next start-up finds it and ends it
with `"died": true`. A step that raised costs each of its turns one attempt; a turn that reaches
`max_attempts` gets one `{"kind": "quarantined", "uid", "reason"}` line and is never trained
again: a poison turn costs at most `max_attempts` failures, never a crash loop.

A line a full disk refuses (an end, a quarantine) is kept, in order, and written before the next
step's start, which waits for it: so a step whose end could not be written is never left open on
disk behind a later step, to be booked as a death at the next start. A graceful stop that gives
up waiting for a step, or ends it at its next unit, ends it uncharged (`"stopped": true`).

Crash blame. A death is not always the step's fault: an operator restarting the server, a
deploy, the OOM killer taking the biggest process. So a death charges the step's turns only when
the step ran in a *proven* process: one that had already ended a step cleanly, or had run
CLEAN_RUN_S seconds (`proven` in its step_start line). A death in an unproven process makes its
turns *suspects*, uncharged. The trainer keeps suspects out of its batches until the process is
proven (it trains other turns first; with nothing else to train it waits out CLEAN_RUN_S), then
retries each alone. So kills shortly after each restart charge no one, while a turn that kills
every process that trains it dies in a proven one from its second try on, and is quarantined
after at most `max_attempts` + 1 deaths.

Only the turns' compute (examples, forward and backward) is charged: the step ends ok as soon as
the optimizer update is applied, so a failure after it (a checkpoint save on a full disk, a
later epoch) is logged and surfaced, never retrained. When SYSTEMIC_TURNS different turns fail
in a row with one error type the cause is not the turns: training pauses with an error instead
of quarantining them all. A journal line that cannot be read is skipped with a WARNING naming the
file and line.

This module keeps the books, finds the steps a kill lost since a checkpoint (`lost_steps`), and
has two checks on a turn record (`outside_vocab`: ids that would crash MLX rather than raise;
`turn_length`); the trainer (training/loop.py) runs each batch between a start and an end and
does the training. The file is `train_journal.jsonl` in the data dir, append-only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from rlproxy.paths import JOURNAL
from rlproxy.records import JsonlWriter, WriteFailed, numbered_jsonl

log = logging.getLogger("rlproxy.trainer")
SYSTEMIC_TURNS = 3  # different turns failing in a row with one error type: the cause is not them
DIED = "the process died during this step (killed, out of memory or crashed)"
STOPPED = ("the server stopped before this step ended (the stop ended it at its next unit, or "
           "gave up waiting for it)")
# a process up this long counts as proven without a clean step: a restart loop kills sooner
CLEAN_RUN_S = 60.0
_warned: set[tuple[str, int]] = set()  # (journal, entry) read back that was not a journal line


def item_key(item: dict) -> str:
    """A scorer -> trainer item's key (training/items.py): its "key", or the uid of an item from
    before choices were keyed."""
    return item.get("key") or item["turn"]["uid"]


def item_choice(item: dict) -> int:
    """The index of the item's choice in its turn (default: the one the conversation took)."""
    choice = item.get("choice")
    return item["turn"].get("chosen_choice", 0) if choice is None else choice


@dataclass
class Books:
    """What the journal says: charged failures and uncharged deaths (suspects) per key, the
    quarantined keys and why, the steps started and never ended, the highest step number."""

    failures: Counter = field(default_factory=Counter)
    suspects: Counter = field(default_factory=Counter)
    quarantined: dict[str, str] = field(default_factory=dict)
    open_steps: dict[int, dict] = field(default_factory=dict)
    last: int = 0

    def died(self, start: dict) -> bool:
        """Book the death of step START; whether it charged its turns (see the docstring)."""
        proven = start.get("proven", True)  # a line from before the rule: as it was then
        (self.failures if proven else self.suspects).update(start["uids"])
        return proven


def read_journal(data_dir: Path) -> Books:
    """The books from DATA_DIR's journal. Steps that never ended are not counted yet."""
    books = Books()
    path = Path(data_dir) / JOURNAL
    for number, line in numbered_jsonl(path, report_cut=True):
        try:
            kind = line.get("kind")
            if kind == "step_start":  # checked whole before it is booked
                n, uids = int(line["n"]), line["uids"]
                if not isinstance(uids, list) or not all(isinstance(u, str) for u in uids):
                    raise TypeError("its uids are not a list of keys")
                books.open_steps[n] = line
                books.last = max(books.last, n)
            elif kind == "step_end":
                n, ok = int(line["n"]), line["ok"]
                start = books.open_steps.pop(n, None)
                if start is None:
                    continue
                if line.get("died") and not ok:
                    books.died(start)
                elif not ok:
                    if line.get("charged", True):
                        books.failures.update(start["uids"])
                else:  # trained: no longer suspect
                    for uid in start["uids"]:
                        books.suspects.pop(uid, None)
            elif kind == "quarantined":
                books.quarantined[str(line["uid"])] = str(line["reason"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if (str(path), number) not in _warned:  # read twice at start: warned once
                _warned.add((str(path), number))
                log.warning("%s: line %d is not a journal line (%s: %s); skipped: %.120r",
                            path, number, type(e).__name__, e, line)
    return books


def quarantined_uids(data_dir: Path, max_attempts: int) -> set[str]:
    """Turns that must not be trained: quarantined, or failed `max_attempts` times (a crash the
    server has not restarted after yet, so no `quarantined` line was written)."""
    books = read_journal(data_dir)
    for start in books.open_steps.values():
        books.died(start)
    return set(books.quarantined) | {u for u, n in books.failures.items() if n >= max_attempts}


class StepJournal:
    """Appends the journal's lines and keeps its counts; one per trainer."""

    def __init__(self, data_dir: Path, fsync: bool = True, max_attempts: int = 2,
                 books: Books | None = None):
        """BOOKS: the journal as read at start-up (training/restart.py `read_start`); None
        reads it now (a journal built alone, as tests and tools do)."""
        self.max_attempts = max_attempts
        books = read_journal(data_dir) if books is None else books
        self.failures, self.suspects, self.quarantined = (books.failures, books.suspects,
                                                          books.quarantined)
        self._n = books.last
        self.failed_steps = 0  # in this process
        self.clean_steps = 0  # in this process: one makes it proven
        self._born = time.monotonic()
        self._streak: tuple[str, set[str]] = ("", set())  # (error type, turns) failing in a row
        self.open: tuple[int, list[str]] | None = None  # the step started, update not applied
        self.writer = JsonlWriter(Path(data_dir) / JOURNAL, fsync=fsync)
        self._unwritten: list[dict] = []  # lines a full disk refused, written before the next
        self._writing = threading.Lock()
        for n, start in sorted(books.open_steps.items()):  # the last run died inside these
            charged = books.died(start)
            self._write({"kind": "step_end", "n": n, "ok": False, "error": DIED,
                         "died": True, "charged": charged, "time": time.time()})
            if charged:
                log.warning("the last run died during training step %d (turns %s) after it "
                            "had trained cleanly: each turn is charged an attempt, retried "
                            "alone, or quarantined", n, ", ".join(start["uids"]))
                for uid in start["uids"]:
                    self._quarantine_if_spent(uid, DIED)
            else:
                log.warning("the last run died during training step %d (turns %s) before "
                            "it had trained cleanly: no turn is charged; each waits for a "
                            "clean step, then is retried alone", n, ", ".join(start["uids"]))
        for uid in list(self.failures):  # e.g. died between a step's end and its quarantine
            self._quarantine_if_spent(uid, "an earlier run's failures")

    @property
    def proven(self) -> bool:
        """Whether a death now would be this step's fault: this process has ended a step
        cleanly, or has run CLEAN_RUN_S."""
        return self.clean_steps > 0 or time.monotonic() - self._born >= CLEAN_RUN_S

    def suspect(self, uid: str) -> bool:
        """UID was in a step an unproven process died in: it waits until this one is proven."""
        return self.suspects[uid] > 0

    def tries(self, uid: str) -> int:
        """Failed tries of UID so far, charged or not."""
        return self.failures[uid] + self.suspects[uid]

    def start(self, uids: list[str], tokens: int) -> int:
        """Journal a step over UIDS (TOKENS prompt + completion ids in all) before it runs, after
        any line a full disk refused before (WriteFailed: no step, nothing runs)."""
        self._flush()
        self.writer.write({"kind": "step_start", "n": self._n + 1, "uids": uids,
                           "attempt": 1 + max(self.tries(u) for u in uids), "tokens": tokens,
                           "proven": self.proven, "time": time.time()})
        self._n += 1  # only once on disk: a start that failed to write is no step
        self.open = (self._n, uids)
        return self._n

    def applied(self) -> None:
        """The open step's update is applied (or there was none to apply): it ended ok."""
        if self.open is not None:
            self.end(*self.open)

    def end(self, n: int, uids: list[str], error: str | None = None,
            charge: bool = True) -> None:
        """Step N ended (ERROR: it raised; CHARGE: the turns lose an attempt for it). Never
        raises for a full disk: the line waits for the next start (`_write`)."""
        self.open = None
        self._write({"kind": "step_end", "n": n, "ok": error is None, "error": error,
                     "charged": charge, "time": time.time()})
        if error is None:
            self._streak = ("", set())
            self.clean_steps += 1
            for uid in uids:
                self.suspects.pop(uid, None)
        else:
            self.failed_steps += 1
            if charge:
                self._charge(uids, error)

    def stopped(self) -> None:
        """The process stops with a step still running (the stop ended it between two units, or
        gave up waiting for it): it ends uncharged, so the next start does not book it as a
        death."""
        if self.open is not None:
            n, self.open = self.open[0], None
            self._write({"kind": "step_end", "n": n, "ok": False, "error": STOPPED,
                         "charged": False, "stopped": True, "time": time.time()})

    def systemic(self, uids: list[str], error_type: str) -> bool:
        """Whether this failure makes SYSTEMIC_TURNS different turns in a row failing with
        ERROR_TYPE: a cause outside the turns (an unsupported model, a bug), so quarantining
        each would empty the queue. The count starts over after it says so."""
        kind, turns = self._streak
        turns = (turns if kind == error_type else set()) | set(uids)
        self._streak = ("", set()) if len(turns) >= SYSTEMIC_TURNS else (error_type, turns)
        return len(turns) >= SYSTEMIC_TURNS

    def resumed(self, step: int, lost_steps: int, uids: list[str]) -> None:
        """The trainer resumed from checkpoint STEP; LOST_STEPS steps after it are redone."""
        self._write({"kind": "resumed", "step": step, "lost_steps": lost_steps,
                     "retrain": uids, "time": time.time()})

    def quarantine(self, uid: str, reason: str) -> None:
        """Never train UID again: one `quarantined` line (also for a turn known to crash the
        process, quarantined before any attempt)."""
        if uid not in self.quarantined:
            self.quarantined[uid] = reason
            self._write({"kind": "quarantined", "uid": uid, "reason": reason,
                         "attempts": self.failures[uid], "time": time.time()})
            log.warning("turn %s quarantined, never to be trained: %s", uid, reason)

    def _charge(self, uids: list[str], reason: str) -> None:
        for uid in uids:
            self.failures[uid] += 1
            self._quarantine_if_spent(uid, reason)

    def _quarantine_if_spent(self, uid: str, reason: str) -> None:
        if self.failures[uid] >= self.max_attempts:
            self.quarantine(uid, f"{self.failures[uid]} failed attempts; the last: {reason}")

    def _write(self, line: dict) -> None:
        """LINE after those a full disk refused before; one refused now waits for the next."""
        with self._writing:
            self._unwritten.append(line)
        try:
            self._flush()
        except WriteFailed as e:  # the error is on /healthz (records.failing)
            log.error("%d journal lines wait for disk space: %s", len(self._unwritten), e)

    def _flush(self) -> None:
        with self._writing:  # the trainer thread, and a stop that gave up waiting for it
            while self._unwritten:
                self.writer.write(self._unwritten[0])
                self._unwritten.pop(0)

    def close(self) -> None:
        try:
            self._flush()
        except WriteFailed as e:
            log.error("%d journal lines could not be written before stopping: %s",
                      len(self._unwritten), e)
        self.writer.close()


def lost_steps(lines: list[dict], step: int) -> tuple[int, set[str]]:
    """(the steps training.jsonl's LINES record after checkpoint STEP, their turns): a kill
    loses the updates since the last save. A rollback takes a step number too."""
    steps = [ln for ln in lines if ln.get("kind") in ("step", "rollback")]
    at = [i for i, ln in enumerate(steps) if ln.get("step") == step]  # its last run's line
    cut = at[-1] + 1 if at else (0 if step == 0 else len(steps))
    return len(steps) - cut, {u for ln in steps[cut:] for u in uids_of(ln)}


def uids_of(line: dict) -> list[str]:
    """The keys a training.jsonl line names (its `uids`); none from a line that is odd."""
    uids = line.get("uids")
    return [u for u in uids if isinstance(u, str)] if isinstance(uids, list) else []


def outside_vocab(turn: dict, vocab_size: int | None, choice: int | None = None) -> int | None:
    """The first token id of TURN's prompt or completion CHOICE (default: the chosen one) that
    is not below VOCAB_SIZE (None also for a record too malformed to say: its step raises, and
    that is handled)."""
    if vocab_size is None:
        return None
    try:
        choice = turn["choices"][turn.get("chosen_choice", 0) if choice is None else choice]
        return next((i for ids in (turn["prompt_ids"], choice["completion_ids"]) for i in ids
                     if not 0 <= i < vocab_size), None)
    except (KeyError, IndexError, TypeError):
        return None


def turn_length(turn: dict, choice: int | None = None) -> int:
    """Prompt + completion CHOICE ids of a turn record; 0 for one too malformed to say (its step
    fails and the journal says why)."""
    try:
        choice = turn["choices"][turn.get("chosen_choice", 0) if choice is None else choice]
        return len(turn["prompt_ids"]) + len(choice["completion_ids"])
    except (KeyError, IndexError, TypeError):
        return 0
