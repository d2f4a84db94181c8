"""The training journal: which turns each optimizer step is about to train, and how it ended.

Before the trainer runs a step it appends `{"kind": "step_start", "n", "uids", "attempt"}`, and
after it `{"kind": "step_end", "n", "ok", "error"}`; both are on disk (fsync'ed, like every record
line unless --no-fsync) before the trainer goes on, so a start without an end means the process
died inside that step (killed, out of memory, crashed). The next start-up finds it and ends it
with `"died": true`. Each failed step costs every turn in it one attempt; a turn that reaches
`max_attempts` gets one `{"kind": "quarantined", "uid", "reason"}` line and is never trained
again: a poison turn costs at most `max_attempts` crashes, never a crash loop.

This module keeps the books, plus two checks on a turn record (`outside_vocab`: ids that would
crash MLX rather than raise; `turn_length`); the trainer decides what to run and retry
(trainer.py `train_journaled`). The file is `train_journal.jsonl` in the data dir, append-only.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path

from rlproxy.records import JsonlWriter, read_jsonl

log = logging.getLogger("rlproxy.trainer")
JOURNAL = "train_journal.jsonl"
DIED = "the process died during this step (killed, out of memory or crashed)"


def read_journal(data_dir: Path) -> tuple[Counter, dict[str, str], dict[int, dict], int]:
    """(failed attempts per uid, quarantined uid -> reason, steps started and never ended,
    highest step number) from DATA_DIR's journal. Steps that never ended are not counted yet."""
    failures: Counter = Counter()
    quarantined: dict[str, str] = {}
    open_steps: dict[int, dict] = {}
    last = 0
    for line in read_jsonl(Path(data_dir) / JOURNAL):
        kind = line.get("kind")
        if kind == "step_start":
            open_steps[line["n"]] = line
            last = max(last, line["n"])
        elif kind == "step_end":
            start = open_steps.pop(line["n"], None)
            if start is not None and not line["ok"]:
                failures.update(start["uids"])
        elif kind == "quarantined":
            quarantined[line["uid"]] = line["reason"]
    return failures, quarantined, open_steps, last


def quarantined_uids(data_dir: Path, max_attempts: int) -> set[str]:
    """Turns that must not be trained: quarantined, or failed `max_attempts` times (a crash the
    server has not restarted after yet, so no `quarantined` line was written)."""
    failures, quarantined, open_steps, _ = read_journal(data_dir)
    for start in open_steps.values():
        failures.update(start["uids"])
    return set(quarantined) | {u for u, n in failures.items() if n >= max_attempts}


class StepJournal:
    """Appends the journal's lines and keeps its counts; one per trainer."""

    def __init__(self, data_dir: Path, fsync: bool = True, max_attempts: int = 2):
        self.max_attempts = max_attempts
        self.failures, self.quarantined, open_steps, self._n = read_journal(data_dir)
        self.failed_steps = 0  # in this process
        self.writer = JsonlWriter(Path(data_dir) / JOURNAL, fsync=fsync)
        for n, start in sorted(open_steps.items()):  # the last run died inside these steps
            self.writer.write({"kind": "step_end", "n": n, "ok": False, "error": DIED,
                               "died": True, "time": time.time()})
            log.warning("the last run died during training step %d (turns %s); each is "
                        "retried alone, or quarantined", n, ", ".join(start["uids"]))
            self._charge(start["uids"], DIED)
        for uid in list(self.failures):  # e.g. died between a step's end and its quarantine
            self._quarantine_if_spent(uid, "an earlier run's failures")

    def start(self, uids: list[str], tokens: int) -> int:
        """Journal a step over UIDS (TOKENS prompt + completion ids in all) before it runs."""
        self._n += 1
        self.writer.write({"kind": "step_start", "n": self._n, "uids": uids,
                           "attempt": 1 + max(self.failures[u] for u in uids), "tokens": tokens,
                           "time": time.time()})
        return self._n

    def end(self, n: int, uids: list[str], error: str | None = None) -> None:
        self.writer.write({"kind": "step_end", "n": n, "ok": error is None, "error": error,
                           "time": time.time()})
        if error is not None:
            self.failed_steps += 1
            self._charge(uids, error)

    def resumed(self, step: int, lost_steps: int, uids: list[str]) -> None:
        """The trainer resumed from checkpoint STEP; LOST_STEPS steps after it are redone."""
        self.writer.write({"kind": "resumed", "step": step, "lost_steps": lost_steps,
                           "retrain": uids, "time": time.time()})

    def quarantine(self, uid: str, reason: str) -> None:
        """Never train UID again: one `quarantined` line (also for a turn known to crash the
        process, quarantined before any attempt)."""
        if uid not in self.quarantined:
            self.writer.write({"kind": "quarantined", "uid": uid, "reason": reason,
                               "attempts": self.failures[uid], "time": time.time()})
            self.quarantined[uid] = reason
            log.warning("turn %s quarantined, never to be trained: %s", uid, reason)

    def _charge(self, uids: list[str], reason: str) -> None:
        for uid in uids:
            self.failures[uid] += 1
            self._quarantine_if_spent(uid, reason)

    def _quarantine_if_spent(self, uid: str, reason: str) -> None:
        if self.failures[uid] >= self.max_attempts:
            self.quarantine(uid, f"{self.failures[uid]} failed attempts; the last: {reason}")

    def close(self) -> None:
        self.writer.close()


def outside_vocab(turn: dict, vocab_size: int | None) -> int | None:
    """The first token id of TURN's prompt or chosen completion that is not below VOCAB_SIZE
    (None also for a record too malformed to say: its step raises, and that is handled)."""
    if vocab_size is None:
        return None
    try:
        choice = turn["choices"][turn.get("chosen_choice", 0)]
        return next((i for ids in (turn["prompt_ids"], choice["completion_ids"]) for i in ids
                     if not 0 <= i < vocab_size), None)
    except (KeyError, IndexError, TypeError):
        return None


def turn_length(turn: dict) -> int:
    """Prompt + completion ids of a turn record; 0 for one too malformed to say (its step fails
    and the journal says why)."""
    try:
        choice = turn["choices"][turn.get("chosen_choice", 0)]
        return len(turn["prompt_ids"]) + len(choice["completion_ids"])
    except (KeyError, IndexError, TypeError):
        return 0
