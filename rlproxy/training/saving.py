"""The trainer's state across restarts and rollbacks: checkpoints saved and pruned, snapshots a
gate rollback restores, and `resume` at start-up.

  save      the learner writes the checkpoint (training/learner.py `save_state`) with the reward
            baseline and, with the eval gate, the served version; the oldest beyond
            keep_checkpoints are pruned, never the one a pending rollback will load (`pinned`)
            nor a PROTECTed one. `try_save` surfaces a failure (a full disk) as the status and
            the next save tries again.
  snapshot  the learner's state, the reward baseline and the step, in memory (the eval gate's
            good state); `restore` puts one back.
  resume    loads the newest checkpoint that can be read and publishes its adapter; where
            training goes on, and which turns train again, the learner says (`resume_point`:
            a kill loses the local learner's steps since the checkpoint, a run elsewhere keeps
            them). A partly unreadable checkpoint is set aside and saved again whole (put back
            if that save fails, so the newest weights stay listed).

Not here: the checkpoint format (training/checkpoints.py), when a step saves (training/runner.py)
or the gate does (training/publisher.py), an operator's rollback (training/control.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Callable

from rlproxy.paths import complete_checkpoints
from rlproxy.records import set_aside
from rlproxy.settings import Settings
from rlproxy.training import schedule
from rlproxy.training.books import Books
from rlproxy.training.checkpoints import UNREADABLE, prune_checkpoints
from rlproxy.training.learner import LayoutMismatch, Learner
from rlproxy.training.restart import version_of_step
from rlproxy.training.status import Progress, Status, TrainerStats, TrainerStatus

log = logging.getLogger("rlproxy.trainer")


def snapshot(learner: Learner, progress: Progress) -> dict:
    """The state a gate rollback restores: the learner's, the reward baseline, the step."""
    return {**learner.snapshot(), "baseline": [progress.baseline, progress.baseline_n],
            "step": progress.step}


class Saver:
    def __init__(self, settings: Settings, learner: Learner, progress: Progress,
                 status: TrainerStatus, stats: TrainerStats, gate, books: Books, data_dir: Path):
        self.t, self.learner, self.progress = settings.trainer, learner, progress
        self.status, self.stats, self.gate = status, stats, gate
        self.books, self.journal, self.data_dir = books, books.journal, data_dir
        self.lock = threading.Lock()  # a rollback request pins its checkpoint under it
        self.pinned: Path | None = None  # the checkpoint a pending rollback will load

    # ---- checkpoints ----

    def save(self, protect: Path | None = None) -> Path:
        p = self.progress
        metadata = {"baseline": [p.baseline, p.baseline_n]}
        if self.gate is not None:  # after a rollback: the served adapter, a newer step
            metadata["served_version"] = self.gate.served_version
        path = self.learner.save_state(p.step, p.version, metadata)
        with self.lock:  # request_rollback pins its target under it: a pending one stays
            pinned = {x.name for x in (protect, self.pinned) if x}
            pruned = prune_checkpoints(self.learner.checkpoints, self.t.keep_checkpoints, pinned)
        for folder in pruned:  # out of the listing already: deleted without holding the lock
            self.learner.forget_state(folder)  # a learner elsewhere: its state there goes too
            shutil.rmtree(folder, ignore_errors=True)
        p.saved_step = p.step  # only now: a failed save is tried again at the next one
        self.status.clear(Status.SAVE_FAILED)
        return path

    def try_save(self, protect: Path | None = None) -> Path | None:
        try:
            return self.save(protect)
        except Exception as e:  # e.g. a full disk: the step stands; the next save retries
            step = self.progress.step
            log.exception("could not save the checkpoint of step %d", step)
            self.stats.save_errors += 1
            self.status.report(Status.SAVE_FAILED, f"checkpoint save failed at step {step}: "
                               f"{type(e).__name__}: {e}")
            return None

    def save_if_due(self) -> None:
        """After a step: every save_interval steps (the eval gate saves its own)."""
        if self.progress.step % self.t.save_interval == 0 and self.gate is None:
            self.try_save()

    def save_unsaved(self) -> None:
        """When training ends. With the gate, steps after the last published adapter were never
        evaluated: they are not saved, and their turns train again after a restart."""
        p = self.progress
        if p.step and p.step != p.saved_step and self.gate is None:
            self.save()

    def snapshot(self) -> dict:
        return snapshot(self.learner, self.progress)

    def restore(self, snap: dict) -> None:
        self.learner.restore(snap)
        self.progress.baseline, self.progress.baseline_n = snap["baseline"]

    # ---- start-up ----

    def resume(self, publish: Callable[[int], None], lines: list[dict]) -> Path | None:
        """Load the newest checkpoint that can be read (with `resume` on) and PUBLISH its
        adapter's version; the turns of the steps the learner lost since train again (LINES:
        training.jsonl's, as read at start-up). Its path, or None.

        One whose adapter cannot be read is set aside (`<name>.corrupt-<time>`) and the next
        older one tried. One whose optimizer state or trainer_state.json cannot be read
        resumes from its weights with a fresh optimizer: set aside, then saved again whole;
        put back if that save fails (a full disk), so its weights stay the newest listed."""
        if not self.t.resume:
            return None
        path, state, problems, mismatched = None, None, [], []
        for candidate in reversed(complete_checkpoints(self.learner.checkpoints)):
            try:
                state, problems = self.learner.resume_state(candidate)
            except LayoutMismatch as e:
                mismatched.append((candidate, e))
                continue
            except UNREADABLE as e:
                set_aside(candidate, f"its adapter: {type(e).__name__}: {e}")
                continue
            path = candidate
            break
        if mismatched and path is None:
            raise ValueError(
                f"the newest checkpoint, {mismatched[0][0]}, holds an adapter for another model "
                "or LoRA layout than this one (--model, --lora-rank, --lora-layers, "
                "--lora-keys); use another --data-dir, or move its checkpoints/ folder away")
        for bad, e in mismatched:  # newer than an intact one of this layout: rotten
            set_aside(bad, f"its adapter does not fit this model ({e})")
        p = self.progress
        if path is None:
            self._go_on_from(0, p.version, lines)
            return None
        if state is None:  # the weights, without their trainer_state.json
            step = int(path.name[5:])
            state = {"step": step, "adapter_version": version_of_step(lines, step)}
        p.baseline, p.baseline_n = state.get("baseline", [0.0, 0])
        self._go_on_from(state["step"], state["adapter_version"], lines)
        self.learner.lr_scale = state.get("lr_scale", 1.0)
        if state.get("schedule", schedule.describe(self.t)) != schedule.describe(self.t):
            log.warning("the learning-rate schedule differs from checkpoint %s's (%s); the "
                        "settings' is used from its update count on", path.name,
                        state["schedule"])
        # a gate rollback's checkpoint holds the served adapter under a newer step's version
        served = state.get("served_version", p.version)
        publish(served)
        if problems:
            log.warning("checkpoint %s: %s; resumed from its weights with a fresh optimizer "
                        "(its moments and update count start over)", path, "; ".join(problems))
            aside = set_aside(path, "; ".join(problems))
            if self.try_save() is None and not path.exists():  # the same step again, whole
                os.replace(aside, path)
                log.warning("%s is back in place until a save of step %d succeeds", path,
                            p.step)
        log.info("resumed from %s (step %d, adapter version %d)", path, p.step, served)
        return path

    def _go_on_from(self, step: int, version: int, lines: list[dict]) -> None:
        """Training goes on after checkpoint STEP (0: none) of adapter VERSION where the
        learner says; the turns of the steps it lost are trained again (their lines stay in
        training.jsonl; the journal's `resumed` line names them)."""
        point = self.learner.resume_point(lines, step, version)
        if point.lost:
            self.books.retrain(point.lost)
            self.journal.resumed(step, point.lost_steps, sorted(point.lost))
            log.warning("resuming from step %d: the %d turns trained after it are trained "
                        "again", step, len(point.lost))
        self.progress.step, self.progress.version = point.step, point.version
        self.progress.saved_step = point.step
