"""The trainer: scored turns in, LoRA updates out, each published to the engine as version v+1.

One long-lived thread owns a second model instance that shares the serving model's frozen base
arrays (MLX arrays are immutable, so sharing is safe) and has its own LoRA weights and AdamW
state. For each batch of `batch_size` scored turns it runs `train_epochs` optimizer steps; after
every step it hands the engine the new adapter (already evaluated) and writes one line to
training.jsonl. It trains on the exact recorded ids and behaviour log-probs, never re-tokenizing.
While live requests are decoding it keeps to `duty_cycle` of the wall time.

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

from rlproxy import losses
from rlproxy.checkpoints import latest_checkpoint, load_checkpoint, save_checkpoint
from rlproxy.model import lora_weights, quantize_base
from rlproxy.records import CONVERSATIONS, JsonlWriter, read_jsonl
from rlproxy.scoring import token_advantages
from rlproxy.settings import Settings

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


class Trainer:
    def __init__(self, settings: Settings, model: nn.Module, lora_config: dict, engine=None,
                 data_dir: Path | None = None, ref_model: nn.Module | None = None):
        t = settings.trainer
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
        self.queued: set[str] = set()
        self.error: str | None = None
        self.stats = {"steps": 0, "turns_trained": 0, "skipped": 0, "last_loss": None}
        self.writer = JsonlWriter(self.data_dir / TRAINING, fsync=settings.records.fsync)
        self.trained = {u for line in read_jsonl(self.data_dir / TRAINING)
                        for u in line.get("uids", [])}
        if t.grad_checkpoint:
            from mlx_lm.tuner.trainer import grad_checkpoint

            grad_checkpoint(model.layers[0])
        self._grad = nn.value_and_grad(model, self._loss)
        self._thread: threading.Thread | None = None
        self._running = False

    # ---- lifecycle ----

    def resume(self) -> Path | None:
        path = latest_checkpoint(self.checkpoints) if self.t.resume else None
        if path is None:
            return None
        adapter, opt_state, state = load_checkpoint(path)
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
            self._save_unsaved()
        self.writer.close()

    def _save_unsaved(self) -> None:
        if self.step and self.step != self._saved_step:  # steps since the last checkpoint
            self.save()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, scored: dict) -> None:
        """A released scored turn (thread-safe): {"turn", "reward", "advantages", ...}."""
        uid = scored["turn"]["uid"]
        if scored.get("update"):  # feedback changed its reward: train on it again
            self.trained.discard(uid)
            self.queued.discard(uid)
        if uid not in self.trained and uid not in self.queued:
            self.queued.add(uid)
            self.inbox.put(scored)

    def _run(self) -> None:
        import gc

        try:
            with mx.stream(mx.new_stream(mx.default_device())):
                while self._running:
                    batch = self._collect()
                    if batch:
                        tic = time.perf_counter()
                        self.train_batch(batch)
                        self._keep_duty_cycle(time.perf_counter() - tic)
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
        batch: list[dict] = []
        while len(batch) < self.t.batch_size and self._running:
            item = self.inbox.get()
            if item is None:
                break
            batch.append(item)
        return batch if len(batch) == self.t.batch_size else []

    def _keep_duty_cycle(self, spent: float) -> None:
        if self.engine is not None and self.engine.stats.get("active", 0) > 0:
            time.sleep(spent * (1 - self.t.duty_cycle) / self.t.duty_cycle)

    # ---- one batch ----

    def _example(self, scored: dict) -> dict | None:
        turn = scored["turn"]
        choice = turn["choices"][turn.get("chosen_choice", 0)]
        prompt, completion = turn["prompt_ids"], choice["completion_ids"]
        if not completion or len(prompt) + len(completion) > self.t.max_context_tokens:
            return None
        adv = list(scored["advantages"])
        if self.t.baseline == "mean" and scored["reward"] is not None:
            # An exponential running mean of past rewards (decay 0.9), subtracted from the RL
            # part only: it follows the policy as it improves, where an all-time mean lags.
            if self.baseline_n:
                adv = [a - self.settings.scoring.w_rl * self.baseline for a in adv]
                self.baseline = 0.9 * self.baseline + 0.1 * scored["reward"]
            else:
                self.baseline = scored["reward"]
            self.baseline_n += 1
        ids = prompt + completion
        n_prompt = len(prompt) - 1  # targets[t] = ids[t + 1]; completion starts at this index
        pad = [0.0] * n_prompt
        return {"inputs": mx.array(ids[:-1])[None], "targets": mx.array(ids[1:])[None],
                "old": mx.array(pad + choice["logprobs"])[None],
                "adv": mx.array(pad + adv)[None],
                "mask": mx.array([0.0] * n_prompt + [1.0] * len(completion))[None],
                "uid": turn["uid"], "reward": scored["reward"], "tokens": len(completion)}

    def _loss(self, model, ex, n_tokens):
        logp = losses.token_logprobs(model, ex["inputs"], ex["targets"])
        loss = self.loss_fn(logp, ex["old"], ex["adv"], ex["mask"], eps_low=self.t.eps_low,
                            eps_high=self.t.eps_high, beta=self.t.dro_beta)
        kl = mx.array(0.0)
        if self.ref_model is not None and self.t.kl_coef > 0:
            ref = mx.stop_gradient(
                losses.token_logprobs(self.ref_model, ex["inputs"], ex["targets"]))
            kl = losses.kl_penalty(logp, ref, ex["mask"])
            loss = loss + self.t.kl_coef * kl
        return loss / n_tokens, kl

    def train_batch(self, batch: list[dict]) -> list[dict]:
        examples = [e for e in (self._example(s) for s in batch) if e is not None]
        self.stats["skipped"] += len(batch) - len(examples)
        if not examples:
            return []
        out = []
        for epoch in range(self.t.train_epochs):
            out.append(self.train_step(examples, epoch))
        self.trained.update(e["uid"] for e in examples)
        self.stats["turns_trained"] += len(examples)
        return out

    def train_step(self, examples: list[dict], epoch: int = 0) -> dict:
        tic = time.perf_counter()
        n_tokens = sum(e["tokens"] for e in examples)  # the normaliser: completion tokens
        grads, total, kl_total = None, 0.0, 0.0
        for ex in examples:
            (loss, kl), g = self._grad(self.model, ex, n_tokens)
            grads = g if grads is None else tree_map(mx.add, grads, g)
            mx.eval(loss, kl, grads)
            total += loss.item()
            kl_total += kl.item()
        log.info("forward_backward step=%d loss=%.4f tokens=%d", self.step + 1, total, n_tokens)
        if self.t.grad_clip > 0:
            grads, grad_norm = optim.clip_grad_norm(grads, self.t.grad_clip)
        else:
            grad_norm = mx.sqrt(sum((g * g).sum() for _, g in tree_flatten(grads)))
        self.optimizer.update(self.model, grads)
        mx.eval(self.model.parameters(), self.optimizer.state)
        self.step += 1
        self.version += 1
        pause = None
        if self.engine is not None:
            pause = self.engine.stats.get("last_swap_ms")
            self.engine.publish_adapter(lora_weights(self.model), self.version)
        log.info("optim_step step=%d version=%d", self.step, self.version)
        rewards = [e["reward"] for e in examples if e["reward"] is not None]
        mean = sum(rewards) / len(rewards) if rewards else None
        line = {
            "kind": "step", "step": self.step, "adapter_version": self.version, "epoch": epoch,
            "loss": total, "kl": kl_total / n_tokens, "loss_fn": self.t.loss_fn,
            "reward_mean": mean,
            "reward_std": (math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
                           if rewards else None),
            "turns": len(examples), "tokens": n_tokens, "grad_norm": float(grad_norm.item()),
            "step_time_s": round(time.perf_counter() - tic, 4), "previous_swap_pause_ms": pause,  # the engine applies this step's swap later
            "learning_rate": self.t.learning_rate, "uids": [e["uid"] for e in examples],
        }
        self.writer.write(line)
        self.stats.update(steps=self.step, last_loss=total)
        if self.step % self.t.save_interval == 0:
            self.save()
        return line

    def save(self) -> Path:
        self._saved_step = self.step
        return save_checkpoint(self.checkpoints, self.step, self.version,
                               lora_weights(self.model), self.optimizer.state, self.lora_config,
                               self.settings.model_dump(mode="json"), self.t.keep_checkpoints,
                               extra={"baseline": [self.baseline, self.baseline_n]})


def released_turns(data_dir: Path, w_opd: float, w_rl: float,
                   skip: set[str] = frozenset()) -> list[dict]:
    """Every turn released for training in DATA_DIR's records (latest release wins), rebuilt
    into what the scorer hands the trainer live. Used to resume and by `rlproxy train`."""
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
