"""What the trainer starts from after a restart, and what it reads back from training.jsonl: the
keys it lists as handled, the adapter version of a step, the last step recorded, and the turns of
a learner's run's steps that a restart of that learner lost.

`read_start` reads the trainer's two files once each at start-up (recovery.py calls it, with the
other record files): the step journal's books and the lines of training.jsonl that name steps or
turns. The rest are pure functions of those lines.

Not here: the journal's books (training/journal.py `read_journal`, `lost_steps`), checkpoints
(training/checkpoints.py), what the trainer does with them (training/saving.py `resume`,
training/runner.py `train_again`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rlproxy.lru import LRU
from rlproxy.paths import TRAINING
from rlproxy.records import read_jsonl
from rlproxy.training.journal import Books, read_journal, uids_of

KEPT = ("kind", "step", "adapter_version", "run_step", "uids")  # what the functions below read


@dataclass
class TrainerStart:
    """The trainer's own records, read once at start-up: the journal's books and training.jsonl's
    lines (only the fields in KEPT). Empty: a fresh data dir."""

    journal: Books = field(default_factory=Books)
    lines: list[dict] = field(default_factory=list)


def read_start(data_dir: Path) -> TrainerStart:
    """DATA_DIR's train_journal.jsonl and training.jsonl, each read once."""
    return TrainerStart(read_journal(data_dir), read_training(data_dir))


def read_training(data_dir: Path) -> list[dict]:
    """training.jsonl's lines, each cut to the fields in KEPT."""
    return [{k: ln[k] for k in KEPT if k in ln}
            for ln in read_jsonl(Path(data_dir) / TRAINING, report_cut=True)]


def handled_keys(lines: list[dict]) -> LRU:
    """Every key training.jsonl's LINES list as trained (a `step` line) or skipped for good (a
    batch with no signal), oldest first."""
    keys = LRU()
    for line in lines:
        for uid in uids_of(line):
            keys.add(uid)
    return keys


def version_of_step(lines: list[dict], step: int) -> int:
    """The adapter version training.jsonl's LINES give step STEP (its last line for it), else
    STEP: for a checkpoint whose trainer_state.json was lost."""
    versions = [ln.get("adapter_version") for ln in lines
                if ln.get("kind") in ("step", "rollback") and ln.get("step") == step]
    return versions[-1] if versions and isinstance(versions[-1], int) else step


def last_recorded(lines: list[dict], step: int, version: int) -> tuple[int, int]:
    """(step, adapter version) of the last step or rollback line of LINES past STEP, else
    (STEP, VERSION)."""
    for ln in reversed(lines):
        if (ln.get("kind") in ("step", "rollback") and isinstance(ln.get("step"), int)
                and isinstance(ln.get("adapter_version"), int) and ln["step"] > step):
            return ln["step"], ln["adapter_version"]
    return step, version


def lost_run_steps(lines: list[dict], saved: int, last: int) -> set[str]:
    """The keys of this replica's steps whose run steps were SAVED+1 .. LAST, since the last
    `train_again` line of LINES (steps of an earlier learner lifetime were handled then)."""
    since = max((i for i, ln in enumerate(lines) if ln.get("kind") == "train_again"),
                default=-1)
    return {u for ln in lines[since + 1:] if ln.get("kind") == "step"
            and isinstance(ln.get("run_step"), int) and saved < ln["run_step"] <= last
            for u in ln.get("uids") or [] if isinstance(u, str)}
