"""A personal adapter's place in the engine: what its trainer publishes to.

A personal adapter (`MODEL:NAME` or `X-RL-Adapter: NAME`, pipeline.py `Adapters`) is served by
name beside the live adapter, in the same decode batch (serving/named.py). Its trainer is the
same `Trainer` as the default adapter's, and this object is the face of the engine it is
given: `publish_adapter(weights, version)` makes a model object over the serving model's base
arrays with those LoRA weights and hands it to the engine under NAME (`Engine.add_adapter`:
jobs admitted before finish on the model they started with), `busy` is the engine's (the
trainer yields to all serving, not only its own), and it has no prefix cache (named jobs do not
use it). The training copy a personal adapter starts from is `training_model`: the base with a
fresh LoRA, equal to the base until it trains, whatever the default adapter has learned.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from rlproxy.serving.model import lora_model, serve_lora_in_one_step


class PersonalAdapter:
    prefix_cache = None  # a named adapter's jobs neither restore nor store KV

    def __init__(self, engine, loaded, name: str):
        self.engine, self.loaded, self.name = engine, loaded, name
        self.lora_config = loaded.lora_config
        self.adapter_version = 0
        self.stats = engine.stats  # last_swap_ms: the engine's, as the step lines report it

    def busy(self) -> bool:
        return self.engine.busy()

    def publish_adapter(self, weights: dict[str, mx.array], version: int) -> None:
        """From the trainer's thread: serve WEIGHTS as version VERSION of this adapter."""
        model = lora_model(self.loaded, self.lora_config)
        model.update(tree_unflatten(list(weights.items())))
        serve_lora_in_one_step(model)  # a lone stream on it decodes with its own layers
        model.eval()
        mx.eval(model.parameters())
        self.engine.add_adapter(self.name, model, version)
        self.adapter_version = version

    def drop(self) -> None:
        self.engine.drop_adapter(self.name)


def training_model(loaded, seed: int | None = None) -> nn.Module:
    """A training copy over LOADED's base arrays with a fresh LoRA (B = 0: the base)."""
    model = lora_model(loaded, loaded.lora_config, seed=seed)
    model.train()
    return model
