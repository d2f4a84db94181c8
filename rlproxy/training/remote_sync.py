"""The trainer's side of a learner elsewhere (`--trainer tinker`), as a mixin of `Trainer`
(training/loop.py), on the trainer thread:

  weights     after a step the run's weights are brought back (remote/learner.py
              `sync_weights`) and published; one that cannot be is retried every SYNC_RETRY_S
              while serving goes on with the last good adapter (`fetch_for_publish`,
              `sync_if_due`).
  other steps an idle replica checks the run every SYNC_IDLE_S for what other replicas
              trained, and publishes it as a new version when it changed (not with the eval
              gate: a replica then serves only what its gate passed).
  lost steps  a learner that restarts resumes a run from its last saved state: the first
              step after it reports a run step at or below the last one seen, and the turns of
              this replica's steps past the saved state are trained again (`train_again`).

Not here: the calls on the service (remote/learner.py), the loop (training/loop.py).
"""

from __future__ import annotations

import logging
import time

from rlproxy.paths import TRAINING
from rlproxy.records import read_jsonl
from rlproxy.training.items import item_key, released_turns
from rlproxy.training.learner import LearnerUnavailable

log = logging.getLogger("rlproxy.trainer")
SYNC_IDLE_S = 30.0  # an idle trainer brings back the run's weights this often
SYNC_RETRY_S = 5.0  # a failed weights sync is tried again after this


class RemoteSync:
    def fetch_for_publish(self, version: int):
        """The run's weights to publish as VERSION, or None: not brought back now (the error
        on /healthz, retried by `sync_if_due`), or --sampler tinker's (the engine was pointed
        at them)."""
        self.last_sync = time.monotonic()
        try:
            weights = self.learner.sync_weights(self.engine, version)
        except (LearnerUnavailable, ValueError) as e:  # down, or weights that do not fit
            self.error = f"weights sync for version {version} failed: {e}"
            log.error(self.error)
            self.unsynced = version  # `sync_if_due` tries it again
            return None
        if self.error and self.error.startswith("weights sync"):
            self.error = None
        self.unsynced = None
        return weights

    def sync_if_due(self) -> float:
        """Between batches: retry a sync that failed, or check the run for other replicas'
        steps. The seconds until the next one is due."""
        behind = self.unsynced is not None  # a publish whose weights did not come back
        if not behind and self.gate is not None:  # only what this replica's gate passed
            return SYNC_IDLE_S
        due = SYNC_RETRY_S if behind else SYNC_IDLE_S
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
            return SYNC_IDLE_S
        if weights is not None:
            self.version += 1
            if self.engine is not None:
                self.engine.publish_adapter(weights, self.version)
            log.info("the run's weights changed elsewhere: serving them as version %d",
                     self.version)
        return SYNC_IDLE_S

    def sync_now(self) -> None:
        """At start-up: bring back the run's weights now (a new version if they differ from
        what the engine serves). A resumed version that could not be brought back stays
        `unsynced`, and is retried until the learner answers."""
        self.last_sync = float("-inf")
        self.sync_if_due()

    def train_again(self, saved: int, last: int) -> None:
        """The run went back to its step SAVED (a restarted learner) after this replica had
        seen step LAST: the turns of this replica's steps SAVED+1 .. LAST train again."""
        lines = list(read_jsonl(self.data_dir / TRAINING, report_cut=True))
        since = max((i for i, ln in enumerate(lines) if ln.get("kind") == "train_again"),
                    default=-1)  # steps of an earlier learner lifetime were handled then
        lost = {u for ln in lines[since + 1:] if ln.get("kind") == "step"
                and isinstance(ln.get("run_step"), int) and saved < ln["run_step"] <= last
                for u in ln.get("uids") or [] if isinstance(u, str)}
        if not lost:
            return
        with self._lock:
            for uid in lost:
                self.trained.discard(uid)
        s = self.settings.scoring
        items = [x for x in released_turns(self.data_dir, s.w_opd, s.w_rl, skip=self.trained,
                                           max_attempts=self.t.max_step_attempts)
                 if item_key(x) in lost]
        self.writer.write({"kind": "train_again", "reason": f"the learner's run went back from "
                           f"step {last} to {saved} (a restart from its last saved state)",
                           "turns_again": sorted(lost), "step": self.step,
                           "time": round(time.time(), 3)})
        log.warning("the learner's run went back from step %d to %d: %d turns of this "
                    "replica's lost steps train again", last, saved, len(items))
        for item in items:
            self.submit(item)
