"""The trainer: scored turns in, LoRA updates out, each published to the engine as version v+1.

One long-lived thread runs one loop over the trainer's parts, each the one owner of its state:

    batch = books.next_batch(size, idle=publisher.idle)   # which items (training/books.py)
    operator.between_batches()      # a rollback or checkpoint asked for; a pause holds here
    outcome = runner.run(batch)     # steps, retried (training/runner.py); each one handed to
                                    # publisher.after_step (training/publisher.py)
    books.settle(batch, again=outcome.wait is not None)   # a waiting batch goes back ...
    if outcome.wait: sleep(outcome.wait.delay); continue  # ... and is tried after the delay
    publisher.evaluate_if_due()     # the eval gate: publish the candidate, or roll back

It trains on the exact recorded ids and behaviour log-probs, never re-tokenizing, and writes
training.jsonl. What it shares (the status on /healthz, the counters, the step and version) is in
training/status.py; checkpoints and resume are the saver's (training/saving.py); where the learner
is, in this process, on the ranks of an mlx.launch (training/distributed.py) or elsewhere
(remote/learner.py), only the learner knows (training/learner.py `Learner`). Offline training
(`rlproxy train --from DATA_DIR`) uses the same `train_journaled`.

Not here: the gradient math and the optimizer (training/learner.py), the gate's measurements
(training/gate.py), the operator's HTTP side (api/admin.py).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path

import mlx.nn as nn

from rlproxy.lru import LRU
from rlproxy.mlx_threads import mlx_thread
from rlproxy.paths import CHECKPOINTS, TRAINING
from rlproxy.records import JsonlWriter
from rlproxy.settings import Settings
from rlproxy.training import distributed, restart
from rlproxy.training.books import Books, Offered
from rlproxy.training.control import Operator
from rlproxy.training.gate import make_gate
from rlproxy.training.items import item_key, released_turns
from rlproxy.training.journal import StepJournal
from rlproxy.training.learner import LocalLearner, training_copy
from rlproxy.training.pacing import Pacer, StepTurns
from rlproxy.training.publisher import Publisher
from rlproxy.training.runner import StepRunner
from rlproxy.training.saving import Saver, snapshot
from rlproxy.training.status import Progress, Status, TrainerStats, TrainerStatus

__all__ = ["Trainer", "TrainerStats", "released_turns", "training_copy"]  # app.py and cli.py's
log = logging.getLogger("rlproxy.trainer")
# After --drain-timeout-s, a stop waits this much longer for the unit in progress (an MLX thread
# still computing at interpreter exit aborts the process), then ends the step uncharged.
STOP_WAIT_S = 120.0


class Trainer:
    """The trainer thread and the parts its loop runs."""

    def __init__(self, settings: Settings, model: nn.Module | None, lora_config: dict,
                 engine=None, data_dir: Path | None = None, ref_model: nn.Module | None = None,
                 vocab_size: int | None = None, tokenizer=None, learner=None, ranks=None,
                 start: restart.TrainerStart | None = None, turns: StepTurns | None = None):
        """START: its records as read at start-up (recovery.py `trainer_start`); None reads them
        now (a trainer built alone, as tests and tools do). TURNS: shared with the process's
        other trainers (personal adapters), one step at a time (training/pacing.py)."""
        t = self.t = settings.trainer
        self.settings, self.engine = settings, engine
        self.data_dir = Path(data_dir or settings.records.data_dir)
        # the learner in this process, on the ranks of an mlx.launch (RANKS: rank 0's link to
        # the others, training/distributed.py), or elsewhere (remote/learner.py)
        self.learner = learner or (
            LocalLearner(settings, model, lora_config, self.data_dir / CHECKPOINTS, ref_model)
            if ranks is None else distributed.ParallelLearner(
                settings, model, lora_config, self.data_dir / CHECKPOINTS, ref_model, ranks))
        self.progress = Progress(version=engine.adapter_version if engine is not None else 0)
        self.status, self.stats = TrainerStatus(), TrainerStats()
        self.writer = JsonlWriter(self.data_dir / TRAINING, fsync=settings.records.fsync,
                                  stamp=self.learner.record_stamp)
        start = restart.read_start(self.data_dir) if start is None else start
        # the journal's books, taken before anything is resubmitted (turns a crashed step held
        # are retried, or quarantined once they have had their attempts), and the keys
        # training.jsonl lists as handled (all of them until `start` bounds them)
        self.books = Books(StepJournal(self.data_dir, settings.records.fsync,
                                       t.max_step_attempts, start.journal),
                           restart.handled_keys(start.lines))
        self._lines: list[dict] | None = start.lines  # for `resume`, then dropped
        self.journal = self.books.journal
        self.pacer = Pacer(engine.busy if engine is not None else None, t.duty_cycle)
        self.gate = None  # the eval gate (training/gate.py), with eval_every and an engine
        if t.eval_every and engine is not None:
            self.gate = make_gate(settings, self.learner, self.pacer, self.progress.version,
                                  snapshot(self.learner, self.progress), tokenizer)
        self.saver = Saver(settings, self.learner, self.progress, self.status, self.stats,
                           self.gate, self.books, self.data_dir)
        self.publisher = Publisher(  # restore: looked up when called (a test replaces it)
            self.learner, engine, self.gate, self.saver, self.progress, self.status, self.stats,
            self.writer, restore=lambda good: self.restore(good), running=self.running)
        self.runner = StepRunner(
            settings, self.learner, engine, self.books, self.writer, self.pacer, self.progress,
            self.status, self.stats, self.publisher.after_step, self.saver.save_if_due,
            self.submit, vocab_size, self.data_dir)
        self.operator = Operator(self.learner, engine, self.gate, self.books, self.saver,
                                 self.publisher, self.progress, self.status, self.stats,
                                 self.writer, running=self.running)
        self.turns = turns or StepTurns()  # alone: never waits
        self._thread: threading.Thread | None = None
        self._running = False

    # ---- the thread ----

    def start(self) -> None:
        self.books.trim()  # start-up resubmitted what needed the whole history; now bounded
        self._running = True
        self._thread = threading.Thread(target=self._run, name="rlproxy-trainer", daemon=True)
        self._thread.start()

    def running(self) -> bool:
        return self._running

    def _run(self) -> None:
        with mlx_thread():
            try:
                while self._running:
                    batch = self.books.next_batch(self.t.batch_size, self.publisher.idle)
                    self.operator.between_batches()  # requests; a pause holds the batch here
                    if self.paused and not self._running:
                        break  # stopped while paused: the held batch trains after a restart
                    if batch and not self.train_or_wait(batch):
                        continue
                    if self.gate is not None and self.gate.due and self.take_turn():
                        try:
                            self.publisher.evaluate_if_due()  # publish it, or roll back
                        finally:
                            self.turns.give()
            except Exception as e:  # surfaced on /healthz
                log.exception("trainer thread died")
                self.status.report(Status.DIED, f"{type(e).__name__}: {e}")
            try:
                self.saver.save_unsaved()  # on this thread, which owns the arrays
            except Exception:
                log.exception("could not save the final checkpoint")

    def train_or_wait(self, batch: list[dict]) -> bool:
        """Train BATCH and settle it in the books; False when it waits (a full disk, a learner
        away): its items not trained yet go back to the inbox, after the outcome's delay."""
        if not self.take_turn():  # stopped while another adapter's trainer had the turn
            self.books.settle(batch, again=True)  # trained after a restart
            return False
        try:  # the other adapters' trainers wait meanwhile
            outcome = self.runner.run(batch)
        finally:
            self.turns.give()
        self.books.settle(batch, again=outcome.wait is not None or outcome.stopped)
        if outcome.wait is not None:
            time.sleep(outcome.wait.delay)
            return False
        return True

    def take_turn(self) -> bool:
        return self.turns.take(lambda: not self._running)

    def train_journaled(self, batch: list[dict]) -> list[dict]:
        """BATCH's step lines (`rlproxy train --from`); raises what made it wait."""
        outcome = self.runner.run(batch)
        if outcome.wait is not None:
            raise outcome.wait.error
        return outcome.lines

    def request_stop(self) -> None:
        """From any thread (SIGTERM's drain, pipeline.py; `stop`): no batch after this one, and
        the step in progress ends at its next unit, its turns uncharged (training/pacing.py);
        the thread then saves what is unsaved and ends."""
        self._running = False
        self.pacer.stop()
        self.books.close()

    def stop(self) -> None:
        """Stop, and wait for the thread: --drain-timeout-s for the unit in progress, then up to
        STOP_WAIT_S more; only then does the process go on without the step (ended uncharged)."""
        self.request_stop()
        if self._thread is not None:
            wait = self.settings.server.drain_timeout_s
            self._thread.join(timeout=wait)
            if self._thread.is_alive():
                log.warning("the training step's unit in progress still runs after %g s "
                            "(--drain-timeout-s); waiting up to %g s more for it", wait,
                            STOP_WAIT_S)
                self._thread.join(timeout=STOP_WAIT_S)
            if self._thread.is_alive():  # the process exits inside the step: not the turns' fault
                log.error("training step still running after %g s; stopping without it",
                          wait + STOP_WAIT_S)
                self.journal.stopped()
        else:  # offline use: the caller's thread did the training
            try:
                self.saver.save_unsaved()
            except Exception:
                log.exception("could not save the final checkpoint")
        self.learner.close()  # a learner elsewhere, or the other ranks of a launch
        self.writer.close()
        self.journal.close()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def health(self) -> dict:
        """The trainer's object on /healthz."""
        return {"enabled": True, "backend": self.learner.backend, "alive": self.alive,
                "error": self.error, "queued": self.books.inbox.qsize(), "step": self.step,
                **asdict(self.stats),
                # released and not trained yet (the inbox and the batch being gathered), against
                # what a step needs: "3 of 8 released turns for the next step"
                "untrained": len(self.books.queued), "batch_size": self.t.batch_size,
                "quarantined": len(self.journal.quarantined),
                "failed_steps": self.journal.failed_steps, "paused": self.paused,
                **self.learner.health()}

    def submit(self, scored: dict) -> None:
        """A released scorer -> trainer item (training/items.py), from any thread."""
        offered = self.books.offer(scored)
        if offered is Offered.DROPPED:
            self.stats.dropped = self.books.dropped
        elif (offered is Offered.QUEUED and self.gate is not None
              and item_key(scored) == scored["turn"]["uid"]):  # once per request
            self.gate.observe(scored["turn"])

    # ---- what other code reads and asks, on the part that owns it ----

    @property
    def error(self) -> str | None:
        return self.status.message

    @property
    def paused(self) -> bool:
        return self.status.paused

    @property
    def step(self) -> int:
        return self.progress.step

    @step.setter
    def step(self, value: int) -> None:
        self.progress.step = value

    @property
    def version(self) -> int:
        return self.progress.version

    @version.setter
    def version(self, value: int) -> None:
        self.progress.version = value

    @property
    def baseline(self) -> float:
        return self.progress.baseline

    @property
    def baseline_n(self) -> int:
        return self.progress.baseline_n

    @property
    def trained(self) -> LRU:
        return self.books.trained

    @trained.setter
    def trained(self, keys: LRU) -> None:  # `rlproxy train --from`: retrain everything
        self.books.trained = keys

    def pause(self) -> None:
        self.operator.pause()

    def unpause(self) -> None:
        self.operator.unpause()

    def request_rollback(self, step: int) -> Future:
        return self.operator.request_rollback(step)

    def request_save(self) -> Future:
        return self.operator.request_save()

    def rollback(self, path: Path) -> dict:
        return self.operator.rollback(path)

    def save(self, protect: Path | None = None) -> Path:
        return self.saver.save(protect)

    def restore(self, snap: dict) -> None:
        self.saver.restore(snap)

    def resume(self) -> Path | None:
        lines = self._lines if self._lines is not None else restart.read_training(self.data_dir)
        self._lines = None  # start-up's copy: not kept for the process's life
        return self.saver.resume(self.publisher.publish_resumed, lines)

    def sync_now(self) -> None:
        self.publisher.sync_now()

    def evaluate(self) -> dict:
        return self.publisher.evaluate()

    def evaluate_or_wait(self) -> None:
        self.publisher.evaluate_or_wait()

    def train_batch(self, batch: list[dict]) -> list[dict]:
        return self.runner.train_batch(batch)

    def _done(self, batch: list[dict]) -> None:
        self.books.settle(batch)
