"""Adapters the engine serves by name beside the live one, decoded in the live batch.

A named adapter (the Tinker API's sampler weights, a checkpoint asked for as `MODEL@STEP`:
serving/saved.py) is a model object sharing the serving model's frozen base arrays with LoRA
weights of its own. Its jobs decode in the engine's one batch, with the live adapter's: every
forward pass of the serving model knows which row runs which adapter (`RowsModel`, `use`), and
each LoRA projection adds, per row, that row's adapter term (ServingLoRALinear in
serving/model.py: y = x W^T + s_i (x A_i) B_i for row i's adapter). The adapters' A are laid
side by side and their scaled B one under the other, so the term is two plain matmuls for the
whole batch, s ((x [A_0 A_1 ..]) * mask) [B_0; B_1; ..], the mask keeping each row's own
columns (each B scaled by its own adapter's scale where scales differ): no per-row gather, no
small batched matmuls. A pass whose rows all
run the live adapter takes the live path unchanged (merged weights included: serving/merge.py).
So N adapters cost one decode step, not N (S-LoRA and Punica gather LoRA weights per row the
same way).

The side-by-side arrays are built when the set of adapters in a pass changes, or the live
adapter is swapped (`invalidate`); adapters may differ in rank (each has its own columns), and a
layer an adapter has no LoRA on gets zero columns.
A job is admitted with the model object it names (`Job.adapter_model`, else the one its name
holds now) and finishes on it, so adding a name again or dropping it never fails a job under
way; a job admitted by name only also takes the version its name holds (a personal adapter's,
serving/personal.py), which its tokens carry. No prefix cache for named jobs (their KV is not
the live adapter's), except a personal adapter's, which the engine keeps in a lineage of its
own (serving/personal.py); a lone named stream speculates with its own model (engine.py). Engine
thread only; knows nothing of HTTP, of the Tinker API or of personal adapters' training.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from rlproxy.serving.jobs import Job


@dataclass
class RowContext:
    """Shared by the live model's LoRA layers, for the pass being built: which of the adapters'
    side-by-side columns each row keeps ([rows, 1, columns], 1 or 0), or None when every row
    runs the live adapter."""
    mask: mx.array | None = None


class NamedAdapters:
    def __init__(self, model: nn.Module):
        from rlproxy.serving.model import ServingLoRALinear

        self.names: dict[str, nn.Module] = {}
        self.versions: dict[str, int] = {}  # a name's adapter version (a personal adapter's)
        self.ctx = RowContext()
        self.layers = {n: m for n, m in model.named_modules() if isinstance(m, ServingLoRALinear)}
        for layer in self.layers.values():
            layer._rows = self.ctx
        self.of_uid: dict[int, nn.Module] = {}  # a named job's uid in the batch -> its model
        self._slots: list[nn.Module] = []  # the stacks' named adapters: slot i + 1
        self._stale = True

    def change(self, kind: str, name: str, model: nn.Module | None, version: int = 0) -> None:
        """`add_adapter` (NAME now names MODEL, as adapter version VERSION) or `drop_adapter`.
        Jobs already admitted finish on the model they were admitted with."""
        self.names.pop(name, None)
        self.versions.pop(name, None)
        if kind == "add_adapter":
            self.names[name], self.versions[name] = model, version

    def model_for(self, job: Job) -> nn.Module:
        """The model JOB decodes with; a job that names its adapter only by name also gets
        that name's version now (`Job.adapter_version`, on each of its tokens)."""
        if job.adapter_model is not None:
            return job.adapter_model
        model = self.names.get(job.adapter)
        if model is None:
            raise KeyError(f"no adapter named {job.adapter!r} is loaded")
        job.adapter_version = self.versions.get(job.adapter, 0)
        return model

    def admitted(self, uid: int, model: nn.Module) -> None:
        self.of_uid[uid] = model

    def ended(self, uid: int | None) -> None:
        self.of_uid.pop(uid, None)

    def forget_rows(self) -> None:
        """The batch was dropped (a failed step): no named job is in it any more."""
        self.of_uid.clear()

    def invalidate(self) -> None:
        """The live adapter's arrays changed (a swap): the stacks hold the old ones."""
        self._stale = True

    def rows(self, uids: list[int] | None) -> None:
        """The next pass runs the batch rows UIDS (None: not known, so no named job may be in
        the batch)."""
        if uids is None:
            if self.of_uid:
                raise RuntimeError("a forward pass over unknown rows while named adapters run")
            self.ctx.mask = None
            return
        self.use([self.of_uid.get(uid) for uid in uids])

    def use(self, models: list[nn.Module | None]) -> None:
        """The next pass runs one row per entry of MODELS (None: the live adapter)."""
        named = [m for m in models if m is not None]
        if not named:
            self.ctx.mask = None
            return
        if self._stale or any(all(m is not s for s in self._slots) for m in named):
            self._build(list({id(m): m for m in named}.values()))
        slot = [0 if m is None else 1 + next(i for i, s in enumerate(self._slots) if s is m)
                for m in models]
        self.ctx.mask = (self._columns[None, :] == mx.array(slot)[:, None]).astype(
            self._dtype)[:, None, :]

    def clear(self) -> None:
        self.ctx.mask = None

    def _build(self, models: list[nn.Module]) -> None:
        """Per live LoRA layer, its A and the MODELS' side by side and their B one under the
        other (zeros where a model has no LoRA on the layer), with the adapters' one scale (or
        None, then each B scaled by its own); and which adapter each column belongs to."""
        own = [{n: m for n, m in model.named_modules() if hasattr(m, "lora_a")}
               for model in models]
        ranks = [next(iter(layers.values())).lora_a.shape[1] if layers else 1 for layers in own]
        for name, layer in self.layers.items():
            parts = [(layer.lora_a, layer.lora_b, layer.scale)]
            for layers, rank in zip(own, ranks):
                m = layers.get(name)
                parts.append((mx.zeros((layer.lora_a.shape[0], rank), layer.lora_a.dtype),
                              mx.zeros((rank, layer.lora_b.shape[1]), layer.lora_b.dtype),
                              layer.scale) if m is None else (m.lora_a, m.lora_b, m.scale))
            scales = {float(sc) for _, _, sc in parts}
            # one scale (the usual case): applied after the matmuls, as each adapter's own
            # forward does (`addmm(y, x A, B, alpha=scale)`), so the rounding is the same
            one = scales.pop() if len(scales) == 1 else None
            layer._row_lora = (mx.concatenate([a for a, _, _ in parts], axis=1),
                               mx.concatenate([b if one is not None else sc * b
                                               for _, b, sc in parts], axis=0), one)
        first = next(iter(self.layers.values()))
        self._columns = mx.array(sum(([slot] * w for slot, w in enumerate(
            [first.lora_a.shape[1], *ranks])), []))
        self._dtype = first.lora_a.dtype
        mx.eval([layer._row_lora[:2] for layer in self.layers.values()], self._columns)
        self._slots, self._stale = list(models), False


class RowsModel:
    """The serving model as mlx-lm's BatchGenerator calls it: before each forward pass, which
    row runs which adapter. The generator's passes are made by its batches' own methods
    (GenerationBatch._step, PromptProcessingBatch.prompt, and a new GenerationBatch's first step
    in its constructor), each on a batch whose `uids` are its rows in order; the caller's frame
    is that batch. Everything else is the model's own."""

    def __init__(self, model: nn.Module, named: NamedAdapters):
        self.model, self.named = model, named

    def __call__(self, *args, **kwargs):
        caller = sys._getframe(1).f_locals.get("self")
        uids = getattr(caller, "uids", None)
        self.named.rows(list(uids) if isinstance(uids, list) else None)
        try:
            return self.model(*args, **kwargs)
        finally:
            self.named.clear()

    def __getattr__(self, name):
        return getattr(self.model, name)
