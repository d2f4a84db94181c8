"""The learner: gradients in, LoRA updates out.

Owns the training model (LoRA layers of its own over the serving model's frozen base arrays:
MLX arrays are immutable, so sharing them is safe), the KL reference model, the AdamW optimizer
and its state, the policy loss, and the learning rate: the schedule (training/schedule.py) at the
optimizer's update count, times `lr_scale`. Its calls are named after the Tinker API's
TrainingClient (`forward_backward`, `optim_step`, `save_state`, `load_state`,
`save_weights_for_sampler`) so that a learner on another machine can stand behind the same calls;
as in Tinker, gradients accumulate inside it from `forward_backward` until `optim_step`.

`Learner` lists the calls the trainer makes; LocalLearner (here, and distributed.py's
ParallelLearner over the ranks of an mlx.launch) and remote/learner.py's RemoteLearner answer
them. Where the two differ (whose weights are at hand, who else trains the adapter, what a
restart loses) the learner says so through these calls, and the trainer asks no other question.

Not here: which items train, batches, the journal, pacing, publishing, step lines
(training/runner.py, publisher.py); one sequence's chunked forward and backward
(training/chunked_grad.py); the checkpoint format on disk (training/checkpoints.py). Every call
runs on the trainer thread, which owns the arrays, or before it starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from rlproxy.serving.model import architecture, lora_weights, quantize_base
from rlproxy.settings import Settings
from rlproxy.training import chunked_grad, losses, schedule
from rlproxy.training.checkpoints import (
    layout_mismatch, load_checkpoint, read_checkpoint, save_checkpoint,
)
from rlproxy.training.journal import lost_steps


class LearnerUnavailable(RuntimeError):
    """A learner elsewhere could not answer now (down, slow, failing on its side): the batch
    waits and is tried again, charging no turn (remote/learner.py raises it)."""


class LearnerFailed(LearnerUnavailable):
    """The learner answered this request with a failure of its own (it is up): tried again
    like an outage, but after LEARNER_FAILED_TRIES in a row the batch is charged as a failed
    step (split turn by turn, then quarantine), so one batch the learner cannot take never
    holds training up for good."""


class LearnerRefused(ValueError):
    """A learner elsewhere refused what was asked (a wrong key, an unknown base model, a run
    of another layout, a state it does not have): trying again will not help."""


class LayoutMismatch(ValueError):
    """A checkpoint of another model or LoRA layout than the learner's (its message: where)."""


@dataclass
class ForwardBackwardOutput:
    loss: float  # summed over the examples, each already divided by `tokens`
    kl: float  # summed over the trained tokens (0 without a KL penalty)
    entropy: float  # summed over the trained tokens
    tokens: int  # completion tokens of the call: the normaliser
    shard_tokens: list[int] | None = None  # under mlx.launch: each rank's share (sequence tokens)


@dataclass
class OptimStepOutput:
    grad_norm: float  # before clipping
    learning_rate: float
    run_step: int | None = None  # a remote run's optimizer steps, every replica's (else None)
    line: dict = field(default_factory=dict)  # what the step's line says of this learner


@dataclass
class ResumePoint:
    """Where training goes on after a checkpoint: the step and adapter version, and the turns
    (keys) of the LOST_STEPS steps recorded after it that the learner no longer holds."""

    step: int
    version: int
    lost: set[str] = field(default_factory=set)
    lost_steps: int = 0


class Learner(Protocol):
    """The calls the trainer makes (training/runner.py, publisher.py, saving.py, control.py)."""

    backend: str  # /healthz's trainer `backend`
    record_stamp: dict | None  # what every training.jsonl line says of the learner
    off_policy: str  # what the step applies: "decoupled" or "coupled" (training/losses.py)
    publish_every: int  # a step's weights are published every this many steps
    check_every: float | None  # seconds between idle looks for others' steps (None: no one)
    checkpoints: Path
    lr_scale: float
    weights: dict  # the adapter it holds now, asking no one (a learner elsewhere: last synced)

    def too_big(self, ex: dict) -> str | None: ...
    def forward_backward(self, examples: list[dict], between) -> ForwardBackwardOutput: ...
    def proximal(self, examples: list[dict], between) -> None: ...
    def learning_rate(self) -> float: ...
    def optim_step(self, learning_rate: float) -> OptimStepOutput: ...
    def went_back(self) -> tuple[int, int] | None: ...
    def weights_for(self, engine, version: int) -> dict | None: ...
    def fetch_changed(self) -> dict | None: ...
    def save_state(self, step: int, version: int, metadata: dict) -> Path: ...
    def load_state(self, path: Path) -> dict: ...
    def resume_state(self, path: Path) -> tuple[dict | None, list[str]]: ...
    def resume_point(self, lines: list[dict], step: int, version: int) -> ResumePoint: ...
    def forget_state(self, checkpoint: Path) -> None: ...
    def snapshot(self) -> dict: ...
    def restore(self, snapshot: dict) -> None: ...
    def health(self) -> dict: ...
    def close(self) -> None: ...


def training_copy(loaded) -> nn.Module:
    """A second model object over the same base arrays, with LoRA layers of its own."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model = architecture(loaded)  # weights never read; the serving model's RoPE scaling
    cfg = loaded.lora_config
    linear_to_lora_layers(model, cfg["num_layers"], cfg["lora_parameters"])
    quantize_base(model, loaded.quantize_bits)  # the same structure as the serving model
    model.update(tree_unflatten(tree_flatten(loaded.model.parameters())))
    model.freeze()
    model.unfreeze(keys=["lora_a", "lora_b"], strict=False)
    model.train()
    mx.eval(model.parameters())
    return model


class LocalLearner:
    """The learner in this process, on the model it is given. Its weights are at hand after
    every step, no one else trains them, and a kill loses its steps since the last checkpoint."""

    backend = "local"
    record_stamp = None
    publish_every = 1
    check_every = None

    def __init__(self, settings: Settings, model: nn.Module, lora_config: dict,
                 checkpoints: Path, ref_model: nn.Module | None = None):
        t = settings.trainer
        self.t, self.settings, self.model, self.ref_model = t, settings, model, ref_model
        self.lora_config, self.checkpoints = lora_config, Path(checkpoints)
        self.optimizer = optim.AdamW(learning_rate=t.learning_rate, weight_decay=t.weight_decay)
        self.optimizer.init(model.trainable_parameters())
        mx.eval(self.optimizer.state)  # concrete now: the trainer thread must not build on it
        self.loss_fn = losses.trainer_loss(t.loss_fn, t.off_policy)
        self.off_policy = ("decoupled" if t.off_policy == "decoupled"
                           and t.loss_fn in losses.DECOUPLED else "coupled")
        self.lr_scale = 1.0  # times the schedule's rate; each gate rollback multiplies it
        self.grads = None  # accumulated by forward_backward since the last optim_step
        self.shape = chunked_grad.model_shape(model)
        self.memory_budget = (t.train_memory_gb * 2**30 if t.train_memory_gb
                              else chunked_grad.default_budget(model, ref_model))

    def too_big(self, ex: dict) -> str | None:
        """Why a step on example EX would not fit in the memory budget, or None."""
        return chunked_grad.over_budget(self.shape, ex, self.t.train_chunk_tokens,
                                        self.t.prompt_grad, self.memory_budget)

    def forward_backward(self, examples: list[dict],
                         between: Callable[[float], None]) -> ForwardBackwardOutput:
        """The loss of EXAMPLES (training/examples.py), normalised by their completion
        tokens, and its LoRA gradient, added to the accumulated one. One micro-step per
        example, each cut into units followed by `between(seconds)`. A call that raises adds
        nothing."""
        n_tokens = sum(e["tokens"] for e in examples)
        loss, kl, entropy, grads = self.gradients(examples, n_tokens, between)
        self.accumulate(grads)
        return ForwardBackwardOutput(loss, kl, entropy, n_tokens)

    def gradients(self, examples: list[dict], n_tokens: int,
                  between: Callable[[float], None]) -> tuple[float, float, float, dict | None]:
        """(loss, KL, entropy, LoRA gradient) summed over EXAMPLES, each example's loss divided
        by N_TOKENS (the whole batch's, which a rank's share of it is not); None: no examples."""
        grads, total, kl_total, entropy = None, 0.0, 0.0, 0.0
        t = self.t
        for ex in examples:
            (loss, kl, ent), g = chunked_grad.example_grad(
                self.model, ex, self.loss_fn, n_tokens, chunk=t.train_chunk_tokens,
                prompt_grad=t.prompt_grad, between=between, ref_model=self.ref_model,
                kl_coef=t.kl_coef, entropy_coef=t.entropy_coef, eps_low=t.eps_low,
                eps_high=t.eps_high, beta=t.dro_beta, weight_cap=t.behaviour_weight_cap)
            grads = g if grads is None else tree_map(mx.add, grads, g)
            total += loss
            kl_total += kl
            entropy += ent
        return total, kl_total, entropy, grads

    def accumulate(self, grads: dict | None) -> None:
        if grads is not None:
            self.grads = grads if self.grads is None else tree_map(mx.add, self.grads, grads)

    def proximal(self, examples: list[dict], between: Callable[[float], None]) -> None:
        """Fix each example's proximal log-probs (`prox`) at the current weights, for decoupled
        losses over several epochs (with one, prox is the step's own log-probs: free)."""
        for ex in examples:
            ids = ex["ids"]
            lp = chunked_grad.chunked_logprobs(self.model, mx.array(ids[:-1])[None],
                                               mx.array(ids[1:])[None], ex["mask"],
                                               self.t.train_chunk_tokens, between)
            ex["prox"] = lp[0].tolist()

    def learning_rate(self) -> float:
        """The rate of the next update: the schedule at the optimizer's update count."""
        return schedule.lr_at(int(self.optimizer.state["step"].item()), self.t, self.lr_scale)

    def optim_step(self, learning_rate: float) -> OptimStepOutput:
        """Apply the accumulated gradient (clipped to grad_clip when set) at LEARNING_RATE."""
        grads, self.grads = self.grads, None
        if self.t.grad_clip > 0:
            grads, grad_norm = optim.clip_grad_norm(grads, self.t.grad_clip)
        else:
            grad_norm = mx.sqrt(sum((g * g).sum() for _, g in tree_flatten(grads)))
        self.optimizer.learning_rate = learning_rate
        self.optimizer.update(self.model, grads)
        mx.eval(self.model.parameters(), self.optimizer.state, grad_norm)
        return OptimStepOutput(float(grad_norm.item()), learning_rate)

    def went_back(self) -> None:
        return None  # only this process steps it

    def health(self) -> dict:
        return {}  # nothing beyond the trainer's own object on /healthz

    def close(self) -> None:
        pass  # nothing held outside this process

    def save_weights_for_sampler(self) -> dict[str, mx.array]:
        """The adapter to serve (evaluated arrays, by LoRA parameter name)."""
        return lora_weights(self.model)

    @property
    def weights(self) -> dict[str, mx.array]:
        return lora_weights(self.model)

    def weights_for(self, engine, version: int) -> dict[str, mx.array]:
        """The adapter to publish as VERSION: at hand."""
        return self.save_weights_for_sampler()

    def fetch_changed(self) -> None:
        return None  # no one else trains it

    def set_weights(self, weights: dict[str, mx.array]) -> None:
        """Put WEIGHTS into the model (the optimizer state stays): the eval gate measures the
        served and the base adapter this way."""
        self.model.update(tree_unflatten(list(weights.items())))

    # ---- state: checkpoints and snapshots ----

    def save_state(self, step: int, version: int, metadata: dict) -> Path:
        """Checkpoint STEP under `checkpoints`: the adapter (as adapter VERSION), the optimizer
        state, and trainer_state.json with the settings, METADATA (the loop's: its reward
        baseline, the served version), the learning-rate scale and schedule. The loop prunes
        (it knows which checkpoints a rollback needs)."""
        extra = {**metadata, "lr_scale": self.lr_scale, "schedule": schedule.describe(self.t),
                 "entropy_coef": self.t.entropy_coef}
        return save_checkpoint(self.checkpoints, step, version, lora_weights(self.model),
                               self.optimizer.state, self.lora_config,
                               self.settings.model_dump(mode="json"), extra=extra)

    def load_state(self, path: Path) -> dict:
        """Load checkpoint PATH's adapter and optimizer state (the update count the schedule
        runs on comes with it); its trainer_state.json. LayoutMismatch, with nothing changed,
        for a checkpoint of another model or LoRA layout (MLX's `update` would take it)."""
        adapter, opt_state, state = load_checkpoint(path)
        problem = layout_mismatch(lora_weights(self.model), adapter, self.optimizer.state,
                                  opt_state)
        if problem:
            raise LayoutMismatch(problem)
        self.restore({"adapter": adapter, "optimizer": opt_state})
        return state

    def resume_state(self, path: Path) -> tuple[dict | None, list[str]]:
        """`load_state` at start-up, forgiving: checkpoint PATH's adapter must be readable
        (checkpoints.py UNREADABLE otherwise) and of this layout (LayoutMismatch); an
        unreadable optimizer state or trainer_state.json is named in the list instead, and
        training goes on from the weights with this fresh optimizer (the state: None)."""
        adapter, opt_state, state, problems = read_checkpoint(path, partial=True)
        weights = lora_weights(self.model)
        problem = layout_mismatch(weights, adapter)
        if problem:
            raise LayoutMismatch(problem)
        if opt_state is not None and layout_mismatch(weights, adapter, self.optimizer.state,
                                                     opt_state):
            problems.append("optimizer.safetensors: its state has other shapes than this "
                            "optimizer's")
            opt_state = None
        self.restore({"adapter": adapter,
                      "optimizer": self.optimizer.state if opt_state is None else opt_state})
        return state, problems

    def resume_point(self, lines: list[dict], step: int, version: int) -> ResumePoint:
        """After checkpoint STEP (0: none) of adapter VERSION: the steps training.jsonl's LINES
        record after it died with the process that took them, and their turns train again."""
        n, lost = lost_steps(lines, step)
        return ResumePoint(step, version, lost, n)

    def forget_state(self, checkpoint: Path) -> None:
        pass  # a pruned checkpoint's folder is all there is

    def snapshot(self) -> dict:
        """The adapter and optimizer state, for `restore` (arrays are immutable: references
        suffice)."""
        return {"adapter": lora_weights(self.model),
                "optimizer": tree_map(lambda x: x, self.optimizer.state)}

    def restore(self, snapshot: dict) -> None:
        self.set_weights(snapshot["adapter"])
        self.optimizer.state = tree_map(lambda x: x, snapshot["optimizer"])  # its own containers
        mx.eval(self.model.parameters(), self.optimizer.state)
