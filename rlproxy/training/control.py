"""The trainer's changes of course: how long it waits for what is not the turns' fault, and the
operator's actions.

  waiting     a batch whose journal lines a full disk refused is tried again after DISK_RETRY_S;
              one a learner elsewhere could not take after `backoff` (5, 10 ... 60 s), and after
              LEARNER_FAILED_TRIES failures of the learner's own in a row it is charged
              (training/runner.py); the eval gate waits for such a learner the same way
              (training/publisher.py).
  operator    pause and unpause are flags, a rollback to a checkpoint and a checkpoint now are
              requests with a Future, from any thread (api/admin.py has the HTTP side);
              `between_batches`, on the trainer thread, does them and waits while paused. A
              rollback publishes the checkpoint's adapter as a new version, with a step number
              of its own, saved at once.

Not here: the loop (training/loop.py), steps and their retries (training/runner.py), saving and
resuming (training/saving.py), the eval gate's verdicts (training/publisher.py).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, InvalidStateError
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from rlproxy.paths import complete, kept_checkpoint
from rlproxy.records import JsonlWriter
from rlproxy.training.books import Books
from rlproxy.training.learner import LayoutMismatch, Learner
from rlproxy.training.saving import Saver
from rlproxy.training.status import Progress, TrainerStats, TrainerStatus

if TYPE_CHECKING:
    from rlproxy.training.publisher import Publisher

log = logging.getLogger("rlproxy.trainer")
DISK_RETRY_S = 5.0  # a batch whose journal lines a full disk refused is tried again after it
LEARNER_RETRY_MAX_S = 60.0  # a learner elsewhere that is down: retries back off 5, 10 ... 60 s
LEARNER_FAILED_TRIES = 3  # a batch the learner answers with a failure this often is charged
PAUSED_LOOK_S = 0.1  # while paused, the trainer looks for requests this often


def backoff(tries: int) -> float:
    """Seconds before try TRIES + 1 of a learner that did not answer."""
    return min(LEARNER_RETRY_MAX_S, DISK_RETRY_S * 2 ** (tries - 1))


class RollbackSuperseded(Exception):
    """A rollback request replaced by a later one before the trainer took it."""


class CheckpointGone(LookupError):
    """The checkpoint a rollback asked for is not kept (never saved, or pruned already)."""


class Operator:
    """The operator's requests and their effects. RUNNING(): whether the trainer thread runs
    (a pause holds it only then)."""

    def __init__(self, learner: Learner, engine, gate, books: Books, saver: Saver,
                 publisher: Publisher, progress: Progress, status: TrainerStatus,
                 stats: TrainerStats, writer: JsonlWriter, running: Callable[[], bool]):
        self.learner, self.engine, self.gate, self.books = learner, engine, gate, books
        self.saver, self.publisher, self.progress = saver, publisher, progress
        self.status, self.stats, self.writer, self.running = status, stats, writer, running
        self.pending: tuple[Path, Future] | None = None  # a rollback asked for, not yet taken
        self.save_requests: list[Future] = []  # checkpoints asked for now (request_save)

    # ---- from any thread ----

    def pause(self) -> None:
        self.status.paused = True
        self.writer.write({"kind": "pause", "step": self.progress.step, "time": time.time()})

    def unpause(self) -> None:  # not `resume`: that one loads the newest checkpoint
        self.status.unpause()  # the operator says fixed: a pause's error goes
        if self.gate is not None:
            self.gate.in_a_row = 0
        self.writer.write({"kind": "resume", "step": self.progress.step, "time": time.time()})

    def request_rollback(self, step: int) -> Future:
        """Ask the trainer thread to roll back to checkpoint STEP; a Future of its line. The
        checkpoint is found and pinned here, under the lock `save` prunes under, so no save
        between this request and the rollback removes it; CheckpointGone if it is not kept."""
        future: Future = Future()
        with self.saver.lock:
            path = kept_checkpoint(self.learner.checkpoints, step)
            if path is None:
                raise CheckpointGone(step)
            earlier, self.pending = self.pending, (path, future)
            self.saver.pinned = path
        if earlier is not None and not earlier[1].cancelled():  # not taken: this replaces it
            try:
                earlier[1].set_exception(RollbackSuperseded(f"a rollback to {path} replaced it"))
            except InvalidStateError:  # withdrawn by its waiter (api/admin.py) meanwhile
                pass
        self.books.wake()  # an idle trainer does it at once
        return future

    def request_save(self) -> Future:
        """Ask the trainer thread for a checkpoint of its adapter now (`rlproxy export`, the
        dashboard's button); a Future of {step, adapter_version, path}. A step already saved
        is not written again."""
        future: Future = Future()
        with self.saver.lock:
            self.save_requests.append(future)
        self.books.wake()  # as a rollback does
        return future

    # ---- on the trainer thread ----

    def between_batches(self) -> None:
        """Do the checkpoints and the rollback asked for; wait while paused (a batch collected
        meanwhile is trained after resume, not lost)."""
        while True:
            self._save_now()
            with self.saver.lock:
                request, self.pending = self.pending, None
                self.saver.pinned = None
            # a request withdrawn by its waiter after its timeout (api/admin.py) is dropped
            if request is not None and request[1].set_running_or_notify_cancel():
                path, future = request
                try:
                    future.set_result(self.rollback(path))
                except Exception as e:
                    log.exception("rollback to %s failed", path)
                    future.set_exception(e)
            if not (self.status.paused and self.running()):
                return
            time.sleep(PAUSED_LOOK_S)

    def _save_now(self) -> None:
        with self.saver.lock:
            requests, self.save_requests = self.save_requests, []
        requests = [f for f in requests if f.set_running_or_notify_cancel()]
        if not requests:
            return
        p = self.progress
        try:
            path = kept_checkpoint(self.learner.checkpoints, p.step)
            if path is None or p.saved_step != p.step:
                path = self.saver.save()
            result = {"step": p.step, "adapter_version": p.version, "path": str(path)}
        except Exception as e:
            log.exception("checkpoint asked for could not be saved")
            for future in requests:
                future.set_exception(e)
            return
        for future in requests:
            future.set_result(result)

    def rollback(self, path: Path) -> dict:
        """Load checkpoint PATH's adapter and optimizer state, publish it as a NEW adapter
        version, and train on from it. It takes a step number of its own, saved at once: no
        checkpoint is overwritten, and a restart resumes from the rolled-back adapter."""
        if not complete(path):  # removed by hand since the request pinned it
            raise CheckpointGone(path.name)
        try:  # before anything changes: the request is refused, training goes on
            state = self.learner.load_state(path)
        except LayoutMismatch as e:
            raise ValueError(f"another model or LoRA layout than this one ({e}); nothing was "
                             "changed") from None
        p = self.progress
        p.baseline, p.baseline_n = state.get("baseline", [0.0, 0])
        p.step += 1
        p.version += 1
        if self.engine is not None and self.engine.prefix_cache is not None:
            self.engine.prefix_cache.reset_lineage(p.version)  # a new KV lineage
        self.publisher.publish(p.version)
        line = {"kind": "rollback", "step": p.step, "adapter_version": p.version,
                "checkpoint": str(path), "checkpoint_step": state["step"],
                "checkpoint_adapter_version": state["adapter_version"], "training": True,
                "time": time.time()}
        self.writer.write(line)
        self.stats.steps = p.step
        self.saver.save(protect=path)  # the checkpoint rolled back to stays, to go back again
        log.info("rolled back to %s: now step %d, adapter version %d", path.name, p.step,
                 p.version)
        return line
