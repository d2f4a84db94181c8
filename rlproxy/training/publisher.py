"""From the learner to the engine: which adapter is served, and when.

  after_step  after every optimizer step: without the eval gate the step's weights are
              published as its version, every `learner.publish_every` steps (a learner
              elsewhere: --sync-every); with the gate nothing is, until an evaluation passes.
  publish     the learner's weights for a version (`learner.weights_for`: at hand, or brought
              back from a learner elsewhere) to the engine. Weights that cannot be brought back
              now leave the version `unsynced`: serving goes on with the last good adapter,
              the status says why, and `idle` tries again every SYNC_RETRY_S.
  idle        between batches while none is ready: that retry, or a look for what other
              replicas trained on a shared run (every `learner.check_every`; not with the gate,
              where a replica serves only what its own gate passed), published as a new version.
  the gate    `evaluate_if_due` runs the eval gate (training/gate.py) on the candidate every
              eval_every steps and applies its verdict: publish it (and save: the good state's
              checkpoint), or restore the good state, multiply the learning-rate scale, write a
              `rollback` line, and pause after max_rollbacks in a row. A learner elsewhere that
              cannot answer is waited for with backoff, and the verdict applied again (the
              candidate is not evaluated twice).

Not here: the gate's measurements (training/gate.py), the engine's swap (serving/engine.py),
checkpoints (training/saving.py).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

from rlproxy.records import JsonlWriter
from rlproxy.training import control
from rlproxy.training.gate import Verdict
from rlproxy.training.learner import Learner, LearnerRefused, LearnerUnavailable
from rlproxy.training.saving import Saver
from rlproxy.training.status import Progress, Status, TrainerStats, TrainerStatus

log = logging.getLogger("rlproxy.trainer")
SYNC_RETRY_S = 5.0  # weights that did not come back are tried again after this


class Publisher:
    """RESTORE(snapshot) puts the gate's good state back; RUNNING(): whether the trainer
    thread runs (a learner that cannot answer is waited for only then)."""

    def __init__(self, learner: Learner, engine, gate, saver: Saver, progress: Progress,
                 status: TrainerStatus, stats: TrainerStats, writer: JsonlWriter,
                 restore: Callable[[dict], None], running: Callable[[], bool]):
        self.learner, self.engine, self.gate, self.saver = learner, engine, gate, saver
        self.progress, self.status, self.stats, self.writer = progress, status, stats, writer
        self.restore, self.running = restore, running
        self.unsynced: int | None = None  # a version whose weights did not come back
        self.last_sync = 0.0  # time.monotonic() of the last time the weights were fetched
        self.good_path: Path | None = None  # the checkpoint of the gate's good state, if saved

    # ---- publishing ----

    def after_step(self) -> bool:
        """After an optimizer step: whether its version was published."""
        if self.gate is not None:  # published only once an evaluation passes it (gate.py)
            self.gate.stepped()
            self.stats.unevaluated_steps = self.gate.since
            return False
        if self.progress.step % self.learner.publish_every:
            return False
        self.publish(self.progress.version)
        return True

    def publish(self, version: int, weights: dict | None = None) -> None:
        """Hand the engine the learner's adapter (or WEIGHTS, the ones the eval gate measured)
        as VERSION (the arrays are evaluated)."""
        if weights is None:
            weights = self.fetch(version)
            if weights is None:  # not brought back (retried), or --sampler tinker's path
                return
        if self.engine is not None:
            self.engine.publish_adapter(weights, version)
        if self.gate is not None:  # this state is now the good one
            self.gate.published(version, weights, self.saver.snapshot())
            self.stats.unevaluated_steps = 0

    def fetch(self, version: int) -> dict | None:
        """The learner's weights to publish as VERSION, or None: not brought back now (the
        status says why; `idle` retries), or --sampler tinker's (the engine was pointed at
        them)."""
        self.last_sync = time.monotonic()
        try:
            weights = self.learner.weights_for(self.engine, version)
        except (LearnerUnavailable, ValueError) as e:  # down, or weights that do not fit
            message = f"weights sync for version {version} failed: {e}"
            self.status.report(Status.SYNC_FAILED, message)
            log.error(message)
            self.unsynced = version
            return None
        self.status.clear(Status.SYNC_FAILED)
        self.unsynced = None
        return weights

    def publish_resumed(self, version: int) -> None:
        """At start-up: the resumed checkpoint's adapter as VERSION. A learner elsewhere that
        is away: the checkpoint's adapter (the learner holds it) is served until the run's
        weights come back (`idle` retries them), never the bare base model."""
        self.publish(version)
        if self.unsynced is not None and self.engine is not None:
            self.engine.publish_adapter(self.learner.weights, version)

    def idle(self) -> float | None:
        """While no batch is ready: retry weights that did not come back, or look for other
        replicas' steps. The seconds until the next is due; None: nothing will be."""
        every = self.learner.check_every  # None: no one else trains this adapter
        behind = self.unsynced is not None
        if not behind and (every is None or self.gate is not None):
            return every
        due = SYNC_RETRY_S if behind else every
        left = due - (time.monotonic() - self.last_sync)
        if left > 0:
            return left
        if behind:
            self.publish(self.unsynced)
            return SYNC_RETRY_S
        self.last_sync = time.monotonic()
        try:
            weights = self.learner.fetch_changed()
        except (LearnerUnavailable, ValueError) as e:
            log.warning("could not check the run for new weights: %s", e)
            return every
        if weights is not None:
            self.progress.version += 1
            if self.engine is not None:
                self.engine.publish_adapter(weights, self.progress.version)
            log.info("the run's weights changed elsewhere: serving them as version %d",
                     self.progress.version)
        return every

    def sync_now(self) -> None:
        """At start-up: bring back the run's weights now (a new version if they differ from
        what the engine serves). A resumed version that could not be brought back stays
        `unsynced`, and is retried until the learner answers."""
        self.last_sync = float("-inf")
        self.idle()

    # ---- the eval gate ----

    def evaluate_if_due(self) -> None:
        if self.gate is not None and self.gate.due:
            self.evaluate_or_wait()

    def evaluate_or_wait(self) -> None:
        """`evaluate`; a learner elsewhere that cannot answer (its weights, a rollback to the
        good state) is waited for with backoff, and the verdict applied again (one `eval` line,
        one count towards the rollbacks in a row)."""
        tries, verdict = 0, None
        while self.running():
            try:
                if verdict is None:
                    verdict = self.judge()
                self.apply_verdict(verdict)
                break  # the learner answered: its error goes, below
            except LearnerRefused as e:  # e.g. no good state on the learner to go back to
                message = f"training paused: the eval gate: {e}; resume to go on"
                self.status.report(Status.PAUSED, message, pause=True)
                log.error(message)
                return
            except LearnerUnavailable as e:
                tries += 1
                wait = control.backoff(tries)
                message = (f"training waits for the learner (try {tries}, next in {wait:g} s): "
                           f"the eval gate: {e}")
                self.status.report(Status.WAITING_FOR_LEARNER, message)
                log.error(message)
                time.sleep(wait)
        self.status.clear(Status.WAITING_FOR_LEARNER)

    def evaluate(self) -> dict:
        """Run the eval gate on the candidate and apply its verdict: publish it, or roll back
        to the good state. The `eval` line."""
        verdict = self.judge()
        self.apply_verdict(verdict)
        return verdict.line

    def judge(self) -> Verdict:
        """The eval gate's verdict on the candidate, its `eval` line written."""
        verdict = self.gate.check(self.progress.step, self.progress.version)
        self.stats.evals += 1
        self.writer.write(verdict.line)
        return verdict

    def apply_verdict(self, verdict: Verdict) -> None:
        if verdict.passed:  # what was measured: a shared run may have moved on since
            self.publish(self.progress.version, verdict.candidate)
            self.good_path = self.saver.try_save()
            log.info("eval gate: adapter v%d published (probe reward %s)", self.progress.version,
                     verdict.line["candidate"]["reward"])
        else:
            self.gate_rollback(verdict)

    def gate_rollback(self, verdict: Verdict) -> None:
        """Restore the good state, lower the learning rate, write the `rollback` line; pause
        training when the verdict says so. Nothing is published: the served adapter is the
        good one already."""
        good, reason, served = verdict.good, verdict.line["refused"], self.gate.served_version
        p, rejected = self.progress, self.progress.version
        self.restore(good)
        self.learner.lr_scale *= verdict.lr_factor
        p.step += 1  # a step number of its own, as an operator's rollback
        self.stats.unevaluated_steps = 0
        self.stats.gate_rollbacks += 1
        self.stats.steps = p.step
        line = {"kind": "rollback", "gate": True, "step": p.step,
                "adapter_version": served, "rejected_version": rejected,
                "checkpoint": str(self.good_path) if self.good_path else None,
                "checkpoint_step": good["step"], "checkpoint_adapter_version": served,
                "reason": reason, "candidate": verdict.line.get("candidate"),
                "served": verdict.line.get("served"), "lr_scale": self.learner.lr_scale,
                "next_learning_rate": self.learner.learning_rate(),
                "in_a_row": verdict.in_a_row, "training": True, "time": time.time()}
        self.writer.write(line)
        log.info("eval gate: candidate v%d refused (%s); rolled back to step %d's adapter "
                 "v%d, learning rate x%g", rejected, reason, good["step"], served,
                 self.learner.lr_scale)
        # saved: a restart neither trains the refused steps' turns again nor forgets the rate
        self.saver.try_save(protect=self.good_path)
        if verdict.pause:
            message = (f"training paused: {verdict.in_a_row} rollbacks in a row by the eval "
                       f"gate; the last: {reason}. Resume training (POST /v1/training/resume)"
                       f" to go on at {self.learner.lr_scale:g} x the learning rate")
            self.status.report(Status.PAUSED, message, pause=True)
            self.writer.write({"kind": "pause", "step": p.step, "reason": message,
                               "time": time.time()})
            log.error(message)
