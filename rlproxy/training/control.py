"""The trainer's changes of course, as a mixin of `Trainer` (training/loop.py): what it does
besides taking the next step, on the trainer thread between batches (where the arrays live) or
before it starts.

  failures    `train_journaled` runs a batch between a journaled start and end
              (training/journal.py): a step whose compute raises costs its turns an attempt,
              is retried turn by turn, and a turn is quarantined once its attempts are spent;
              SYSTEMIC_TURNS different turns failing alike pause training instead. A full disk
              charges no one: `train_or_wait_for_disk` puts the batch's untrained items back
              and tries again after DISK_RETRY_S.
  eval gate   `evaluate` runs the gate (training/gate.py) on the candidate and applies its
              verdict: publish it (and save: the good state's checkpoint), or restore the good
              state, multiply the learning-rate scale, write a `rollback` line, pause after
              max_rollbacks in a row.
  operator    pause and unpause are flags, a rollback to a checkpoint a request with a Future,
              from any thread (api/admin.py has the HTTP side); `_control` does the rollback
              and waits while paused. A rollback publishes the checkpoint's adapter as a new
              version, with a step number of its own.
  restarts    checkpoints saved (the learner writes them: training/learner.py) with the reward
              baseline and the served version; `resume` loads the newest and publishes it; the
              turns of the steps a kill lost since (training/journal.py `lost_steps`) train again.
              A partly unreadable checkpoint is set aside and saved again whole (put back if
              that save fails, so the newest weights stay listed).

Not here: the loop, batches and steps (training/loop.py), the gate's measurements
(training/gate.py), the checkpoint format (training/checkpoints.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from concurrent.futures import Future, InvalidStateError
from pathlib import Path

from rlproxy.paths import TRAINING, complete, complete_checkpoints, kept_checkpoint
from rlproxy.records import WriteFailed, read_jsonl, set_aside
from rlproxy.training import schedule
from rlproxy.training.checkpoints import UNREADABLE, prune_checkpoints
from rlproxy.training.gate import Verdict
from rlproxy.training.items import item_choice, item_key
from rlproxy.training.journal import SYSTEMIC_TURNS, lost_steps, outside_vocab, turn_length
from rlproxy.training.learner import (LayoutMismatch, LearnerFailed, LearnerRefused,
                                      LearnerUnavailable)

log = logging.getLogger("rlproxy.trainer")
DISK_RETRY_S = 5.0  # a batch whose journal lines a full disk refused is tried again after it
LEARNER_RETRY_MAX_S = 60.0  # a learner elsewhere that is down: retries back off 5, 10 ... 60 s
LEARNER_FAILED_TRIES = 3  # a batch the learner answers with a failure this often is charged


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


class RollbackSuperseded(Exception):
    """A rollback request replaced by a later one before the trainer took it."""


class CheckpointGone(LookupError):
    """The checkpoint a rollback asked for is not kept (never saved, or pruned already)."""


class Control:
    """Trainer's methods for changes of course (the state is the Trainer's: training/loop.py)."""

    # ---- a batch between a journaled start and end ----

    def train_journaled(self, batch: list[dict]) -> list[dict]:
        """`train_batch` over BATCH between a journaled start and end; its step lines. A step
        whose compute raises costs each of its turns one attempt; a several-turn step is then
        retried turn by turn (innocent turns train, the poison one alone fails again), a
        one-turn step again until its turn is quarantined. Never raises for a turn's sake, so
        the trainer thread lives on."""
        journal = self.journal
        for s in batch:  # an id outside the vocabulary segfaults MLX instead of raising
            bad = outside_vocab(s["turn"], self.vocab_size, item_choice(s))
            if bad is not None:
                journal.quarantine(item_key(s), f"token id {bad} is outside this model's "
                                   f"vocabulary of {self.vocab_size} (recorded under another "
                                   "model?); training on it would crash")
        batch = [s for s in batch if item_key(s) not in journal.quarantined]
        if not batch:
            return []
        uids = [item_key(s) for s in batch]
        journal.start(uids, sum(turn_length(s["turn"], item_choice(s)) for s in batch))
        lines: list[dict] = []
        try:
            self.train_batch(batch, lines)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"[:2000]
            if journal.open is None:  # raised after an update was applied: not the turns' fault
                log.exception("training after the update over turns %s failed", ", ".join(uids))
                self.mark_trained(uids)  # retraining would apply the update twice
                self.stats.errors_after_update += 1
                self.error = f"after step {self.step}: {error}"
                return lines
            gave_up = (isinstance(e, LearnerFailed)  # the learner fails on this batch
                       and self.learner_failures + 1 >= LEARNER_FAILED_TRIES)
            if isinstance(e, (WriteFailed, LearnerUnavailable)) and not gave_up:  # not theirs
                journal.end(*journal.open, error, charge=False)  # (a full disk: it waits)
                raise  # the loop waits for space or the learner (train_or_wait_for_disk)
            log.exception("training step over turns %s failed", ", ".join(uids))
            if len(batch) == 1 and journal.systemic(uids, type(e).__name__):
                journal.end(*journal.open, error, charge=False)
                self.paused = True  # the loop waits in _control until the operator resumes
                self.error = (f"training paused: {SYSTEMIC_TURNS} different turns in a row "
                              f"failed with {error}; fix the cause, then resume")
                log.error(self.error)
                self.inbox.put(batch[0])  # kept for after the resume
                return []
            journal.end(*journal.open, error)
            if len(batch) > 1:
                return [line for one in batch for line in self.train_journaled([one])]
            return self.train_journaled(batch)  # returns [] once the turn is quarantined
        journal.applied()  # no step was taken (every turn skipped)
        return lines

    def train_or_wait_for_disk(self, batch: list[dict]) -> bool:
        """Train BATCH (its units keep the duty cycle: the pacer); False when a full disk kept
        its journal lines from being written: its items not trained yet go back to the inbox
        (one trained before, in a turn-by-turn retry, must not get a second update), and the
        thread waits DISK_RETRY_S before it tries again (no restart needed once there is
        space)."""
        try:
            self.train_journaled(batch)
        except (WriteFailed, LearnerUnavailable) as e:
            remote = isinstance(e, LearnerUnavailable)
            self.learner_failures = self.learner_failures + 1 if remote else 0
            wait = (min(LEARNER_RETRY_MAX_S, DISK_RETRY_S * 2 ** (self.learner_failures - 1))
                    if remote else DISK_RETRY_S)
            self.error = (f"training waits for the learner (try {self.learner_failures}, next "
                          f"in {wait:g} s): {e}" if remote
                          else f"training waits for disk space: {e}")
            log.error(self.error)
            handled, left = [], []
            with self._lock:
                for s in batch:
                    key = item_key(s)
                    done = key in self.trained or key in self._skipped
                    (handled if done or key in self.journal.quarantined else left).append(s)
            self._done(handled)  # they leave `queued`
            for item in left:
                self.inbox.put(item)
            time.sleep(wait)
            return False
        self.learner_failures = 0
        if self.error and self.error.startswith(("training waits for disk space",
                                                 "training waits for the learner")):
            self.error = None
        self._done(batch)
        return True

    # ---- the eval gate's verdict ----

    def evaluate_or_wait(self) -> None:
        """`evaluate`; a learner elsewhere that cannot answer (its weights, a rollback to the
        good state) is waited for with backoff, and the verdict applied again (the candidate
        is not evaluated twice: one `eval` line, one count towards the rollbacks in a row)."""
        tries, verdict = 0, None
        while self._running:
            try:
                if verdict is None:
                    verdict = self.judge()
                self.apply_verdict(verdict)
                break  # the learner answered: its error goes, below
            except LearnerRefused as e:  # e.g. no good state on the learner to go back to
                self.paused = True
                self.error = f"training paused: the eval gate: {e}; resume to go on"
                log.error(self.error)
                return
            except LearnerUnavailable as e:
                tries += 1
                wait = min(LEARNER_RETRY_MAX_S, DISK_RETRY_S * 2 ** (tries - 1))
                self.error = (f"training waits for the learner (try {tries}, next in "
                              f"{wait:g} s): the eval gate: {e}")
                log.error(self.error)
                time.sleep(wait)
        if self.error and self.error.startswith("training waits for the learner"):
            self.error = None

    def evaluate(self) -> dict:
        """Run the eval gate on the candidate and apply its verdict: publish it, or roll back
        to the good state. The `eval` line."""
        verdict = self.judge()
        self.apply_verdict(verdict)
        return verdict.line

    def judge(self) -> Verdict:
        """The eval gate's verdict on the candidate, its `eval` line written."""
        verdict = self.gate.check(self.step, self.version)
        self.stats.evals += 1
        self.writer.write(verdict.line)
        return verdict

    def apply_verdict(self, verdict: Verdict) -> None:
        """Publish the candidate, or roll back to the good state."""
        if verdict.passed:  # what was measured: a shared run may have moved on since
            self.publish(self.version, verdict.candidate)
            self.good_path = self.try_save()
            log.info("eval gate: adapter v%d published (probe reward %s)", self.version,
                     verdict.line["candidate"]["reward"])
        else:
            self._gate_rollback(verdict)

    def _gate_rollback(self, verdict: Verdict) -> None:
        """Restore the good state, lower the learning rate, write the `rollback` line; pause
        training when the verdict says so. Nothing is published: the served adapter is the
        good one already."""
        good, reason, served = verdict.good, verdict.line["refused"], self.gate.served_version
        rejected = self.version
        self.restore(good)
        self.learner.lr_scale *= verdict.lr_factor
        self.step += 1  # a step number of its own, as an operator's rollback
        self.stats.unevaluated_steps = 0
        self.stats.gate_rollbacks += 1
        self.stats.steps = self.step
        line = {"kind": "rollback", "gate": True, "step": self.step,
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
        self.try_save(protect=self.good_path)
        if verdict.pause:
            self.paused = True
            self.error = (f"training paused: {verdict.in_a_row} rollbacks in a row by the eval "
                          f"gate; the last: {reason}. Resume training (POST /v1/training/resume)"
                          f" to go on at {self.learner.lr_scale:g} x the learning rate")
            self.writer.write({"kind": "pause", "step": self.step, "reason": self.error,
                               "time": time.time()})
            log.error(self.error)

    # ---- the operator's actions: flags and requests from any thread ----

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

    def request_rollback(self, step: int) -> Future:
        """Ask the trainer thread to roll back to checkpoint STEP; a Future of its line. The
        checkpoint is found and pinned here, under the lock `save` prunes under, so no save
        between this request and the rollback removes it; CheckpointGone if it is not kept."""
        future: Future = Future()
        with self._lock:
            path = kept_checkpoint(self.learner.checkpoints, step)
            if path is None:
                raise CheckpointGone(step)
            earlier, self._rollback_request = self._rollback_request, (path, future)
        if earlier is not None and not earlier[1].cancelled():  # not taken: this replaces it
            try:
                earlier[1].set_exception(RollbackSuperseded(f"a rollback to {path} replaced it"))
            except InvalidStateError:  # withdrawn by its waiter (api/admin.py) meanwhile
                pass
        self.inbox.put(None)  # wakes _collect: an idle trainer does it at once
        return future

    def request_save(self) -> Future:
        """Ask the trainer thread for a checkpoint of its adapter now (`rlproxy export`, the
        dashboard's button); a Future of {step, adapter_version, path}. A step already saved
        is not written again."""
        future: Future = Future()
        with self._lock:
            self._save_requests.append(future)
        self.inbox.put(None)  # wakes _collect, as a rollback does
        return future

    def _save_now(self) -> None:
        with self._lock:
            requests, self._save_requests = self._save_requests, []
        requests = [f for f in requests if f.set_running_or_notify_cancel()]
        if not requests:
            return
        try:
            path = kept_checkpoint(self.learner.checkpoints, self.step)
            if path is None or self._saved_step != self.step:
                path = self.save()
            result = {"step": self.step, "adapter_version": self.version, "path": str(path)}
        except Exception as e:
            log.exception("checkpoint asked for could not be saved")
            for future in requests:
                future.set_exception(e)
            return
        for future in requests:
            future.set_result(result)

    def _control(self) -> None:
        """Between batches, on the trainer thread: do a requested rollback; wait while paused
        (a batch collected meanwhile is trained after resume, not lost)."""
        while True:
            self._save_now()
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
        if not complete(path):  # removed by hand since the request pinned it
            raise CheckpointGone(path.name)
        try:  # before anything changes: the request is refused, training goes on
            state = self.learner.load_state(path)
        except LayoutMismatch as e:
            raise ValueError(f"another model or LoRA layout than this one ({e}); nothing was "
                             "changed") from None
        self.baseline, self.baseline_n = state.get("baseline", [0.0, 0])
        self.step += 1
        self.version += 1
        if self.engine is not None and self.engine.prefix_cache is not None:
            self.engine.prefix_cache.reset_lineage(self.version)  # a new KV lineage
        self.publish(self.version)
        line = {"kind": "rollback", "step": self.step, "adapter_version": self.version,
                "checkpoint": str(path), "checkpoint_step": state["step"],
                "checkpoint_adapter_version": state["adapter_version"], "training": True,
                "time": time.time()}
        self.writer.write(line)
        self.stats.steps = self.step
        self.save(protect=path)  # the checkpoint rolled back to stays, to go back again
        log.info("rolled back to %s: now step %d, adapter version %d", path.name, self.step,
                 self.version)
        return line

    # ---- state across restarts and rollbacks ----

    def resume(self) -> Path | None:
        """Load the newest checkpoint that can be read (with `resume` on) and publish its
        adapter; the turns of the steps after it are trained again. Its path, or None.

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
        if path is None:
            self._forget_lost_steps(0)
            if self.remote:  # numbering goes on after what training.jsonl recorded
                self.step, self.version = last_recorded(self.data_dir, 0, self.version)
                self._saved_step = self.step
            return None
        if state is None:  # the weights, without their trainer_state.json
            step = int(path.name[5:])
            state = {"step": step, "adapter_version": version_of_step(self.data_dir, step)}
        self._forget_lost_steps(state["step"])
        self.baseline, self.baseline_n = state.get("baseline", [0.0, 0])
        self.step, self.version = state["step"], state["adapter_version"]
        if self.remote:  # the run kept the steps after this checkpoint: numbering goes on
            self.step, self.version = last_recorded(self.data_dir, self.step, self.version)
        self.learner.lr_scale = state.get("lr_scale", 1.0)
        if state.get("schedule", schedule.describe(self.t)) != schedule.describe(self.t):
            log.warning("the learning-rate schedule differs from checkpoint %s's (%s); the "
                        "settings' is used from its update count on", path.name,
                        state["schedule"])
        self._saved_step = self.step
        # a gate rollback's checkpoint holds the served adapter under a newer step's version
        served = state.get("served_version", self.version)
        self.publish(served)
        if self.remote and self.unsynced is not None and self.engine is not None:
            # the learner is away: this checkpoint's adapter is served until the run's
            # weights come back (`sync_if_due` retries them), never the bare base model
            self.engine.publish_adapter(self.learner.weights, served)
        if problems:
            log.warning("checkpoint %s: %s; resumed from its weights with a fresh optimizer "
                        "(its moments and update count start over)", path, "; ".join(problems))
            aside = set_aside(path, "; ".join(problems))
            if self.try_save() is None and not path.exists():  # the same step again, whole
                os.replace(aside, path)
                log.warning("%s is back in place until a save of step %d succeeds", path,
                            self.step)
        log.info("resumed from %s (step %d, adapter version %d)", path, self.step, served)
        return path

    def _forget_lost_steps(self, step: int) -> None:
        """The steps after checkpoint STEP died with the process: their turns are trained
        again. Their lines stay in training.jsonl; the journal's `resumed` line names them.
        Not with a learner elsewhere: its run holds those steps (a run that lost them is
        caught at the next step, training/remote_sync.py `train_again`)."""
        if self.remote:
            return
        n, lost = lost_steps(self.data_dir, step)
        if lost:
            with self._lock:
                for uid in lost:
                    self.trained.discard(uid)
            self.journal.resumed(step, n, sorted(lost))
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
            self.stats.save_errors += 1
            self.error = f"checkpoint save failed at step {self.step}: {type(e).__name__}: {e}"
            return None

    def save(self, protect: Path | None = None) -> Path:
        metadata = {"baseline": [self.baseline, self.baseline_n]}
        if self.gate is not None:  # after a rollback: the served adapter, a newer step
            metadata["served_version"] = self.gate.served_version
        path = self.learner.save_state(self.step, self.version, metadata)
        with self._lock:  # request_rollback pins its target under it: a pending one stays
            pinned = {p.name for p in (protect, (self._rollback_request or (None,))[0]) if p}
            pruned = prune_checkpoints(self.learner.checkpoints, self.t.keep_checkpoints, pinned)
        for folder in pruned:  # out of the listing already: deleted without holding the lock
            if self.remote:  # its state on the learner goes too
                self.learner.forget_state(folder)
            shutil.rmtree(folder, ignore_errors=True)
        self._saved_step = self.step  # only now: a failed save is tried again at the next one
        if self.error and self.error.startswith("checkpoint save failed"):
            self.error = None
        return path

    def snapshot(self) -> dict:
        """The state a gate rollback restores: the learner's, the reward baseline, the step."""
        return {**self.learner.snapshot(), "baseline": [self.baseline, self.baseline_n],
                "step": self.step}

    def restore(self, snapshot: dict) -> None:
        self.learner.restore(snapshot)
        self.baseline, self.baseline_n = snapshot["baseline"]
