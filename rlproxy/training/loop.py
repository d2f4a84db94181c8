"""The trainer: scored turns in, LoRA updates out, each published to the engine as version v+1.

One long-lived thread takes scorer -> trainer items (training/items.py: one choice of a turn,
keyed by `key`) from its inbox, and for each batch of `batch_size` of them runs `train_epochs`
optimizer steps on the learner (training/learner.py); after every step it hands the engine the
new adapter (already evaluated) and writes one line to training.jsonl. With the eval gate on
(`eval_every`) it publishes only a candidate the gate passed (training/control.py). It trains on
the exact recorded ids and behaviour log-probs, never re-tokenizing. After each unit of work the
pacer (training/pacing.py) keeps it to `duty_cycle` while live requests decode. Every batch runs
between a journaled start and end (training/journal.py): an item whose step raises, or dies with
the process, is retried alone, then quarantined, so no turn can kill or crash-loop the trainer; a
turn in a step an unproven process died in waits until this one is proven (journal.py's crash
blame). A batch whose journal lines a full disk refuses goes back to the inbox and is tried again
(training/control.py `train_or_wait_for_disk`), the error on /healthz meanwhile.

Advantage baselines: an item the scorer already `baselined` (a group of 2 or more choices) is
trained as it comes; otherwise `--baseline mean` subtracts an exponential running mean of the
rewards of such items (decay 0.9) from the RL part, and group, group-std and none subtract
nothing. A batch with no signal (training/examples.py `no_signal`: e.g. groups whose rewards were
all equal, and no OPD term) takes no optimizer step and publishes no version: its gradient is
exactly 0, yet AdamW would move the adapter on its momentum. It gets a `skipped` line with its
`uids` (counted as handled, here and after a restart) and the reason.

Its books are bounded and locked (submit comes from the scorer's thread): `queued` holds at most
MAX_QUEUED keys, `trained` the TRAINED_KEEP newest once running. Offline training (`rlproxy train
--from DATA_DIR`) uses the same `train_journaled`.

Not here: the gradient math, the optimizer, checkpoint files (training/learner.py); the gate's
verdicts, the operator's actions, checkpoints and resume (training/control.py).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.nn as nn

from rlproxy.lru import LRU
from rlproxy.ops import metrics
from rlproxy.paths import CHECKPOINTS, TRAINING
from rlproxy.records import JsonlWriter, read_jsonl
from rlproxy.serving.mlx_threads import mlx_thread
from rlproxy.settings import Settings
from rlproxy.training.control import Control
from rlproxy.training.remote_sync import SYNC_IDLE_S, RemoteSync
from rlproxy.training.examples import no_signal, pack, turn_example
from rlproxy.training.gate import make_gate
from rlproxy.training.items import item_choice, item_key, released_turns
from rlproxy.training.journal import StepJournal, uids_of
from rlproxy.training import distributed, losses
from rlproxy.training.learner import LocalLearner, training_copy
from rlproxy.training.pacing import Pacer

__all__ = ["Trainer", "TrainerStats", "released_turns", "training_copy"]  # app.py and cli.py's
log = logging.getLogger("rlproxy.trainer")
TRAINED_KEEP = 100_000  # keys remembered as trained once running (start-up reads them all)
MAX_QUEUED = 10_000  # items waiting; past it an item waits for a restart (released_turns)
STOP_WAIT_S = 120.0  # a stop waits this long for a step; then it ends the step uncharged


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


class Trainer(Control, RemoteSync):
    """The trainer thread and its state: the learner, the step and adapter version, the reward
    baseline, the books of keys, the journal, the pacer and the eval gate."""

    def __init__(self, settings: Settings, model: nn.Module | None, lora_config: dict,
                 engine=None, data_dir: Path | None = None, ref_model: nn.Module | None = None,
                 vocab_size: int | None = None, tokenizer=None, learner=None, ranks=None):
        t = settings.trainer
        self.vocab_size = vocab_size  # token ids must be below it (None: not checked)
        self.t, self.settings, self.engine = t, settings, engine
        self.data_dir = Path(data_dir or settings.records.data_dir)
        # the learner in this process, on the ranks of an mlx.launch (RANKS: rank 0's link to
        # the others, training/distributed.py), or elsewhere (remote/learner.py)
        self.learner = learner or (
            LocalLearner(settings, model, lora_config, self.data_dir / CHECKPOINTS, ref_model)
            if ranks is None else distributed.ParallelLearner(
                settings, model, lora_config, self.data_dir / CHECKPOINTS, ref_model, ranks))
        self.remote = settings.remote.trainer == "tinker"
        # what the step applies: a remote learner's ppo is Tinker's, clipped against the
        # behaviour log-probs; the other losses have no clip to decouple (training/losses.py)
        self.off_policy = ("decoupled" if t.off_policy == "decoupled" and not self.remote
                           and t.loss_fn in losses.DECOUPLED else "coupled")
        self.unsynced: int | None = None  # remote: a version whose weights did not come back
        self.last_sync = 0.0  # remote: time.monotonic() of the last weights sync or try
        self.learner_failures = 0  # remote: batches in a row the learner could not take
        self.step = 0
        self._saved_step = 0
        self.version = engine.adapter_version if engine is not None else 0
        self.baseline, self.baseline_n = 0.0, 0
        self.inbox: queue.Queue = queue.Queue()
        # Keys (items.item_key). All three change under _lock, from the scorer's thread
        # (submit) and this one. `trained` holds every key until start() bounds it.
        self.queued: set[str] = set()  # submitted, not yet trained, skipped or quarantined
        self._latest: dict[str, dict] = {}  # key -> a feedback update that came while queued
        self._skipped: LRU = LRU(TRAINED_KEEP)  # skipped in this process: one line each
        self._in_baseline: LRU = LRU(TRAINED_KEEP)  # rewards the running mean has taken
        self._lock = threading.Lock()  # submit (any thread) against _done / request_rollback
        self.error: str | None = None
        self.paused = False  # set from any thread; the loop waits in _control between batches
        self._rollback_request = None  # (checkpoint dir, Future), done on the trainer thread
        self._save_requests: list[Future] = []  # checkpoints asked for now (request_save)
        self.stats = TrainerStats()
        self.writer = JsonlWriter(self.data_dir / TRAINING, fsync=settings.records.fsync,
                                  stamp={"backend": "tinker"} if self.remote else None)
        self.trained: LRU = LRU()
        for line in read_jsonl(self.data_dir / TRAINING, report_cut=True):
            for uid in uids_of(line):
                self.trained.add(uid)
        # Read before anything is resubmitted: turns a crashed step held are retried, or
        # quarantined once they have had their attempts.
        self.journal = StepJournal(self.data_dir, settings.records.fsync, t.max_step_attempts)
        self._batch: list[dict] = []  # items collected towards the next batch
        self._suspects: list[dict] = []  # items waiting for this process to be proven
        self.pacer = Pacer(engine.busy if engine is not None else None, t.duty_cycle)
        self._thread: threading.Thread | None = None
        self._running = False
        self.good_path: Path | None = None  # the checkpoint of the gate's good state, if saved
        self.gate = None  # the eval gate (training/gate.py), with eval_every and an engine
        if t.eval_every and engine is not None:
            self.gate = make_gate(settings, self.learner, self.pacer, self.version,
                                  self.snapshot(), tokenizer)

    # ---- lifecycle ----

    def start(self) -> None:
        with self._lock:  # start-up resubmitted what needed the whole history; now bounded
            self.trained.trim(TRAINED_KEEP)
        self._running = True
        self._thread = threading.Thread(target=self._run, name="rlproxy-trainer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._running = False
        self.inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout=STOP_WAIT_S)
            if self._thread.is_alive():  # the process exits inside the step: not the turns' fault
                log.error("training step still running after %g s; stopping without it",
                          STOP_WAIT_S)
                self.journal.stopped()
        else:  # offline use: the caller's thread did the training
            try:
                self._save_unsaved()
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
        return {"enabled": True, "backend": "tinker" if self.remote else "local",
                "alive": self.alive, "error": self.error,
                "queued": self.inbox.qsize(), "step": self.step, **asdict(self.stats),
                # released and not trained yet (the inbox and the batch being gathered), against
                # what a step needs: "3 of 8 released turns for the next step"
                "untrained": len(self.queued), "batch_size": self.t.batch_size,
                "quarantined": len(self.journal.quarantined),
                "failed_steps": self.journal.failed_steps, "paused": self.paused,
                **self.learner.health()}

    # ---- the books: items waiting, keys handled ----

    def submit(self, scored: dict) -> None:
        """A released scorer -> trainer item (training/items.py), from any thread."""
        key = item_key(scored)
        if key in self.journal.quarantined:  # never again, whatever feedback says
            return
        with self._lock:
            if scored.get("update"):  # feedback changed its reward: train on it again
                self.trained.discard(key)
                self._skipped.discard(key)
                if key in self.queued:  # waiting, or in a step now: the newest copy replaces it
                    self._latest[key] = scored
                    return
            if key in self.trained or key in self.queued:
                return
            if len(self.queued) >= MAX_QUEUED:  # training far behind: a restart offers it again
                self.stats.dropped += 1
                if self.stats.dropped in (1, 10, 100) or self.stats.dropped % 1000 == 0:
                    log.warning("the trainer has %d items waiting; %d released items were "
                                "left for a restart to train", MAX_QUEUED, self.stats.dropped)
                return
            self.queued.add(key)
            self.inbox.put(scored)
        if self.gate is not None and key == scored["turn"]["uid"]:  # once per request
            self.gate.observe(scored["turn"])

    def mark_trained(self, keys) -> None:
        with self._lock:
            for key in keys:
                self.trained.add(key)

    def _done(self, batch: list[dict]) -> None:
        """After BATCH's step: its items leave `queued` once trained, skipped or quarantined;
        one whose reward changed meanwhile goes round again with the new reward."""
        with self._lock:
            for key in {item_key(s) for s in batch}:
                if key in self._latest:
                    self.inbox.put(self._latest.pop(key))
                elif (key in self.trained or key in self._skipped
                      or key in self.journal.quarantined):
                    self.queued.discard(key)

    def _collect(self) -> list[dict]:
        """The next `batch_size` items; one whose earlier step failed comes back alone, at
        once, so that a poison turn cannot take innocent ones down with it again. A suspect (in
        a step an unproven process died in: training/journal.py) waits until this process is
        proven, then comes back alone."""
        while self._running:
            if self._suspects and self.journal.proven:
                return [self._suspects.pop(0)]
            wait = 1.0 if self._suspects else None
            if self.remote:  # idle: bring back what other replicas trained, or a failed sync
                wait = min(wait or SYNC_IDLE_S, self.sync_if_due())
            try:  # waiting suspects: look again when CLEAN_RUN_S may have made it proven
                item = self.inbox.get(timeout=wait)
            except queue.Empty:
                continue
            if item is None:
                break
            with self._lock:
                item = self._latest.pop(item_key(item), item)  # an update came meanwhile
            if self.journal.suspect(item_key(item)) and not self.journal.proven:
                self._suspects.append(item)
                continue
            if self.journal.tries(item_key(item)):
                return [item]
            self._batch.append(item)
            if len(self._batch) == self.t.batch_size:
                batch, self._batch = self._batch, []
                with self._lock:
                    return [self._latest.pop(item_key(s), s) for s in batch]
        return []

    # ---- the thread ----

    def _run(self) -> None:
        with mlx_thread():
            try:
                while self._running:
                    batch = self._collect()
                    self._control()  # a rollback asked for; a pause holds the batch here
                    if self.paused and not self._running:
                        break  # stopped while paused: the held batch trains after a restart
                    if batch and not self.train_or_wait_for_disk(batch):
                        continue
                    if self.gate is not None and self.gate.due:
                        self.evaluate_or_wait()  # publish the candidate, or roll back
            except Exception as e:  # surfaced on /healthz
                log.exception("trainer thread died")
                self.error = f"{type(e).__name__}: {e}"
            try:
                self._save_unsaved()  # on this thread, which owns the arrays
            except Exception:
                log.exception("could not save the final checkpoint")

    # ---- one batch ----

    def _example(self, scored: dict) -> dict | None:
        """The item as a training example, or None (recorded as skipped, with the reason)."""
        key = item_key(scored)
        ex = turn_example(scored["turn"], scored["advantages"], scored["reward"],
                          choice=item_choice(scored), key=key, version=self.version)
        reason = self._skip_reason(ex)
        if reason is not None:
            with self._lock:
                first = key not in self._skipped  # retried at each restart: one line each
                self._skipped.add(key)
            if first:
                self.stats.skipped += 1
                self.writer.write({"kind": "skipped", "uid": key, "reason": reason})
                log.warning("skipped turn %s: %s", key, reason)
            return None
        if (self.t.baseline == "mean" and scored["reward"] is not None
                and not scored.get("baselined")):
            # An exponential running mean of past rewards (decay 0.9), subtracted from the RL
            # part only: it follows the policy as it improves, where an all-time mean lags.
            if self.baseline_n:
                lo = ex["mask"].index(1.0)
                ex["adv"][lo:] = [a - self.settings.scoring.w_rl * self.baseline
                                  for a in ex["adv"][lo:]]
            # once per item, not per attempt (a learner outage's retries are not charged)
            if not self.journal.tries(key) and key not in self._in_baseline:
                self._in_baseline.add(key)
                self.baseline = (0.9 * self.baseline + 0.1 * scored["reward"]
                                 if self.baseline_n else scored["reward"])
                self.baseline_n += 1
        return ex

    def _skip_reason(self, ex: dict | None) -> str | None:
        if ex is None:
            return "no completion tokens"
        if len(ex["ids"]) > self.t.max_context_tokens:
            return f"{len(ex['ids'])} tokens > max_context_tokens {self.t.max_context_tokens}"
        late, limit = ex["staleness"][0], self.t.max_staleness
        if limit is not None and late is not None and late > limit:
            return (f"sampled {late} adapter versions before v{self.version} > max_staleness "
                    f"{limit}")
        return self.learner.too_big(ex)

    def train_batch(self, batch: list[dict], out: list[dict] | None = None) -> list[dict]:
        """Its step lines, appended to OUT as they are written (what a caller keeps on a raise)."""
        out = [] if out is None else out
        examples = [e for e in (self._example(s) for s in batch) if e is not None]
        if not examples:
            return out
        examples = pack(examples)  # a session's turns in one pass, when exact
        uids = [u for e in examples for u in e["uids"]]
        reason = no_signal(examples, self.t)
        if reason is not None:
            self._skip_batch(examples, uids, reason)
            return out
        if self.off_policy == "decoupled" and self.t.train_epochs > 1:
            self.learner.proximal(examples, self.pacer)  # the clip's anchor for every epoch
        for epoch in range(self.t.train_epochs):
            out.append(self.train_step(examples, epoch))
            if epoch == 0:  # trained now, whatever a later epoch does
                self.mark_trained(uids)
                self.stats.turns_trained += len(uids)
        return out

    def _skip_batch(self, examples: list[dict], uids: list[str], reason: str) -> None:
        """One `skipped` line for a batch that takes no step; its turns count as handled (the
        line's uids are read back as trained at start-up), so they are not retried."""
        self.mark_trained(uids)
        self.stats.skipped += len(uids)
        self.stats.skipped_steps += 1
        rewards = [r for e in examples for r in e["rewards"] if r is not None]
        self.writer.write({
            "kind": "skipped", "uids": uids, "reason": reason, "step": self.step,
            "adapter_version": self.version, "turns": len(uids),
            "tokens": sum(e["tokens"] for e in examples),
            "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "time": round(time.time(), 3)})
        log.info("skipped a batch of %d turns: %s", len(uids), reason)

    def train_step(self, examples: list[dict], epoch: int = 0) -> dict:
        """One optimizer step over EXAMPLES on the learner, published (or, with the gate,
        left for it to evaluate); its line."""
        tic = time.perf_counter()
        self.pacer.restart()
        fb = self.learner.forward_backward(examples, between=self.pacer)
        unit = time.perf_counter()
        log.info("forward_backward step=%d loss=%.4f tokens=%d", self.step + 1, fb.loss,
                 fb.tokens)
        opt = self.learner.optim_step(self.learner.learning_rate())
        self.journal.applied()
        if self.remote and (back := self.learner.went_back()):  # a restarted learner
            self.train_again(*back)
        self.pacer(time.perf_counter() - unit)
        self.step += 1
        # a shared remote run numbers versions by its own steps, every replica's
        self.version = max(self.version + 1, opt.run_step or 0)
        pause = self.engine.stats.last_swap_ms if self.engine is not None else None
        published = self.gate is None and not (
            self.remote and self.step % self.settings.remote.sync_every)  # --sync-every N
        if published:
            self.publish(self.version)
        elif self.gate is not None:  # published only once an evaluation passes it (gate.py)
            self.gate.stepped()
            self.stats.unevaluated_steps = self.gate.since
        log.info("optim_step step=%d version=%d lr=%.3g", self.step, self.version,
                 opt.learning_rate)
        rewards = [r for e in examples for r in e["rewards"] if r is not None]
        mean = sum(rewards) / len(rewards) if rewards else None
        units = self.pacer.units
        line = {
            "kind": "step", "step": self.step, "adapter_version": self.version, "epoch": epoch,
            "loss": fb.loss, "kl": fb.kl / fb.tokens, "entropy": fb.entropy / fb.tokens,
            "loss_fn": self.t.loss_fn, "off_policy": self.off_policy, "reward_mean": mean,
            "reward_std": (math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
                           if rewards else None),
            "turns": sum(len(e["uids"]) for e in examples), "sequences": len(examples),
            "tokens": fb.tokens, "grad_norm": opt.grad_norm,
            "step_time_s": round(time.perf_counter() - tic, 4),
            "previous_swap_pause_ms": pause,  # the engine applies this step's swap later
            "learning_rate": opt.learning_rate, "lr_scale": self.learner.lr_scale,
            "published": published, "uids": [u for e in examples for u in e["uids"]],
            "staleness": [s for e in examples for s in e["staleness"]],  # per uid
            **({"run_step": opt.run_step} if self.remote else {}),
            **({"shard_tokens": fb.shard_tokens} if fb.shard_tokens else {}),  # mlx.launch
            "prompt_grad": self.t.prompt_grad, "units": units["units"],
            "max_unit_s": round(units["max_unit_s"], 4),
            "yielded_s": round(units["yielded_s"], 4), "time": round(time.time(), 3),
        }
        self.writer.write(line)
        metrics.observe_train_step(line)
        self.stats.steps, self.stats.last_loss = self.step, fb.loss
        self.stats.learning_rate = opt.learning_rate
        self.stats.optimizer_steps += 1
        if self.step % self.t.save_interval == 0 and self.gate is None:  # the gate saves its own
            self.try_save()
        return line

    def publish(self, version: int, weights: dict | None = None) -> None:
        """Hand the engine the learner's adapter (or WEIGHTS, the ones the eval gate measured)
        as VERSION (the arrays are evaluated). A remote learner's that cannot be brought back
        now is tried again when the trainer is idle (`sync_if_due`); serving goes on with the
        last good adapter meanwhile."""
        if weights is None and self.remote:
            weights = self.fetch_for_publish(version)
            if weights is None:  # not brought back (retried), or --sampler tinker's path
                return
        elif weights is None:
            weights = self.learner.save_weights_for_sampler()
        if self.engine is not None:
            self.engine.publish_adapter(weights, version)
        if self.gate is not None:  # this state is now the good one
            self.gate.published(version, weights, self.snapshot())
            self.stats.unevaluated_steps = 0
