"""What the trainer reads back from training.jsonl after a restart, as pure functions of the
data dir: the keys it lists as handled, the adapter version of a step, the last step recorded,
and the turns of a learner's run's steps that a restart of that learner lost.

Not here: the journal's books (training/journal.py `read_journal`, `lost_steps`), checkpoints
(training/checkpoints.py), what the trainer does with them (training/saving.py `resume`,
training/runner.py `train_again`).
"""

from __future__ import annotations

from pathlib import Path

from rlproxy.lru import LRU
from rlproxy.paths import TRAINING
from rlproxy.records import read_jsonl
from rlproxy.training.journal import uids_of


def handled_keys(data_dir: Path) -> LRU:
    """Every key training.jsonl lists as trained (a `step` line) or skipped for good (a batch
    with no signal), oldest first."""
    keys = LRU()
    for line in read_jsonl(Path(data_dir) / TRAINING, report_cut=True):
        for uid in uids_of(line):
            keys.add(uid)
    return keys


def version_of_step(data_dir: Path, step: int) -> int:
    """The adapter version training.jsonl gives step STEP (its last line for it), else STEP:
    for a checkpoint whose trainer_state.json was lost."""
    lines = read_jsonl(Path(data_dir) / TRAINING, report_cut=True)
    versions = [ln.get("adapter_version") for ln in lines
                if ln.get("kind") in ("step", "rollback") and ln.get("step") == step]
    return versions[-1] if versions and isinstance(versions[-1], int) else step


def last_recorded(data_dir: Path, step: int, version: int) -> tuple[int, int]:
    """(step, adapter version) of training.jsonl's last step or rollback line past STEP, else
    (STEP, VERSION)."""
    for ln in reversed(list(read_jsonl(Path(data_dir) / TRAINING, report_cut=True))):
        if (ln.get("kind") in ("step", "rollback") and isinstance(ln.get("step"), int)
                and isinstance(ln.get("adapter_version"), int) and ln["step"] > step):
            return ln["step"], ln["adapter_version"]
    return step, version


def lost_run_steps(data_dir: Path, saved: int, last: int) -> set[str]:
    """The keys of this replica's steps whose run steps were SAVED+1 .. LAST, since the last
    `train_again` line (steps of an earlier learner lifetime were handled then)."""
    lines = list(read_jsonl(Path(data_dir) / TRAINING, report_cut=True))
    since = max((i for i, ln in enumerate(lines) if ln.get("kind") == "train_again"),
                default=-1)
    return {u for ln in lines[since + 1:] if ln.get("kind") == "step"
            and isinstance(ln.get("run_step"), int) and saved < ln["run_step"] <= last
            for u in ln.get("uids") or [] if isinstance(u, str)}
