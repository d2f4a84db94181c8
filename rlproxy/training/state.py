"""The trainer's state across restarts and rollbacks, as a mixin of `Trainer` (training/trainer.py):
checkpoints saved and resumed (the adapter, AdamW state, reward baseline, learning-rate scale and
update count), the steps a kill lost (their turns train again), and the in-memory snapshot the
eval gate (training/gate.py) restores on a rollback. Everything here runs on the trainer thread,
which owns the arrays, or before it starts.

Not here: the file format (training/checkpoints.py), training (training/trainer.py), the operator's rollback to an
older checkpoint (training/operator_actions.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_map, tree_unflatten

from rlproxy.training import schedule
from rlproxy.training.checkpoints import (
    latest_checkpoint, layout_mismatch, load_checkpoint, save_checkpoint,
)
from rlproxy.serving.model import lora_weights
from rlproxy.records import read_jsonl

log = logging.getLogger("rlproxy.trainer")
TRAINING = "training.jsonl"


class TrainState:
    def resume(self) -> Path | None:
        """Load the newest complete checkpoint (with `resume` on) and publish its adapter; the
        turns of the steps after it are trained again. Its path, or None."""
        path = latest_checkpoint(self.checkpoints) if self.t.resume else None
        if path is None:
            if self.t.resume:
                self._forget_lost_steps(0)
            return None
        adapter, opt_state, state = load_checkpoint(path)
        if layout_mismatch(lora_weights(self.model), adapter):
            raise ValueError(
                f"the newest checkpoint, {path}, holds an adapter for another model or LoRA "
                "layout than this one (--model, --lora-rank, --lora-layers, --lora-keys); "
                "use another --data-dir, or move its checkpoints/ folder away")
        self._forget_lost_steps(state["step"])
        self.load_state(adapter, opt_state, state.get("baseline", [0.0, 0]))
        self.step, self.version = state["step"], state["adapter_version"]
        self.lr_scale = state.get("lr_scale", 1.0)
        if state.get("schedule", schedule.describe(self.t)) != schedule.describe(self.t):
            log.warning("the learning-rate schedule differs from checkpoint %s's (%s); the "
                        "settings' is used from its update count on", path.name,
                        state["schedule"])
        self._saved_step = self.step
        # a gate rollback's checkpoint holds the served adapter under a newer step's version
        served = state.get("served_version", self.version)
        if self.engine is not None:
            self.engine.publish_adapter(lora_weights(self.model), served)
        if self.gate is not None:
            self.gate.published(served, lora_weights(self.model))
        log.info("resumed from %s (step %d, adapter version %d)", path, self.step, served)
        return path

    def _forget_lost_steps(self, step: int) -> None:
        """The steps after checkpoint STEP died with the process (a kill loses the updates
        since the last save): their turns are trained again. Their lines stay in
        training.jsonl; the journal's `resumed` line names them."""
        steps = [ln for ln in read_jsonl(self.data_dir / TRAINING)
                 if ln.get("kind") in ("step", "rollback")]  # a rollback takes a step too
        at = [i for i, ln in enumerate(steps) if ln["step"] == step]  # its last run's line
        cut = at[-1] + 1 if at else (0 if step == 0 else len(steps))
        lost = {u for ln in steps[cut:] for u in ln.get("uids", [])}
        if lost:
            self.trained -= lost
            self.journal.resumed(step, len(steps) - cut, sorted(lost))
            log.warning("resuming from step %d: the %d turns trained after it are trained "
                        "again", step, len(lost))

    def _save_unsaved(self) -> None:
        # with the gate, steps after the last published adapter were never evaluated: they
        # are not saved, and their turns train again after a restart
        if self.step and self.step != self._saved_step and self.gate is None:
            self.save()

    def try_save(self, protect: Path | None = None) -> Path | None:
        try:
            return self.save(protect)
        except Exception as e:  # e.g. a full disk: the step stands; the next save retries
            log.exception("could not save the checkpoint of step %d", self.step)
            self.stats["save_errors"] += 1
            self.error = f"checkpoint save failed at step {self.step}: {type(e).__name__}: {e}"
            return None

    def save(self, protect: Path | None = None) -> Path:
        extra = {"baseline": [self.baseline, self.baseline_n], "lr_scale": self.lr_scale,
                 "schedule": schedule.describe(self.t), "entropy_coef": self.t.entropy_coef}
        if self.gate is not None:  # after a rollback: the served adapter, a newer step
            extra["served_version"] = self.gate.served_version
        path = save_checkpoint(self.checkpoints, self.step, self.version,
                               lora_weights(self.model), self.optimizer.state, self.lora_config,
                               self.settings.model_dump(mode="json"), self.t.keep_checkpoints,
                               extra=extra, protect=protect)
        self._saved_step = self.step  # only now: a failed save is tried again at the next one
        if self.error and self.error.startswith("checkpoint save failed"):
            self.error = None
        return path

    def snapshot(self) -> dict:
        """The state a gate rollback restores (arrays are immutable: references suffice)."""
        return {"adapter": lora_weights(self.model),
                "optimizer": tree_map(lambda x: x, self.optimizer.state),
                "baseline": [self.baseline, self.baseline_n], "step": self.step}

    def load_state(self, adapter: dict, opt_state, baseline) -> None:
        self.model.update(tree_unflatten(list(adapter.items())))
        self.optimizer.state = tree_map(lambda x: x, opt_state)  # its own containers
        mx.eval(self.model.parameters(), self.optimizer.state)
        self.baseline, self.baseline_n = baseline
