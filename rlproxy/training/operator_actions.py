"""The trainer's side of the operator's actions: pause, resume, and a rollback to an older
checkpoint, as a mixin of `Trainer` (training/trainer.py). api/admin.py has the HTTP side. Flags and
requests may come from any thread; the work is done on the trainer thread, between batches
(`_control`), where the arrays live. The eval gate's own rollback is training/gate.py's.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from rlproxy.training.checkpoints import layout_mismatch, load_checkpoint
from rlproxy.serving.model import lora_weights

log = logging.getLogger("rlproxy.trainer")


class RollbackSuperseded(Exception):
    """A rollback request replaced by a later one before the trainer took it."""


class OperatorActions:
    paused = False  # set from any thread; the loop waits in _control between batches
    _rollback_request = None  # (checkpoint dir, concurrent Future), done on the trainer thread

    def pause(self) -> None:
        self.paused = True
        self.writer.write({"kind": "pause", "step": self.step, "time": time.time()})

    def unpause(self) -> None:  # not `resume`: that one loads the newest checkpoint
        self.paused = False
        if self.error and self.error.startswith("training paused"):  # the operator says fixed
            self.error = None
        if self.gate is not None:
            self.gate.in_a_row = 0
        self.writer.write({"kind": "resume", "step": self.step, "time": time.time()})

    def request_rollback(self, path: Path):
        """Ask the trainer thread to roll back to checkpoint PATH; a Future of its line."""
        from concurrent.futures import Future, InvalidStateError

        future: Future = Future()
        with self._lock:
            earlier, self._rollback_request = self._rollback_request, (Path(path), future)
        if earlier is not None and not earlier[1].cancelled():  # not taken: this replaces it
            try:
                earlier[1].set_exception(RollbackSuperseded(f"a rollback to {path} replaced it"))
            except InvalidStateError:  # withdrawn by its waiter (api/admin.py) meanwhile
                pass
        self.inbox.put(None)  # wakes _collect: an idle trainer does it at once
        return future

    def _control(self) -> None:
        """Between batches, on the trainer thread: do a requested rollback; wait while paused
        (a batch collected meanwhile is trained after resume, not lost)."""
        while True:
            with self._lock:
                request, self._rollback_request = self._rollback_request, None
            # a request withdrawn by its waiter after its timeout (api/admin.py) is dropped
            if request is not None and request[1].set_running_or_notify_cancel():
                path, future = request
                try:
                    future.set_result(self.rollback(path))
                except Exception as e:
                    log.exception("rollback to %s failed", path)
                    future.set_exception(e)
            if not (self.paused and self._running):
                return
            time.sleep(0.1)

    def rollback(self, path: Path) -> dict:
        """Load checkpoint PATH's adapter and optimizer state, publish it as a NEW adapter
        version, and train on from it. It takes a step number of its own, saved at once: no
        checkpoint is overwritten, and a restart resumes from the rolled-back adapter."""
        adapter, opt_state, state = load_checkpoint(path)
        problem = layout_mismatch(lora_weights(self.model), adapter, self.optimizer.state,
                                  opt_state)
        if problem:  # before anything changes: the request is refused, training goes on
            raise ValueError(f"another model or LoRA layout than this one ({problem}); "
                             "nothing was changed")
        self.load_state(adapter, opt_state, state.get("baseline", [0.0, 0]))
        self.step += 1
        self.version += 1
        if self.engine is not None:
            if getattr(self.engine, "prefix_cache", None) is not None:  # a new KV lineage
                self.engine.prefix_cache.reset_lineage(self.version)
        self.publish()
        line = {"kind": "rollback", "step": self.step, "adapter_version": self.version,
                "checkpoint": str(path), "checkpoint_step": state["step"],
                "checkpoint_adapter_version": state["adapter_version"], "training": True,
                "time": time.time()}
        self.writer.write(line)
        self.stats.update(steps=self.step)
        self.save(protect=path)  # the checkpoint rolled back to stays, to go back again
        log.info("rolled back to %s: now step %d, adapter version %d", path.name, self.step,
                 self.version)
        return line

