"""The trainer: scored turns in, LoRA updates out, each published to the engine as version v+1.

One long-lived thread owns a second model instance that shares the serving model's frozen base
arrays (MLX arrays are immutable, so sharing is safe) and has its own LoRA weights and AdamW
state. For each batch of `batch_size` scored turns it runs `train_epochs` optimizer steps; after
every step it hands the engine the new adapter (already evaluated) and writes one line to
training.jsonl. It trains on the exact recorded ids and behaviour log-probs, never re-tokenizing.
While live requests are decoding it keeps to `duty_cycle` of the wall time. Every batch runs
between a journaled start and end (train_journal.py): a turn whose step raises, or dies with the
process, is retried alone, then quarantined, so no turn can kill the trainer or crash-loop it.

Offline training (`rlproxy train --from DATA_DIR`) uses the same `train_step`.
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

from rlproxy import chunked_grad, losses, metrics
from rlproxy.checkpoints import (
    latest_checkpoint, layout_mismatch, load_checkpoint, save_checkpoint,
)
from rlproxy.model import lora_weights, quantize_base
from rlproxy.records import CONVERSATIONS, JsonlWriter, read_jsonl
from rlproxy.scoring import token_advantages
from rlproxy.settings import Settings
from rlproxy.train_journal import StepJournal, quarantined_uids, run_batch

log = logging.getLogger("rlproxy.trainer")
TRAINING = "training.jsonl"


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


class RollbackSuperseded(Exception):
    """A rollback request replaced by a later one before the trainer took it."""


class Trainer:
    def __init__(self, settings: Settings, model: nn.Module, lora_config: dict, engine=None,
                 data_dir: Path | None = None, ref_model: nn.Module | None = None,
                 vocab_size: int | None = None):
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
        self.inbox: queue.Queue = queue.Queue()
        self.queued: set[str] = set()  # submitted, not yet trained, skipped or quarantined
        self._latest: dict[str, dict] = {}  # uid -> a feedback update that came while queued
        self._skipped: set[str] = set()  # skipped in this process: one `skipped` line each
        self._lock = threading.Lock()  # submit (any thread) against _done / request_rollback
        self.error: str | None = None
        self.stats = {"steps": 0, "turns_trained": 0, "skipped": 0, "last_loss": None,
                      "save_errors": 0, "errors_after_update": 0,
                      "optimizer_steps": 0}  # in this process; `steps` counts rollbacks too
        self.writer = JsonlWriter(self.data_dir / TRAINING, fsync=settings.records.fsync)
        self.trained = {u for line in read_jsonl(self.data_dir / TRAINING)
                        for u in line.get("uids", [])}
        # Read before anything is resubmitted: turns a crashed step held are retried, or
        # quarantined once they have had their attempts.
        self.journal = StepJournal(self.data_dir, settings.records.fsync, t.max_step_attempts)
        self._batch: list[dict] = []  # turns collected towards the next batch
        self.shape = chunked_grad.model_shape(model)
        self.memory_budget = (t.train_memory_gb * 2**30 if t.train_memory_gb
                              else chunked_grad.default_budget(model, ref_model))
        self.units = {"units": 0, "max_unit_s": 0.0, "yielded_s": 0.0}  # of the current step
        self._thread: threading.Thread | None = None
        self._running = False

    # ---- lifecycle ----

    def resume(self) -> Path | None:
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
        self.model.update(tree_unflatten(list(adapter.items())))
        self.optimizer.state = opt_state
        mx.eval(self.model.parameters(), self.optimizer.state)
        self.step, self.version = state["step"], state["adapter_version"]
        self._saved_step = self.step
        self.baseline, self.baseline_n = state.get("baseline", [0.0, 0])
        if self.engine is not None:
            self.engine.publish_adapter(lora_weights(self.model), self.version)
        log.info("resumed from %s (step %d, adapter version %d)", path, self.step, self.version)
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

    def start(self) -> None:
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

    def _save_unsaved(self) -> None:
        if self.step and self.step != self._saved_step:  # steps since the last checkpoint
            self.save()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, scored: dict) -> None:
        """A released scored turn (thread-safe): {"turn", "reward", "advantages", ...}."""
        uid = scored["turn"]["uid"]
        if uid in self.journal.quarantined:  # never again, whatever feedback says
            return
        with self._lock:
            if scored.get("update"):  # feedback changed its reward: train on it again
                self.trained.discard(uid)
                self._skipped.discard(uid)
                if uid in self.queued:  # waiting, or in a step now: the newest copy replaces it
                    self._latest[uid] = scored
                    return
            if uid not in self.trained and uid not in self.queued:
                self.queued.add(uid)
                self.inbox.put(scored)

    def _done(self, batch: list[dict]) -> None:
        """After BATCH's step: its turns leave `queued` once trained, skipped or quarantined; one
        whose reward changed meanwhile goes round again with the new reward."""
        with self._lock:
            for uid in {s["turn"]["uid"] for s in batch}:
                if uid in self._latest:
                    self.inbox.put(self._latest.pop(uid))
                elif (uid in self.trained or uid in self._skipped
                      or uid in self.journal.quarantined):
                    self.queued.discard(uid)

    def _run(self) -> None:
        import gc

        try:
            with mx.stream(mx.new_stream(mx.default_device())):
                while self._running:
                    batch = self._collect()
                    self._control()  # a rollback asked for; a pause holds the batch here
                    if batch:  # its units keep the duty cycle (_between_units)
                        self.train_journaled(batch)
                        self._done(batch)
        except Exception as e:  # surfaced on /healthz
            log.exception("trainer thread died")
            self.error = f"{type(e).__name__}: {e}"
        finally:
            try:
                with mx.stream(mx.new_stream(mx.default_device())):
                    self._save_unsaved()  # on this thread, which owns the arrays
            except Exception:
                log.exception("could not save the final checkpoint")
            gc.collect()
            mx.synchronize()
            mx.clear_streams()  # each MLX thread must, or the process can abort at exit

    def _collect(self) -> list[dict]:
        """The next `batch_size` turns; a turn whose earlier step failed comes back alone, at
        once, so that a poison turn cannot take innocent ones down with it again."""
        while self._running:
            item = self.inbox.get()
            if item is None:
                break
            item = self._latest.pop(item["turn"]["uid"], item)  # an update came meanwhile
            if self.journal.failures[item["turn"]["uid"]]:
                return [item]
            self._batch.append(item)
            if len(self._batch) == self.t.batch_size:
                batch, self._batch = self._batch, []
                return [self._latest.pop(s["turn"]["uid"], s) for s in batch]
        return []

    def train_journaled(self, batch: list[dict]) -> list[dict]:
        """`train_batch` between a journaled start and end (train_journal.py `run_batch`): a
        turn whose step raises is retried alone, then quarantined. Never raises for a turn."""
        return run_batch(self, batch)

    def _between_units(self, spent: float) -> None:
        """Serving first. Called after each unit of a step (one chunk's forward or backward, or
        the optimizer update, each ending in mx.eval): while the engine has requests waiting or
        decoding, rest spent * (1 - d) / d, so a request arriving mid-step waits at most for the
        unit in progress, and under constant traffic training still gets its share d."""
        u = self.units
        u["units"] += 1
        u["max_unit_s"] = max(u["max_unit_s"], spent)
        if self.engine is not None and self.engine.busy():
            tic = time.perf_counter()
            time.sleep(spent * (1 - self.t.duty_cycle) / self.t.duty_cycle)
            u["yielded_s"] += time.perf_counter() - tic

    # ---- one batch ----

    def _example(self, scored: dict) -> dict | None:
        """The turn as a training example, or None (recorded as skipped, with the reason)."""
        turn = scored["turn"]
        ex = chunked_grad.turn_example(turn, scored["advantages"], scored["reward"])
        reason = self._skip_reason(ex)
        if reason is not None:
            if turn["uid"] not in self._skipped:  # retried at each restart: one line each
                self._skipped.add(turn["uid"])
                self.stats["skipped"] += 1
                self.writer.write({"kind": "skipped", "uid": turn["uid"], "reason": reason})
                log.warning("skipped turn %s: %s", turn["uid"], reason)
            return None
        if self.t.baseline == "mean" and scored["reward"] is not None:
            # An exponential running mean of past rewards (decay 0.9), subtracted from the RL
            # part only: it follows the policy as it improves, where an all-time mean lags.
            if self.baseline_n:
                lo = ex["mask"].index(1.0)
                ex["adv"][lo:] = [a - self.settings.scoring.w_rl * self.baseline
                                  for a in ex["adv"][lo:]]
            if not self.journal.failures[turn["uid"]]:  # once per turn, not per attempt
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
        for epoch in range(self.t.train_epochs):
            out.append(self.train_step(examples, epoch))
            if epoch == 0:  # trained now, whatever a later epoch does
                self.trained.update(uids)
                self.stats["turns_trained"] += len(uids)
        return out

    def train_step(self, examples: list[dict], epoch: int = 0) -> dict:
        tic = time.perf_counter()
        self.units = {"units": 0, "max_unit_s": 0.0, "yielded_s": 0.0}
        n_tokens = sum(e["tokens"] for e in examples)  # the normaliser: completion tokens
        grads, total, kl_total = None, 0.0, 0.0
        for ex in examples:  # one micro-step per example, itself cut into units
            (loss, kl), g = chunked_grad.example_grad(
                self.model, ex, self.loss_fn, n_tokens, chunk=self.t.train_chunk_tokens,
                prompt_grad=self.t.prompt_grad, between=self._between_units,
                ref_model=self.ref_model, kl_coef=self.t.kl_coef, eps_low=self.t.eps_low,
                eps_high=self.t.eps_high, beta=self.t.dro_beta)
            grads = g if grads is None else tree_map(mx.add, grads, g)
            total += loss
            kl_total += kl
        unit = time.perf_counter()
        log.info("forward_backward step=%d loss=%.4f tokens=%d", self.step + 1, total, n_tokens)
        if self.t.grad_clip > 0:
            grads, grad_norm = optim.clip_grad_norm(grads, self.t.grad_clip)
        else:
            grad_norm = mx.sqrt(sum((g * g).sum() for _, g in tree_flatten(grads)))
        self.optimizer.update(self.model, grads)
        mx.eval(self.model.parameters(), self.optimizer.state)
        self.journal.applied()
        self._between_units(time.perf_counter() - unit)
        self.step += 1
        self.version += 1
        pause = None
        if self.engine is not None:
            pause = self.engine.stats.get("last_swap_ms")
            self.engine.publish_adapter(lora_weights(self.model), self.version)
        log.info("optim_step step=%d version=%d", self.step, self.version)
        rewards = [r for e in examples for r in e["rewards"] if r is not None]
        mean = sum(rewards) / len(rewards) if rewards else None
        line = {
            "kind": "step", "step": self.step, "adapter_version": self.version, "epoch": epoch,
            "loss": total, "kl": kl_total / n_tokens, "loss_fn": self.t.loss_fn,
            "reward_mean": mean,
            "reward_std": (math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
                           if rewards else None),
            "turns": sum(len(e["uids"]) for e in examples), "sequences": len(examples),
            "tokens": n_tokens, "grad_norm": float(grad_norm.item()),
            "step_time_s": round(time.perf_counter() - tic, 4), "previous_swap_pause_ms": pause,  # the engine applies this step's swap later
            "learning_rate": self.t.learning_rate, "uids": [u for e in examples for u in e["uids"]],
            "prompt_grad": self.t.prompt_grad, "units": self.units["units"],
            "max_unit_s": round(self.units["max_unit_s"], 4),
            "yielded_s": round(self.units["yielded_s"], 4), "time": round(time.time(), 3),
        }
        self.writer.write(line)
        metrics.observe_train_step(line)
        self.stats.update(steps=self.step, last_loss=total,
                          optimizer_steps=self.stats["optimizer_steps"] + 1)
        if self.step % self.t.save_interval == 0:
            try:
                self.save()
            except Exception as e:  # e.g. a full disk: the step stands; the next save retries
                log.exception("could not save the checkpoint of step %d", self.step)
                self.stats["save_errors"] += 1
                self.error = f"checkpoint save failed at step {self.step}: {type(e).__name__}: {e}"
        return line

    def save(self, protect: Path | None = None) -> Path:
        path = save_checkpoint(self.checkpoints, self.step, self.version,
                               lora_weights(self.model), self.optimizer.state, self.lora_config,
                               self.settings.model_dump(mode="json"), self.t.keep_checkpoints,
                               extra={"baseline": [self.baseline, self.baseline_n]},
                               protect=protect)
        self._saved_step = self.step  # only now: a failed save is tried again at the next one
        if self.error and self.error.startswith("checkpoint save failed"):
            self.error = None
        return path

    # ---- the operator's actions (control.py): pause, resume, roll back ----

    paused = False  # set from any thread; the loop waits in _control between batches
    _rollback_request = None  # (checkpoint dir, concurrent Future), done on the trainer thread

    def pause(self) -> None:
        self.paused = True
        self.writer.write({"kind": "pause", "step": self.step, "time": time.time()})

    def unpause(self) -> None:  # not `resume`: that one loads the newest checkpoint
        self.paused = False
        if self.error and self.error.startswith("training paused"):  # the operator says fixed
            self.error = None
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
            except InvalidStateError:  # withdrawn by its waiter (control.py) meanwhile
                pass
        self.inbox.put(None)  # wakes _collect: an idle trainer does it at once
        return future

    def _control(self) -> None:
        """Between batches, on the trainer thread: do a requested rollback; wait while paused
        (a batch collected meanwhile is trained after resume, not lost)."""
        while True:
            with self._lock:
                request, self._rollback_request = self._rollback_request, None
            # a request withdrawn by its waiter after its timeout (control.py) is dropped
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
        self.model.update(tree_unflatten(list(adapter.items())))
        self.optimizer.state = opt_state
        mx.eval(self.model.parameters(), self.optimizer.state)
        self.baseline, self.baseline_n = state.get("baseline", [0.0, 0])
        self.step += 1
        self.version += 1
        if self.engine is not None:
            if getattr(self.engine, "prefix_cache", None) is not None:  # a new KV lineage
                self.engine.prefix_cache.reset_lineage(self.version)
            self.engine.publish_adapter(lora_weights(self.model), self.version)
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


def released_turns(data_dir: Path, w_opd: float, w_rl: float,
                   skip: set[str] = frozenset(), max_attempts: int = 2) -> list[dict]:
    """Every turn released for training in DATA_DIR's records (latest release wins), rebuilt
    into what the scorer hands the trainer live, less quarantined turns (train_journal.py).
    Used to resume and by `rlproxy train`."""
    skip = set(skip) | quarantined_uids(data_dir, max_attempts)
    scores, releases = {}, {}
    for line in read_jsonl(Path(data_dir) / "prm_scores.jsonl"):
        if line.get("kind") == "score":
            scores[line["uid"]] = line
        elif line.get("kind") == "release":
            releases[line["uid"]] = line
    out = []
    for turn in read_jsonl(Path(data_dir) / CONVERSATIONS):
        uid = turn.get("uid")
        if uid not in releases or uid in skip:
            continue
        choice = turn["choices"][turn.get("chosen_choice", 0)]
        reward = releases[uid]["reward"]
        teacher = scores.get(uid, {}).get("teacher_logprobs")
        adv = token_advantages(choice["logprobs"], teacher, reward, w_opd, w_rl)
        if adv is not None:
            out.append({"turn": turn, "reward": reward, "advantages": adv,
                        "teacher_logprobs": teacher})
    return out
