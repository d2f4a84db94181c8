"""What the trainer's parts share: its status (a `Status` and a message: /healthz's trainer
`error`), whether training is paused, its counters (`TrainerStats`) and where it stands
(`Progress`: the step, the adapter version, the reward baseline, the step last saved).

The trainer (training/loop.py) makes one of each and hands them to its parts; each part changes
them on the trainer thread, and pause and unpause come from any thread. A status is cleared by
its own way out (a save that succeeds clears SAVE_FAILED, not a pause), never by matching the
message's words.

Not here: what changes them (training/runner.py, publisher.py, saving.py, control.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from enum import Enum


class Status(Enum):
    """What the trainer's message is about, and what clears it."""

    OK = "ok"
    WAITING_FOR_DISK = "waiting for disk"  # a full disk refused a batch's journal lines
    WAITING_FOR_LEARNER = "waiting for the learner"  # a learner elsewhere did not answer
    PAUSED = "paused"  # turns failing alike, or the eval gate: the operator's resume clears it
    SAVE_FAILED = "save failed"  # the next checkpoint saved clears it
    SYNC_FAILED = "sync failed"  # the run's weights did not come back: the next sync clears it
    FAILED_AFTER_UPDATE = "failed after an update"  # logged and kept: no retry could help
    DIED = "died"  # the trainer thread ended on an error


class TrainerStatus:
    """The status, its message, and the pause flag (an operator's pause has no message)."""

    def __init__(self) -> None:
        self.status: Status = Status.OK
        self.message: str | None = None
        self.paused = False
        self._lock = threading.Lock()  # the trainer thread against an operator's unpause

    def report(self, status: Status, message: str, pause: bool = False) -> None:
        with self._lock:
            self.status, self.message = status, message
            self.paused = self.paused or pause

    def clear(self, *statuses: Status) -> None:
        """Back to OK if the status is one of STATUSES; a newer one of another kind stays."""
        with self._lock:
            if self.status in statuses:
                self.status, self.message = Status.OK, None

    def unpause(self) -> None:
        """The operator says the cause is fixed: a pause's message goes with it."""
        with self._lock:
            self.paused = False
            if self.status is Status.PAUSED:
                self.status, self.message = Status.OK, None


@dataclass
class TrainerStats:
    """In this process. `steps` counts rollbacks too; `unevaluated_steps`: taken since the
    gate's last verdict; `skipped_steps`: batches with no signal, their turns in `skipped`."""

    steps: int = 0
    turns_trained: int = 0
    skipped: int = 0
    last_loss: float | None = None
    save_errors: int = 0
    errors_after_update: int = 0
    optimizer_steps: int = 0
    learning_rate: float | None = None
    evals: int = 0
    gate_rollbacks: int = 0
    unevaluated_steps: int = 0
    dropped: int = 0
    skipped_steps: int = 0


@dataclass
class Progress:
    """Where training stands. `step` numbers optimizer steps and rollbacks across restarts;
    `version` is the adapter version of the learner's weights; `baseline` and `baseline_n`: the
    running mean reward (--baseline mean) and how many rewards it took; `saved_step`: the step
    of the last checkpoint saved."""

    step: int = 0
    version: int = 0
    baseline: float = 0.0
    baseline_n: int = 0
    saved_step: int = 0
