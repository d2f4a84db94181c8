"""Tinker training runs and the client handles that train them, all owned by ONE worker thread.

A run holds LoRA weights on the serving model's frozen base arrays, its AdamW state and its step
count. A handle (one create_model call, "SESSION:train:N") is bound to one run and keeps only its
own accumulated gradients: several handles (replicas) may share a run (runs.py names and finds
runs). An optim_step applies exactly its handle's batches since that handle's last step, their
gradients taken at the run's weights when the step runs: if another handle stepped the run in
between, the gradients are computed again from the kept batches, so interleaved clients end with
the weights of the same steps applied one after another.

The loss is training/losses.py's (the five policy losses, summed over tokens as Tinker's are),
on the same temperature-1 log-probs the engine records (serving/logprobs.py). Weights are saved
in mlx-lm's adapter format (plus `optimizer.safetensors` and trainer_state.json, so
training/checkpoints.py's load_checkpoint reads them), which `rlproxy serve --adapter`,
`rlproxy fuse` and `mlx_lm.load` open. HTTP, request ordering and sampling live elsewhere
(routes.py, sampling.py).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from rlproxy.paths import TRAINER_STATE
from rlproxy.serving.logprobs import sequence_logprobs, token_logprobs
from rlproxy.serving.model import lora_model, lora_weights, save_adapter
from rlproxy.serving.model import adapter_config as config_of  # noqa: F401  (runs.py, routes.py)
from rlproxy.tinker.wire import UserError
from rlproxy.training import losses
from rlproxy.training.checkpoints import load_checkpoint, save_optimizer, written_whole

RL_INPUTS = ("target_tokens", "logprobs", "advantages")
# optim_step's metrics: the run's optimizer steps after this one (no ':', it is no reduction)
STEP_METRIC = "rlproxy_run_step"


@dataclass
class Run:
    """Weights, optimizer state and step count, shared by every handle bound to the run."""
    name: str  # the directory (and tinker:// run) its checkpoints go under
    base_model: str  # the serving model's id (LoadedModel.model_id)
    model: nn.Module
    lora_config: dict
    optimizer: optim.AdamW
    step: int = 0  # optimizer steps applied
    version: int = 0  # bumped by every change of the weights (a step, a load)
    named: bool = False  # joined by name (user_metadata rlproxy_run); else one handle's own
    handles: set = field(default_factory=set)  # model ids bound to it
    last_used: float = 0.0  # time.monotonic() of its last request, join or leave (runs.py)
    evicted: Path | None = None  # while out of memory (model and optimizer None): its save
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)  # this object, of all by `name`

    @property
    def rank(self) -> int:
        return int(self.lora_config["lora_parameters"]["rank"])


@dataclass
class TinkerModel:
    """One client handle: its gradients since its last optim_step, and its request order."""
    model_id: str
    run: Run
    batches: list = field(default_factory=list)  # value_grads' batches since the last step
    grads: dict | None = None  # their summed gradients, taken at run version `grads_at`
    grads_at: int = -1
    next_seq: int = 1  # routes.py runs requests in seq_id order from here
    held: dict = field(default_factory=dict)


def lora_config_for(loaded, rank: int) -> dict:
    """The serving model's LoRA layout (layers, keys, scale) at the client's rank."""
    cfg = json.loads(json.dumps(loaded.lora_config))
    cfg["lora_parameters"]["rank"] = int(rank)
    return cfg


def _trainable(loaded, cfg: dict, seed: int | None) -> tuple[nn.Module, optim.AdamW]:
    """A fresh LoRA model at CFG and its AdamW (moments at zero)."""
    model = lora_model(loaded, cfg, seed)
    opt = optim.AdamW(learning_rate=1e-4, betas=[0.9, 0.95], eps=1e-12, weight_decay=0.0,
                      bias_correction=True)
    opt.init(model.trainable_parameters())
    mx.eval(opt.state)
    return model, opt


def new_run(loaded, name: str, rank: int, seed: int | None, named: bool = False) -> Run:
    if not 1 <= rank <= 256:
        raise UserError(f"lora rank must be between 1 and 256, got {rank}")
    cfg = lora_config_for(loaded, rank)
    model, opt = _trainable(loaded, cfg, seed)
    return Run(name, loaded.model_id, model, cfg, opt, named=named)


def evict(run: Run, path: Path) -> None:
    """Save RUN (weights, optimizer state, step) at PATH and free its arrays: `restore` brings
    it back as it was. Its handles keep their gradients."""
    save(TinkerModel("-", run), path, True)
    run.model = run.optimizer = None
    run.evicted = path


def restore(loaded, run: Run) -> None:
    """An evicted RUN back in memory from its save. Its version stays: the weights are the ones
    it had, so gradients its handles took before the eviction still apply."""
    run.model, run.optimizer = _trainable(loaded, run.lora_config, None)
    adapter, run.optimizer.state, state = load_checkpoint(run.evicted)
    run.model.update(tree_unflatten(list(adapter.items())))
    run.step = int(state.get("step", run.step))
    mx.eval(run.model.parameters(), run.optimizer.state)
    run.evicted = None


def memory_bytes(run: Run) -> int:
    """LoRA weights + AdamW moments + one handle's gradients (the base is shared)."""
    n = sum(v.nbytes for v in lora_weights(run.model).values())
    return n * 4  # weights, m, v, gradients


# ---- forward_backward ----

def _examples(data: list[dict], loss_fn: str, vocab: int, context: int) -> list[dict]:
    """Each datum as arrays, or UserError saying what is wrong with it."""
    needs = ("target_tokens", "weights") if loss_fn == "cross_entropy" else RL_INPUTS
    out = []
    for i, d in enumerate(data):
        ids, inputs = d["tokens"], d["inputs"]
        missing = [k for k in needs if k not in inputs]
        if missing:
            raise UserError(f"datum {i}: loss {loss_fn!r} needs loss_fn_inputs "
                            f"{', '.join(needs)}; missing {', '.join(missing)}")
        n = len(ids)
        if n == 0:
            raise UserError(f"datum {i}: model_input is empty")
        if n > context:
            raise UserError(f"datum {i}: {n} tokens is longer than the model's context of "
                            f"{context}")
        for k in dict.fromkeys([*needs, *(["weights"] if "weights" in inputs else [])]):
            if inputs[k].reshape(-1).size != n:
                raise UserError(f"datum {i}: loss_fn_inputs[{k!r}] has shape "
                                f"{list(inputs[k].shape)} but model_input has {n} tokens")
        targets = inputs["target_tokens"].reshape(-1).astype(np.int64)
        for name, toks in (("model_input", np.asarray(ids)), ("target_tokens", targets)):
            bad = toks[(toks < 0) | (toks >= vocab)]
            if bad.size:
                raise UserError(f"datum {i}: {name} holds token id {int(bad[0])}, outside the "
                                f"vocabulary of {vocab}")
        zeros = np.zeros(n, dtype=np.float32)
        out.append({
            "ids": mx.array(np.asarray(ids, dtype=np.int32))[None],
            "targets": mx.array(targets.astype(np.int32))[None],
            "old": mx.array(inputs.get("logprobs", zeros).reshape(-1).astype(np.float32))[None],
            "adv": mx.array(inputs.get("advantages", zeros).reshape(-1).astype(np.float32))[None],
            # cross_entropy weighs tokens by `weights`; the RL losses sum every token (a prompt
            # token carries advantage 0), as Tinker's do, unless `weights` is given: then it
            # masks them too (DRO's penalty is not 0 at a prompt position; remote/datums.py)
            "mask": mx.array(inputs["weights"].reshape(-1).astype(np.float32))[None]
            if "weights" in inputs else mx.ones((1, n)),
        })
    return out


def loss_kwargs(config: dict) -> dict:
    """Tinker's clip thresholds are ratio bounds (e.g. 0.8, 1.2); training/losses.py takes eps."""
    kw = {}
    if "clip_low_threshold" in config:
        kw["eps_low"] = 1.0 - float(config["clip_low_threshold"])
    if "clip_high_threshold" in config:
        kw["eps_high"] = float(config["clip_high_threshold"]) - 1.0
    if "beta" in config:
        kw["beta"] = float(config["beta"])
    return kw


def value_grads(model: nn.Module, batch: tuple, backward: bool):
    """(summed loss, per-datum log-probs, summed gradients or None) of one batch:
    (examples, loss function, its keyword arguments, its name)."""
    examples, fn, kw, _name = batch

    def datum_loss(model, ex):
        logp = token_logprobs(model, ex["ids"], ex["targets"])
        return fn(logp, ex["old"], ex["adv"], ex["mask"], **kw), logp

    value_grad = nn.value_and_grad(model, datum_loss)
    total, outputs, grads = 0.0, [], None
    for ex in examples:
        if backward:
            (loss, logp), g = value_grad(model, ex)
            grads = g if grads is None else tree_map(mx.add, grads, g)
            mx.eval(loss, logp, grads)
        else:
            loss, logp = datum_loss(model, ex)
            mx.eval(loss, logp)
        total += loss.item()
        outputs.append(np.array(logp[0], dtype=np.float32))
    return total, outputs, grads


def here(run: Run, batch: tuple, backward: bool):
    """`value_grads` on RUN's model in this process (under mlx.launch, tinker/ranks.py's
    `value_grads` shares the batch out to every rank instead)."""
    return value_grads(run.model, batch, backward)


def forward_backward(tm: TinkerModel, req: dict, vocab: int, context: int, compute=None):
    """(per-datum log-probs as numpy, metrics) at the run's current weights. Unless
    forward_only, keeps the batch and adds its gradients to the handle's."""
    try:
        fn = losses.policy_loss(req["loss_fn"])
    except ValueError as e:
        raise UserError(str(e)) from None
    batch = (_examples(req["data"], req["loss_fn"], vocab, context), fn,
             loss_kwargs(req["loss_fn_config"]), req["loss_fn"])
    total, outputs, g = (compute or here)(tm.run, batch, not req["forward_only"])
    if g is not None:
        if not tm.batches:
            tm.grads, tm.grads_at = g, tm.run.version
        elif tm.grads is not None and tm.grads_at == tm.run.version:
            tm.grads = tree_map(mx.add, tm.grads, g)
            mx.eval(tm.grads)
        else:  # the run moved between this handle's batches: optim_step recomputes them all
            tm.grads = None
        tm.batches.append(batch)
    return outputs, {"loss:sum": total}


def current_grads(tm: TinkerModel, compute=None) -> dict:
    """The handle's gradients at the run's weights now: kept if taken at this version, else
    taken again, batch by batch in the order they came."""
    if tm.grads is not None and tm.grads_at == tm.run.version:
        return tm.grads
    grads = None
    for batch in tm.batches:
        g = (compute or here)(tm.run, batch, True)[2]
        grads = g if grads is None else tree_map(mx.add, grads, g)
        mx.eval(grads)
    return grads


def optim_step(tm: TinkerModel, adam: dict, compute=None) -> dict:
    """Apply the handle's gradients to its run with this call's AdamW hyperparameters."""
    if not tm.batches:
        raise UserError(f"optim_step on {tm.model_id}: no forward_backward since the last "
                        "optim_step on this client, so there is nothing to apply")
    run, opt = tm.run, tm.run.optimizer
    opt.learning_rate = float(adam.get("learning_rate", 1e-4))
    opt.betas = [float(adam.get("beta1", 0.9)), float(adam.get("beta2", 0.95))]
    opt.eps = float(adam.get("eps", 1e-12))
    opt.weight_decay = float(adam.get("weight_decay", 0.0))
    grads, clip = current_grads(tm, compute), float(adam.get("grad_clip_norm") or 0.0)
    if clip > 0:
        grads, norm = optim.clip_grad_norm(grads, clip)
    else:
        norm = mx.sqrt(sum((g * g).sum() for _, g in tree_flatten(grads)))
    opt.update(run.model, grads)
    mx.eval(run.model.parameters(), opt.state)
    tm.batches, tm.grads = [], None
    run.step += 1
    run.version += 1
    return {"metrics": {"grad_norm:mean": float(norm.item()), STEP_METRIC: float(run.step)}}


# ---- weights on disk ----

def save(tm: TinkerModel, path: Path, with_optimizer: bool) -> Path:
    """The run's adapter in mlx-lm's format (+ optimizer state), written to a temp dir and
    renamed. trainer_state.json carries the run's step, which runs.py resumes from."""
    run = tm.run
    with written_whole(path) as tmp:
        save_adapter(run.model, run.lora_config, tmp)
        if with_optimizer:
            save_optimizer(tmp, run.optimizer.state)
        (tmp / TRAINER_STATE).write_text(json.dumps({
            "step": run.step, "adapter_version": run.step, "model_id": tm.model_id,
            "run": run.name, "base_model": run.base_model}))
    return path


def load(tm: TinkerModel, path: Path, with_optimizer: bool) -> None:
    """Saved weights (+ optimizer state and step) into the handle's run; drops the handle's
    gradients (the weights they were taken at are gone)."""
    run = tm.run
    if not (path / "adapters.safetensors").exists():
        raise UserError(f"no saved weights at {path.name!r}")
    if with_optimizer and not (path / "optimizer.safetensors").exists():
        raise UserError(f"{path.name!r} was saved without optimizer state (save_weights_for_"
                        "sampler); load it with load_state, not load_state_with_optimizer")
    adapter = mx.load(str(path / "adapters.safetensors"))
    mine = {k: v.shape for k, v in lora_weights(run.model).items()}
    if {k: v.shape for k, v in adapter.items()} != mine:
        raise UserError(f"{path.name!r} holds an adapter of another rank or layout than this "
                        "model's")
    run.model.update(tree_unflatten(list(adapter.items())))
    if with_optimizer:
        _, opt_state, state = load_checkpoint(path)
        run.optimizer.state = opt_state
        run.step = int(state.get("step", 0))
    run.version += 1
    tm.batches, tm.grads = [], None
    mx.eval(run.model.parameters(), run.optimizer.state)


def prompt_logprobs(model: nn.Module, ids: list[int]) -> list[float | None]:
    """log p(ids[t] | ids[:t]) at temperature 1 for t >= 1; the first token has none."""
    if len(ids) < 2:
        return [None] * len(ids)
    return [None] + sequence_logprobs(model, ids).tolist()
