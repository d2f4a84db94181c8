"""A personal adapter's place in the engine: what its trainer publishes to.

A personal adapter (`MODEL:NAME` or `X-RL-Adapter: NAME`, pipeline.py `Adapters`) is served by
name beside the live adapter, in the same decode batch (serving/named.py). Its trainer is the
same `Trainer` as the default adapter's, and this object is the face of the engine it is
given: `publish_adapter(weights, version)` makes a model object over the serving model's base
arrays with those LoRA weights and hands it to the engine under NAME (`Engine.add_adapter`:
jobs admitted before finish on the model they started with), `busy` is the engine's (the
trainer yields to all serving, not only its own). Each version goes with its fingerprint, so
the adapter's jobs restore and store prefix KV in a lineage of its own (kv/prefix_cache.py):
an agent's next turn prefills only what is new, and one adapter's KV never serves another's
request; `prefix_cache` is that lineage as the trainer sees it (a rollback starts a new one).
The training copy a personal adapter starts from is `training_model`: the base with a fresh
LoRA, equal to the base until it trains, whatever the default adapter has learned.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from rlproxy.kv.blobs import adapter_fingerprint
from rlproxy.serving.model import lora_model, saved_adapter_model, serve_lora_in_one_step


class PersonalLineage:
    """The engine's prefix cache as one personal adapter's trainer sees it."""

    def __init__(self, cache, name: str):
        self.cache, self.name = cache, name

    def reset_lineage(self, version: int) -> None:
        self.cache.reset_lineage(version, self.name)


class PersonalAdapter:
    def __init__(self, engine, loaded, name: str):
        self.engine, self.loaded, self.name = engine, loaded, name
        self.lora_config = loaded.lora_config
        self.adapter_version = 0
        self.stats = engine.stats  # last_swap_ms: the engine's, as the step lines report it
        self.prefix_cache = (PersonalLineage(engine.prefix_cache, name)
                             if engine.prefix_cache is not None else None)

    def busy(self) -> bool:
        return self.engine.busy()

    def publish_adapter(self, weights: dict[str, mx.array], version: int) -> None:
        """From the trainer's thread: serve WEIGHTS as version VERSION of this adapter."""
        model = lora_model(self.loaded, self.lora_config)
        model.update(tree_unflatten(list(weights.items())))
        serve_lora_in_one_step(model)  # a lone stream on it decodes with its own layers
        model.eval()
        mx.eval(model.parameters())
        self._serve(model, version)

    def publish_saved(self, path, version: int) -> None:
        """Serve the adapter saved at PATH (a checkpoint: with training off, its newest) as
        VERSION; ValueError for one that does not fit the model."""
        self._serve(saved_adapter_model(self.loaded, path), version)

    def _serve(self, model: nn.Module, version: int) -> None:
        fingerprint = adapter_fingerprint(model) if self.prefix_cache is not None else None
        self.engine.add_adapter(self.name, model, version, fingerprint)
        self.adapter_version = version

    def drop(self) -> None:
        self.engine.drop_adapter(self.name)


def training_model(loaded, seed: int | None = None) -> nn.Module:
    """A training copy over LOADED's base arrays with a fresh LoRA (B = 0: the base)."""
    model = lora_model(loaded, loaded.lora_config, seed=seed)
    model.train()
    return model
