"""Serving first: the trainer's work in units, and the rest it takes between them.

Training steps (training/chunked_grad.py, the optimizer update) and evaluations
(training/gate.py) are cut into units of bounded time and memory, each ending in mx.eval. After
each unit the `Pacer` is called with the unit's seconds: while the engine has requests waiting or
decoding it rests spent * (1 - d) / d, so a request arriving mid-step waits at most for the unit
in progress, and under constant traffic training still gets its share d (`duty_cycle`). It
counts the units of the current step or evaluation for its line in training.jsonl.

Not here: what the units compute, the engine (only its `busy`).
"""

from __future__ import annotations

import time
from typing import Callable


class Pacer:
    def __init__(self, busy: Callable[[], bool] | None, duty_cycle: float):
        self.busy, self.duty_cycle = busy, duty_cycle  # busy: None without an engine
        self.units = {"units": 0, "max_unit_s": 0.0, "yielded_s": 0.0}

    def restart(self) -> None:
        """A new step or evaluation: its units are counted from 0."""
        self.units = {"units": 0, "max_unit_s": 0.0, "yielded_s": 0.0}

    def __call__(self, spent: float) -> None:
        u = self.units
        u["units"] += 1
        u["max_unit_s"] = max(u["max_unit_s"], spent)
        if self.busy is not None and self.busy():
            tic = time.perf_counter()
            time.sleep(spent * (1 - self.duty_cycle) / self.duty_cycle)
            u["yielded_s"] += time.perf_counter() - tic
