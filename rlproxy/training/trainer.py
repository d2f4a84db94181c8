"""The trainer: scored turns in, LoRA updates out, each published to the engine as version v+1.

One long-lived thread owns a second model instance that shares the serving model's frozen base
arrays (MLX arrays are immutable, so sharing is safe) and has its own LoRA weights and AdamW
state. It takes scorer -> trainer items (training/items.py: one choice of a turn, keyed by
`key`), and for each batch of `batch_size` of them runs `train_epochs` optimizer steps; after
every step it hands the engine the new adapter (already evaluated) and writes one line to
training.jsonl (with the step's learning rate: training/schedule.py). With the eval gate on
(`eval_every`, training/gate.py) it publishes only a candidate that passed an evaluation, and rolls
back one that did not. It trains on the exact recorded ids and behaviour log-probs, never
re-tokenizing. While live requests are decoding it keeps to `duty_cycle` of the wall time.
Every batch runs between a journaled start and end (training/journal.py): an item whose step
raises, or dies with the process, is retried alone, then quarantined, so no turn can kill the
trainer or crash-loop it.

Advantage baselines: an item the scorer already `baselined` (a group of 2 or more choices) is
trained as it comes; otherwise `--baseline mean` subtracts an exponential running mean of the
rewards of such items (decay 0.9) from the RL part, and group, group-std and none subtract
nothing. A batch in which every trained token's advantage is zero (`no_signal`: e.g. groups
whose rewards were all equal, and no OPD term) takes no optimizer step and publishes no version:
its gradient is exactly 0, yet AdamW would move the adapter on its momentum. It gets a `skipped`
line with its `uids` (counted as handled, here and after a restart) and the reason.

Its books are bounded and locked (submit comes from the scorer's thread): `queued` holds at most
MAX_QUEUED keys, `trained` the TRAINED_KEEP newest once running. Checkpoints, resume and the
gate's snapshots are training/state.py's; the operator's pause, resume and rollback are
training/operator_actions.py's. Offline training (`rlproxy train --from DATA_DIR`) uses the same
`train_step`.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from rlproxy.training import chunked_grad
from rlproxy.training import losses
from rlproxy.ops import metrics
from rlproxy.training import schedule
from rlproxy.serving.mlx_threads import mlx_thread
from rlproxy.serving.model import lora_weights, quantize_base
from rlproxy.training.operator_actions import OperatorActions, RollbackSuperseded  # noqa: F401
from rlproxy.records import JsonlWriter, read_jsonl
from rlproxy.settings import Settings, TrainerSettings
from rlproxy.training.items import KeySet, item_choice, item_key, released_turns  # noqa: F401
from rlproxy.training.journal import StepJournal, run_batch
from rlproxy.training.state import TRAINING, TrainState

log = logging.getLogger("rlproxy.trainer")
TRAINED_KEEP = 100_000  # keys remembered as trained once running (start-up reads them all)
MAX_QUEUED = 10_000  # items waiting; past it an item waits for a restart (released_turns)
ZERO_ADVANTAGE = 1e-6  # |A_t| at most this is rounding, not signal (float32 log-probs)


def no_signal(examples: list[dict], t: TrainerSettings) -> str | None:
    """Why a batch of EXAMPLES (chunked_grad.turn_example) cannot teach the policy anything
    under trainer settings T, or None. Every trained token's advantage |A_t| <= ZERO_ADVANTAGE
    makes the policy gradient exactly 0 (checked per token: an OPD term keeps a group of equal
    rewards in training), and AdamW would still move the adapter on its momentum. DRO's
    penalty only holds the policy near the behaviour one: no reason to step either. A KL
    penalty or entropy bonus (kl_coef, entropy_coef > 0) is a term of its own, and
    cross_entropy ignores advantages: those batches always step."""
    if t.loss_fn == "cross_entropy" or t.kl_coef > 0 or t.entropy_coef > 0:
        return None
    trained = [a for e in examples for a, m in zip(e["adv"], e["mask"]) if m > 0]
    if any(abs(a) > ZERO_ADVANTAGE for a in trained):
        return None
    return (f"every advantage of its {sum(len(e['uids']) for e in examples)} turns is 0 (equal "
            "rewards, no teacher signal): no optimizer step, no new adapter version")


def training_copy(loaded) -> nn.Module:
    """A second model object over the same base arrays, with LoRA layers of its own."""
    import mlx_lm
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = mlx_lm.load(loaded.source, lazy=True)  # architecture only; weights never read
    cfg = loaded.lora_config
    linear_to_lora_layers(model, cfg["num_layers"], cfg["lora_parameters"])
    quantize_base(model, loaded.quantize_bits)  # the same structure as the serving model
    model.update(tree_unflatten(tree_flatten(loaded.model.parameters())))
    model.freeze()
    model.unfreeze(keys=["lora_a", "lora_b"], strict=False)
    model.train()
    mx.eval(model.parameters())
    return model


class Trainer(OperatorActions, TrainState):
    def __init__(self, settings: Settings, model: nn.Module, lora_config: dict, engine=None,
                 data_dir: Path | None = None, ref_model: nn.Module | None = None,
                 vocab_size: int | None = None, tokenizer=None):
        t = settings.trainer
        self.vocab_size = vocab_size  # token ids must be below it (None: not checked)
        self.t, self.settings, self.model, self.engine = t, settings, model, engine
        self.lora_config, self.ref_model = lora_config, ref_model
        self.data_dir = Path(data_dir or settings.records.data_dir)
        self.checkpoints = self.data_dir / "checkpoints"
        self.optimizer = optim.AdamW(learning_rate=t.learning_rate, weight_decay=t.weight_decay)
        self.optimizer.init(model.trainable_parameters())
        mx.eval(self.optimizer.state)  # concrete now: the trainer thread must not build on it
        self.loss_fn = losses.policy_loss(t.loss_fn)
        self.step = 0
        self._saved_step = 0
        self.version = engine.adapter_version if engine is not None else 0
        self.baseline, self.baseline_n = 0.0, 0
        self.lr_scale = 1.0  # times the schedule's rate; each gate rollback multiplies it
        self.inbox: queue.Queue = queue.Queue()
        # Keys (train_items.item_key). All three change under _lock, from the scorer's thread
        # (submit) and this one. `trained` holds every key until start() trims it.
        self.queued: set[str] = set()  # submitted, not yet trained, skipped or quarantined
        self._latest: dict[str, dict] = {}  # key -> a feedback update that came while queued
        self._skipped = KeySet(limit=TRAINED_KEEP)  # skipped in this process: one line each
        self._lock = threading.Lock()  # submit (any thread) against _done / request_rollback
        self.error: str | None = None
        self.stats = {"steps": 0, "turns_trained": 0, "skipped": 0, "last_loss": None,
                      "save_errors": 0, "errors_after_update": 0, "optimizer_steps": 0,
                      "learning_rate": None, "evals": 0, "gate_rollbacks": 0,
                      "unevaluated_steps": 0, "dropped": 0, "skipped_steps": 0}  # in this
        # process; `steps` counts rollbacks too; unevaluated_steps: taken since the gate's last
        # verdict; skipped_steps: batches with no signal (no_signal), their turns in `skipped`
        self.writer = JsonlWriter(self.data_dir / TRAINING, fsync=settings.records.fsync)
        self.trained = KeySet(u for line in read_jsonl(self.data_dir / TRAINING)
                              for u in line.get("uids", []))
        # Read before anything is resubmitted: turns a crashed step held are retried, or
        # quarantined once they have had their attempts.
        self.journal = StepJournal(self.data_dir, settings.records.fsync, t.max_step_attempts)
        self._batch: list[dict] = []  # items collected towards the next batch
        self.shape = chunked_grad.model_shape(model)
        self.memory_budget = (t.train_memory_gb * 2**30 if t.train_memory_gb
                              else chunked_grad.default_budget(model, ref_model))
        self.units = {"units": 0, "max_unit_s": 0.0, "yielded_s": 0.0}  # of the current step
        self._thread: threading.Thread | None = None
        self._running = False
        self.gate = None  # the eval gate (training/gate.py), with eval_every and an engine
        if t.eval_every and engine is not None:
            from rlproxy.training.gate import make_gate

            self.gate = make_gate(self, tokenizer)

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
            self._thread.join(timeout=120)
        else:  # offline use: the caller's thread did the training
            try:
                self._save_unsaved()
            except Exception:
                log.exception("could not save the final checkpoint")
        self.writer.close()
        self.journal.close()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

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
                self.stats["dropped"] += 1
                if self.stats["dropped"] in (1, 10, 100) or self.stats["dropped"] % 1000 == 0:
                    log.warning("the trainer has %d items waiting; %d released items were "
                                "left for a restart to train", MAX_QUEUED, self.stats["dropped"])
                return
            self.queued.add(key)
            self.inbox.put(scored)
        if self.gate is not None and key == scored["turn"]["uid"]:  # once per request
            self.gate.observe(scored["turn"])

    def mark_trained(self, keys) -> None:
        with self._lock:
            self.trained |= set(keys)

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

    def _run(self) -> None:
        with mlx_thread():
            try:
                while self._running:
                    batch = self._collect()
                    self._control()  # a rollback asked for; a pause holds the batch here
                    if self.paused and not self._running:
                        break  # stopped while paused: the held batch trains after a restart
                    if batch:  # its units keep the duty cycle (_between_units)
                        self.train_journaled(batch)
                        self._done(batch)
                    if self.gate is not None and self.gate.due:
                        self.gate.check()  # evaluate; publish, or roll back
            except Exception as e:  # surfaced on /healthz
                log.exception("trainer thread died")
                self.error = f"{type(e).__name__}: {e}"
            try:
                self._save_unsaved()  # on this thread, which owns the arrays
            except Exception:
                log.exception("could not save the final checkpoint")

    def _collect(self) -> list[dict]:
        """The next `batch_size` items; one whose earlier step failed comes back alone, at
        once, so that a poison turn cannot take innocent ones down with it again."""
        while self._running:
            item = self.inbox.get()
            if item is None:
                break
            with self._lock:
                item = self._latest.pop(item_key(item), item)  # an update came meanwhile
            if self.journal.failures[item_key(item)]:
                return [item]
            self._batch.append(item)
            if len(self._batch) == self.t.batch_size:
                batch, self._batch = self._batch, []
                with self._lock:
                    return [self._latest.pop(item_key(s), s) for s in batch]
        return []

    def train_journaled(self, batch: list[dict]) -> list[dict]:
        """`train_batch` between a journaled start and end (training/journal.py `run_batch`): a
        turn whose step raises is retried alone, then quarantined. Never raises for a turn."""
        return run_batch(self, batch)

    def _between_units(self, spent: float) -> None:
        """Serving first. Called after each unit of a step (one chunk's forward or backward, or
        the optimizer update, each ending in mx.eval) or of an evaluation: while the engine has
        requests waiting or decoding, rest spent * (1 - d) / d, so a request arriving mid-step
        waits at most for the unit in progress, and under constant traffic training still gets
        its share d."""
        u = self.units
        u["units"] += 1
        u["max_unit_s"] = max(u["max_unit_s"], spent)
        if self.engine is not None and self.engine.busy():
            tic = time.perf_counter()
            time.sleep(spent * (1 - self.t.duty_cycle) / self.t.duty_cycle)
            u["yielded_s"] += time.perf_counter() - tic

    # ---- one batch ----

    def _example(self, scored: dict) -> dict | None:
        """The item as a training example, or None (recorded as skipped, with the reason)."""
        key = item_key(scored)
        ex = chunked_grad.turn_example(scored["turn"], scored["advantages"], scored["reward"],
                                       choice=item_choice(scored), key=key)
        reason = self._skip_reason(ex)
        if reason is not None:
            with self._lock:
                first = key not in self._skipped  # retried at each restart: one line each
                self._skipped.add(key)
            if first:
                self.stats["skipped"] += 1
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
            if not self.journal.failures[key]:  # once per item, not per attempt
                self.baseline = (0.9 * self.baseline + 0.1 * scored["reward"]
                                 if self.baseline_n else scored["reward"])
                self.baseline_n += 1
        return ex

    def _skip_reason(self, ex: dict | None) -> str | None:
        if ex is None:
            return "no completion tokens"
        if len(ex["ids"]) > self.t.max_context_tokens:
            return f"{len(ex['ids'])} tokens > max_context_tokens {self.t.max_context_tokens}"
        return chunked_grad.over_budget(self.shape, ex, self.t.train_chunk_tokens,
                                        self.t.prompt_grad, self.memory_budget)

    def train_batch(self, batch: list[dict], out: list[dict] | None = None) -> list[dict]:
        """Its step lines, appended to OUT as they are written (what a caller keeps on a raise)."""
        out = [] if out is None else out
        examples = [e for e in (self._example(s) for s in batch) if e is not None]
        if not examples:
            return out
        examples = chunked_grad.pack(examples)  # a session's turns in one pass, when exact
        uids = [u for e in examples for u in e["uids"]]
        reason = no_signal(examples, self.t)
        if reason is not None:
            self._skip_batch(examples, uids, reason)
            return out
        for epoch in range(self.t.train_epochs):
            out.append(self.train_step(examples, epoch))
            if epoch == 0:  # trained now, whatever a later epoch does
                self.mark_trained(uids)
                self.stats["turns_trained"] += len(uids)
        return out

    def _skip_batch(self, examples: list[dict], uids: list[str], reason: str) -> None:
        """One `skipped` line for a batch that takes no step; its turns count as handled (the
        line's uids are read back as trained at start-up), so they are not retried."""
        self.mark_trained(uids)
        self.stats["skipped"] += len(uids)
        self.stats["skipped_steps"] += 1
        rewards = [r for e in examples for r in e["rewards"] if r is not None]
        self.writer.write({
            "kind": "skipped", "uids": uids, "reason": reason, "step": self.step,
            "adapter_version": self.version, "turns": len(uids),
            "tokens": sum(e["tokens"] for e in examples),
            "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "time": round(time.time(), 3)})
        log.info("skipped a batch of %d turns: %s", len(uids), reason)

    def learning_rate(self) -> float:
        """The rate of the next update: the schedule at the optimizer's update count."""
        return schedule.lr_at(int(self.optimizer.state["step"].item()), self.t, self.lr_scale)

    def train_step(self, examples: list[dict], epoch: int = 0) -> dict:
        tic = time.perf_counter()
        self.units = {"units": 0, "max_unit_s": 0.0, "yielded_s": 0.0}
        n_tokens = sum(e["tokens"] for e in examples)  # the normaliser: completion tokens
        grads, total, kl_total, entropy = None, 0.0, 0.0, 0.0
        for ex in examples:  # one micro-step per example, itself cut into units
            (loss, kl, ent), g = chunked_grad.example_grad(
                self.model, ex, self.loss_fn, n_tokens, chunk=self.t.train_chunk_tokens,
                prompt_grad=self.t.prompt_grad, between=self._between_units,
                ref_model=self.ref_model, kl_coef=self.t.kl_coef,
                entropy_coef=self.t.entropy_coef, eps_low=self.t.eps_low,
                eps_high=self.t.eps_high, beta=self.t.dro_beta)
            grads = g if grads is None else tree_map(mx.add, grads, g)
            total += loss
            kl_total += kl
            entropy += ent
        unit = time.perf_counter()
        log.info("forward_backward step=%d loss=%.4f tokens=%d", self.step + 1, total, n_tokens)
        if self.t.grad_clip > 0:
            grads, grad_norm = optim.clip_grad_norm(grads, self.t.grad_clip)
        else:
            grad_norm = mx.sqrt(sum((g * g).sum() for _, g in tree_flatten(grads)))
        lr = self.learning_rate()
        self.optimizer.learning_rate = lr
        self.optimizer.update(self.model, grads)
        mx.eval(self.model.parameters(), self.optimizer.state)
        self.journal.applied()
        self._between_units(time.perf_counter() - unit)
        self.step += 1
        self.version += 1
        pause = None
        if self.engine is not None:
            pause = self.engine.stats.get("last_swap_ms")
        if self.gate is None:
            self.publish()
        else:  # published only once an evaluation passes it (training/gate.py)
            self.gate.stepped()
        log.info("optim_step step=%d version=%d lr=%.3g", self.step, self.version, lr)
        rewards = [r for e in examples for r in e["rewards"] if r is not None]
        mean = sum(rewards) / len(rewards) if rewards else None
        line = {
            "kind": "step", "step": self.step, "adapter_version": self.version, "epoch": epoch,
            "loss": total, "kl": kl_total / n_tokens, "entropy": entropy / n_tokens,
            "loss_fn": self.t.loss_fn, "reward_mean": mean,
            "reward_std": (math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
                           if rewards else None),
            "turns": sum(len(e["uids"]) for e in examples), "sequences": len(examples),
            "tokens": n_tokens, "grad_norm": float(grad_norm.item()),
            "step_time_s": round(time.perf_counter() - tic, 4),
            "previous_swap_pause_ms": pause,  # the engine applies this step's swap later
            "learning_rate": lr, "lr_scale": self.lr_scale,
            "published": self.gate is None, "uids": [u for e in examples for u in e["uids"]],
            "prompt_grad": self.t.prompt_grad, "units": self.units["units"],
            "max_unit_s": round(self.units["max_unit_s"], 4),
            "yielded_s": round(self.units["yielded_s"], 4), "time": round(time.time(), 3),
        }
        self.writer.write(line)
        metrics.observe_train_step(line)
        self.stats.update(steps=self.step, last_loss=total, learning_rate=lr,
                          optimizer_steps=self.stats["optimizer_steps"] + 1)
        if self.step % self.t.save_interval == 0 and self.gate is None:  # the gate saves its own
            self.try_save()
        return line

    def publish(self) -> None:
        """Hand the engine the current adapter as `version` (the arrays are evaluated)."""
        weights = lora_weights(self.model)
        if self.engine is not None:
            self.engine.publish_adapter(weights, self.version)
        if self.gate is not None:
            self.gate.published(self.version, weights)
