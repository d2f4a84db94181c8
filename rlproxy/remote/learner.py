"""RemoteLearner: training/learner.py's LocalLearner calls, answered by a Tinker service.

The training loop (training/loop.py) does not know which learner it has. Here each batch goes
out as Datums (datums.py) through the official SDK's `forward_backward`, then `optim_step` at
the schedule's learning rate; nothing is computed on the trainer thread but the Datums. The run
is joined by name (`user_metadata={"rlproxy_run": NAME}`: an rlproxy learner gives every
replica of NAME a handle of its own on one shared adapter, so each optimizer step applies
exactly one replica's batch); the weights come back through `weights.py`.

A failure on the service's side (LearnerUnavailable) drops the training client: the next try
joins the run again with a fresh handle, so a batch retried after a failure never adds its
gradient twice. (If an optimizer step was applied and only its answer was lost, the retry
applies the batch again: at-least-once, as any retried RPC.) A refusal (LearnerRefused: a wrong
key, an unknown base model, a run of another base or rank) is not retried.

Checkpoints stay where the loop keeps them (<data_dir>/checkpoints/step_N): the adapter last
synced, and in trainer_state.json the `tinker_path` of the service's own saved state
(`save_state`: weights and optimizer), which a rollback loads back into the run.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from rlproxy.remote import weights as remote_weights
from rlproxy.remote.datums import loss_config, to_datums
from rlproxy.paths import CHECKPOINTS, TRAINER_STATE
from rlproxy.remote.service import (
    LearnerRefused, LearnerUnavailable, api_key, base_model_name, call, replica_identity,
    resolve,
    rest_client, service_client,
)
from rlproxy.serving.model import lora_weights
from rlproxy.settings import Settings
from rlproxy.training import schedule
from rlproxy.training.checkpoints import read_checkpoint, save_checkpoint
from rlproxy.training.learner import ForwardBackwardOutput, OptimStepOutput, ResumePoint
from rlproxy.training.restart import last_recorded

log = logging.getLogger("rlproxy.remote")
INIT_SEED = 0  # a new run's LoRA init: the same for every run, so runs can be compared
RUN_STEP = "rlproxy_run_step"  # an rlproxy learner's optim_step metric: the run's step count
START_TIMEOUT_S = 15.0  # the longest wait to join a run: the learner answers a join at once
JOIN_RETRY_S = 4.0  # a join that failed is not tried again sooner (start-up's several calls)
CHECK_EVERY_S = 30.0  # an idle replica looks for other replicas' steps this often


@dataclass
class SyncStats:
    syncs: int = 0
    last_bytes: int = 0
    last_seconds: float = 0.0
    last_path: str | None = None
    failures: int = 0
    error: str | None = None
    history: list = field(default_factory=list)  # (bytes, seconds) of the last syncs


class RemoteLearner:
    """The learner on a Tinker service. MODEL is a local LoRA copy of the serving model (its
    layout is what the downloaded weights must fit; the eval gate measures on it), or None
    with --sampler tinker, where the service also samples and nothing is downloaded.

    Unlike the local learner, its weights come back over the network (every --sync-every
    steps, and may fail to), other replicas may step the same run (looked for every
    CHECK_EVERY_S while idle), and the run outlives this process: a restart goes on from
    the last step recorded and loses none."""

    backend = "tinker"
    record_stamp = {"backend": "tinker"}
    off_policy = "coupled"  # Tinker's ppo clips against the behaviour log-probs
    check_every = CHECK_EVERY_S

    def __init__(self, settings: Settings, model: nn.Module | None, lora_config: dict,
                 checkpoints: Path, base_model: str, identity: dict):
        self.t, self.settings, self.r = settings.trainer, settings, settings.remote
        self.publish_every = self.r.sync_every
        self.model, self.lora_config, self.checkpoints = model, lora_config, Path(checkpoints)
        self.base_model, self.run, self.replica = base_model, identity["run"], identity["replica"]
        self.lr_scale = 1.0
        self.updates = 0  # optimizer updates of the run as last known: the schedule's count
        self.remote_step: int | None = None  # the run's step, from an rlproxy learner
        self._went_back: tuple[int, int] | None = None
        self.failed_at = float("-inf")  # time.monotonic() of the last join that failed
        self.sync = SyncStats()
        self.service = self.training = self.rest = None
        self.closing: threading.Thread | None = None  # finishing a failed join's session
        self.timeout = self.r.tinker_timeout_s
        self.key = api_key(self.r)
        self.weights = lora_weights(model) if model is not None else {}
        self.rank = lora_config["lora_parameters"]["rank"]
        self.scale = lora_config["lora_parameters"]["scale"]
        self.num_blocks = len(model.layers) if model is not None else 0
        self.url = self.r.tinker_url

    # ---- the connection ----

    def connect(self, timeout: float | None = None):
        """The training client of the run, joined now if not yet (LearnerRefused / -Unavailable)."""
        if self.training is not None:
            return self.training
        if time.monotonic() - self.failed_at < JOIN_RETRY_S:  # start-up: one wait, not four
            raise LearnerUnavailable(f"the learner did not answer {JOIN_RETRY_S:g} s ago")
        try:
            return self._join(min(timeout or self.timeout, START_TIMEOUT_S))
        except LearnerUnavailable:
            self.failed_at = time.monotonic()
            raise

    def _join(self, timeout: float):
        service = service_client(self.r)
        try:
            return self._join_with(service, timeout)
        except BaseException:  # its session's heartbeats would hold a handle on the learner
            self.closing = threading.Thread(target=lambda: _finish(service, "errored"),
                                            daemon=True, name="rlproxy-tinker-close")
            self.closing.start()
            raise

    def _join_with(self, service, timeout: float):
        # the SDK makes its session here, synchronously: under the deadline too
        rest = call(lambda: rest_client(self.r), timeout, "connect")
        caps = resolve(rest.get_server_capabilities(), timeout, "server capabilities")
        names = [m.model_name for m in caps.supported_models]
        if self.base_model not in names:
            raise LearnerRefused(f"the Tinker service has no base model {self.base_model!r} (it "
                                 f"has {', '.join(names) or 'none'}): set --tinker-base-model")
        training = call(lambda: service.create_lora_training_client(  # makes the session here
            base_model=self.base_model, rank=self.rank, seed=INIT_SEED, train_unembed=False,
            user_metadata={"rlproxy_run": self.run, "rlproxy_replica": self.replica},
        ).result(timeout=timeout), timeout + 1.0, f"join run {self.run!r}")
        self.service, self.rest, self.training = service, rest, training
        log.info("joined Tinker run %r at %s as %s", self.run, self.url or "the hosted service",
                 training.model_id)
        return training

    def drop(self, why: str) -> None:
        """Forget the training client after a failure: the next call joins again."""
        if self.training is not None:
            log.warning("Tinker learner: %s; joining run %r again on the next try", why,
                        self.run)
        old, self.service, self.training, self.rest = self.service, None, None, None
        if old is not None:  # finish its session, so the learner drops the handle's gradients
            threading.Thread(target=lambda: _finish(old, "errored"), daemon=True,
                             name="rlproxy-tinker-close").start()

    def close(self) -> None:
        """Finish the session on the service (its handles go; the run stays), within 5 s."""
        service, self.service, self.training, self.rest = self.service, None, None, None
        if service is not None:
            try:
                resolve(service.close("success", detail="rlproxy stopped"), 5.0,
                        "close the session")
            except (LearnerUnavailable, LearnerRefused) as e:
                log.warning("could not finish the Tinker session: %s", e)

    def guarded(self, fn):
        """fn(training client); after a failure the client is dropped. A refusal on a client
        joined before this call may be a learner that restarted and forgot it ("unknown model
        id"): LearnerUnavailable, so the batch is tried again whole on a fresh handle, where
        a refusal that stands is the request's own."""
        fresh = self.training is None
        try:
            return fn(self.connect())
        except LearnerUnavailable as e:
            self.drop(str(e))
            raise
        except LearnerRefused as e:
            if fresh:
                raise
            self.drop(f"refused on the handle joined before ({e})")
            raise LearnerUnavailable(f"{e} (the learner may have restarted: joining the run "
                                     "again)") from None

    # ---- LocalLearner's calls ----

    def too_big(self, ex: dict) -> str | None:
        return None  # the service has its own limits; it says so in a user error

    def forward_backward(self, examples: list[dict], between=None) -> ForwardBackwardOutput:
        n = sum(e["tokens"] for e in examples)
        data = to_datums(examples, self.t.loss_fn)
        config = loss_config(self.t, n)
        out = self.guarded(lambda tc: resolve(
            tc.forward_backward(data, self.t.loss_fn, config), self.timeout,
            "forward_backward"))
        loss = next((v for k, v in out.metrics.items() if k.startswith("loss")), 0.0)
        return ForwardBackwardOutput(float(loss), 0.0, 0.0, n)

    def learning_rate(self) -> float:
        return schedule.lr_at(self.updates, self.t, self.lr_scale)

    def optim_step(self, learning_rate: float) -> OptimStepOutput:
        from tinker import types
        adam = types.AdamParams(learning_rate=learning_rate, beta1=0.9, beta2=0.999, eps=1e-8,
                                weight_decay=self.t.weight_decay, grad_clip_norm=self.t.grad_clip)
        out = self.guarded(lambda tc: resolve(tc.optim_step(adam), self.timeout,
                                                         "optim_step"))
        metrics = out.metrics or {}
        step = next((v for k, v in metrics.items() if k.split(":")[0] == RUN_STEP), None)
        if step is not None and self.remote_step is not None and step <= self.remote_step:
            self._went_back = (int(step) - 1, self.remote_step)
        self.remote_step = int(step) if step is not None else None
        self.updates = self.remote_step if step is not None else self.updates + 1
        norm = next((v for k, v in metrics.items() if "grad_norm" in k), float("nan"))
        return OptimStepOutput(float(norm), learning_rate, self.remote_step,
                               line={"run_step": self.remote_step})

    def went_back(self) -> tuple[int, int] | None:
        """(the run's step it resumed from, the last step seen before) once, after a step
        showed the run went back (a learner restarted from its last saved state), else None.
        Rollbacks of this replica's own do not count: they forget the step seen."""
        back, self._went_back = self._went_back, None
        return back

    def save_weights_for_sampler(self) -> dict[str, mx.array]:
        """The run's current adapter, downloaded and fitted (also kept as `weights`)."""
        if self.model is None:
            raise LearnerRefused("no local model: with --sampler tinker the service samples")
        name = f"{self.replica}-sync"  # replaced each time: the learner's disk stays flat
        try:
            got = self.guarded(lambda tc: remote_weights.fetch(
                tc, self.rest, name, self.key, self.url, self.timeout, self.weights, self.scale,
                self.num_blocks))
        except (LearnerUnavailable, LearnerRefused) as e:
            self.sync.failures += 1
            self.sync.error = str(e)
            raise
        s = self.sync
        s.syncs, s.last_bytes, s.last_seconds, s.last_path, s.error = (
            s.syncs + 1, got.nbytes, got.seconds, got.path, None)
        s.history = (s.history + [(got.nbytes, round(got.seconds, 4))])[-20:]
        self.weights = got.weights
        return got.weights

    def weights_for(self, engine, version: int) -> dict[str, mx.array] | None:
        """The run's weights to publish as VERSION, for the engine (downloaded), or, with
        --sampler tinker (no local model), None after pointing the engine's sampler at them."""
        if self.model is None:
            engine.publish_sampler(self.sampler_path(), version)
            return None
        return self.save_weights_for_sampler()

    def fetch_changed(self) -> dict[str, mx.array] | None:
        """The run's weights if they differ from the ones last brought back, else None
        (with --sampler tinker: always None, the sampler follows this replica's steps)."""
        if self.model is None:
            return None
        before = self.weights
        after = self.save_weights_for_sampler()
        same = set(before) == set(after) and all(
            mx.array_equal(before[k], after[k]).item() for k in before)
        return None if same else after

    def sampler_path(self) -> str:
        """With --sampler tinker: the run's weights saved for sampling; their tinker path."""
        name = f"{self.replica}-sampler"
        saved = self.guarded(lambda tc: resolve(tc.save_weights_for_sampler(name), self.timeout,
                                                "save weights for the sampler"))
        self.sync.syncs += 1
        self.sync.last_path = saved.path
        return saved.path

    def set_weights(self, weights: dict[str, mx.array]) -> None:
        """Into the local copy only (the eval gate's measurements)."""
        if self.model is not None:
            self.model.update(tree_unflatten(list(weights.items())))

    # ---- state ----

    def save_state(self, step: int, version: int, metadata: dict) -> Path:
        """The run's state saved on the service, and a local checkpoint naming it."""
        name = f"{self.replica}-step_{step:06d}"
        saved = self.guarded(lambda tc: resolve(tc.save_state(name), self.timeout,
                                                          "save_state"))
        extra = {**metadata, "lr_scale": self.lr_scale, "schedule": schedule.describe(self.t),
                 "backend": "tinker", "tinker_path": saved.path, "tinker_run": self.run,
                 "updates": self.updates, "entropy_coef": self.t.entropy_coef}
        return save_checkpoint(self.checkpoints, step, version, self.weights, {},
                               self.lora_config, self.settings.model_dump(mode="json"),
                               extra=extra)

    def forget_state(self, checkpoint: Path) -> None:
        """A pruned local checkpoint's state on the service, deleted (best effort: a failure
        leaves a folder on the learner, nothing else)."""
        try:
            state = json.loads((Path(checkpoint) / TRAINER_STATE).read_text())
            path = state["tinker_path"]
            rest = self.rest or rest_client(self.r)
            resolve(rest.delete_checkpoint_from_tinker_path(path), self.timeout,
                    "delete a pruned state")
        except Exception as e:  # noqa: BLE001  (best effort, logged)
            log.warning("could not delete %s's state on the learner: %s", checkpoint.name, e)

    def load_state(self, path: Path) -> dict:
        """Roll the run back to checkpoint PATH's saved state on the service."""
        adapter, _, state, _ = read_checkpoint(path, partial=True)
        tinker_path = (state or {}).get("tinker_path")
        if not tinker_path:
            raise LearnerRefused(f"{path.name} was not saved through a Tinker learner (no "
                                 "tinker_path): it cannot be loaded into the run")
        self.guarded(lambda tc: resolve(
            tc.load_state_with_optimizer(tinker_path), self.timeout, "load_state"))
        self.updates = int(state.get("updates", self.updates))
        self.remote_step = None  # the run went back on purpose
        self.weights = remote_weights.fit(adapter, self.lora_config, self.weights, self.scale,
                                          self.num_blocks) if self.weights else adapter
        return state

    def resume_state(self, path: Path) -> tuple[dict | None, list[str]]:
        """At start-up: the run itself carries on on the service (joined by name); the local
        checkpoint gives the loop its step, version and baseline, and the adapter to serve
        until the first sync."""
        adapter, _, state, problems = read_checkpoint(path, partial=True)
        problems = [p for p in problems if not p.startswith("optimizer")]
        if self.weights:
            self.weights = remote_weights.fit(adapter, self.lora_config, self.weights,
                                              self.scale, self.num_blocks)
        if state:
            self.updates = int(state.get("updates", state.get("step", 0)))
        return state, problems

    def resume_point(self, lines: list[dict], step: int, version: int) -> ResumePoint:
        """After checkpoint STEP (0: none): the run kept the steps after it, so numbering goes
        on after what training.jsonl recorded, and no turn trains again (a run that lost steps
        says so at the next step: `went_back`)."""
        return ResumePoint(*last_recorded(lines, step, version))

    def snapshot(self) -> dict:
        """The eval gate's good state: the adapter served, and the run's state saved on the
        service (weights and optimizer) for a rollback to load back; not saved (None) while
        the service cannot be reached."""
        path = None
        try:
            if self.training is None:  # not joined (down at start-up): do not hang start-up
                self.connect(timeout=min(START_TIMEOUT_S, self.timeout))
            name = f"{self.replica}-good"
            path = self.guarded(lambda tc: resolve(tc.save_state(name), self.timeout,
                                                   "save the good state")).path
        except LearnerUnavailable as e:
            log.warning("could not save the good state on the learner: %s", e)
        return {"adapter": dict(self.weights), "tinker_path": path}

    def restore(self, snapshot: dict) -> None:
        """Roll the run back to SNAPSHOT (the eval gate's refusal): its saved state loaded
        on the service, its adapter served here."""
        if snapshot.get("tinker_path") is None:
            raise LearnerRefused("the good state was never saved on the learner (it was down "
                                 "then), so the refused steps cannot be rolled back there")
        self.guarded(lambda tc: resolve(tc.load_state_with_optimizer(snapshot["tinker_path"]),
                                        self.timeout, "roll back to the good state"))
        self.remote_step = None  # the run went back on purpose
        self.weights = dict(snapshot["adapter"])
        self.set_weights(self.weights)

    def health(self) -> dict:
        return {"backend": "tinker", "url": self.url or "the tinker SDK's default",
                "run": self.run, "replica": self.replica, "remote_step": self.remote_step,
                "connected": self.training is not None,
                "model_id": getattr(self.training, "model_id", None),
                "syncs": self.sync.syncs, "last_sync_bytes": self.sync.last_bytes,
                "last_sync_s": round(self.sync.last_seconds, 4),
                "sync_failures": self.sync.failures, "sync_error": self.sync.error}


def _finish(service, status: str) -> None:
    try:
        service.close(status).result(timeout=30)
    except Exception:  # noqa: BLE001  (the learner expires a silent session anyway)
        pass


def remote_learner(settings: Settings, loaded, model: nn.Module | None) -> RemoteLearner:
    """The learner on the settings' Tinker service, joined now when it answers. A refusal (a
    wrong key, an unknown base model, a run of another base or rank) is a start-up error (a
    ValueError); a service that is down is not: serving starts, and training waits for it."""
    r = settings.remote
    base = base_model_name(settings, loaded)
    ident = replica_identity(settings.records.data_dir, r)
    learner = RemoteLearner(settings, model, loaded.lora_config,
                            settings.records.data_dir / CHECKPOINTS, base, ident)
    try:
        learner.connect(timeout=min(START_TIMEOUT_S, r.tinker_timeout_s))
    except LearnerRefused as e:
        if learner.closing is not None:  # the process ends on this: its session first
            learner.closing.join(timeout=5.0)
        raise ValueError(f"--trainer tinker: {e}") from None
    except LearnerUnavailable as e:
        log.error("the Tinker learner at %s does not answer (%s): serving starts, and training "
                  "waits for it", r.tinker_url or "the hosted service", e)
    return learner
