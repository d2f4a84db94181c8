"""Saved adapters served by name beside the live one: a checkpoint asked for as `MODEL@STEP`
(api/turns.py) and the Tinker API's sampler weights (tinker/sampling.py) take this one path.

An adapter saved in mlx-lm's layout at a path becomes a model object sharing the serving model's
frozen base arrays (serving/model.py `saved_adapter_model`), built on a worker thread of its own
(MLX work off the event loop), and the engine serves it by name (Engine.add_adapter: decoded
beside the live batch, serving/named.py). Its name is the path and the file's modification time,
so weights saved again under the same path are a new adapter. At most MAX_ADAPTERS are loaded;
the least recently used is dropped first (its samples under way finish on it). A path asked for
by many requests at once is loaded once: the first starts the load, the others wait for it.
Event loop only.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import mlx.nn as nn

from rlproxy.lru import LRU
from rlproxy.mlx_threads import Worker
from rlproxy.serving.model import saved_adapter_model

MAX_ADAPTERS = 8


class SavedAdapters:
    def __init__(self, loaded, engine):
        self.loaded, self.engine = loaded, engine
        self.adapters: LRU[str, nn.Module] = LRU(MAX_ADAPTERS)  # name -> its model
        self.loading: dict[str, asyncio.Task] = {}  # name -> its load under way
        self._worker: Worker | None = None  # started at the first load

    async def model_for(self, path: Path) -> tuple[str, nn.Module]:
        """(the engine's name for the adapter saved at PATH, its model object). Raises
        FileNotFoundError when nothing is saved there."""
        try:
            name = f"{path}@{(path / 'adapters.safetensors').stat().st_mtime_ns}"
        except OSError:
            raise FileNotFoundError(path) from None
        if name in self.adapters:
            return name, self.adapters.get(name)
        load = self.loading.get(name)
        if load is None:
            load = self.loading[name] = asyncio.create_task(self._load(name, path))
            load.add_done_callback(lambda _: self.loading.pop(name, None))
        # shielded: a waiter whose request is cancelled does not cancel the others' load
        return name, await asyncio.shield(load)

    async def _load(self, name: str, path: Path) -> nn.Module:
        if self._worker is None:
            self._worker = Worker("rlproxy-adapters")
        model = await asyncio.wrap_future(self._worker.run(saved_adapter_model, self.loaded,
                                                           path))
        if len(self.adapters) >= MAX_ADAPTERS:
            oldest = self.adapters.oldest()
            self.adapters.pop(oldest)
            self.engine.drop_adapter(oldest)  # its samples under way finish first
        self.engine.add_adapter(name, model)
        self.adapters.put(name, model)
        return model

    async def aclose(self) -> None:
        """Cancel the loads under way, drop every adapter from the engine, stop the worker."""
        for load in list(self.loading.values()):
            load.cancel()
        for name in list(self.adapters):
            self.engine.drop_adapter(name)
            self.adapters.pop(name)
        if self._worker is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._worker.stop)
