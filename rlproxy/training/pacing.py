"""Serving first: the trainer's work in units, and the rest it takes between them.

Training steps (training/chunked_grad.py, the optimizer update) and evaluations
(training/gate.py) are cut into units of bounded time and memory, each ending in mx.eval. After
each unit the `Pacer` is called with the unit's seconds: while the engine has requests waiting or
decoding it rests spent * (1 - d) / d, so a request arriving mid-step waits at most for the unit
in progress, and under constant traffic training still gets its share d (`duty_cycle`). It
counts the units of the current step or evaluation for its line in training.jsonl.

A stop (`stop`: SIGTERM, the trainer's `stop`) ends a training step at its next unit: `unit`
raises `Stopped` there instead of resting, so the trainer thread leaves MLX well within
--drain-timeout-s however long the step (an MLX thread still computing when the interpreter exits
aborts the process, or has OpenBLAS print "BLAS : Bad memory unallocation!").

Not here: what the units compute, the engine (only its `busy`).
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class Stopped(Exception):
    """The trainer is stopping: the step in progress ends at this unit, its turns uncharged."""


class Pacer:
    def __init__(self, busy: Callable[[], bool] | None, duty_cycle: float):
        self.busy, self.duty_cycle = busy, duty_cycle  # busy: None without an engine
        self.units = {"units": 0, "max_unit_s": 0.0, "yielded_s": 0.0}
        self._stop = threading.Event()

    def stop(self) -> None:
        """From any thread: the step in progress ends at its next unit (`unit` raises)."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def restart(self) -> None:
        """A new step or evaluation: its units are counted from 0."""
        self.units = {"units": 0, "max_unit_s": 0.0, "yielded_s": 0.0}

    def __call__(self, spent: float) -> None:
        u = self.units
        u["units"] += 1
        u["max_unit_s"] = max(u["max_unit_s"], spent)
        if self.busy is not None and self.busy() and not self.stopping:
            tic = time.perf_counter()
            self._stop.wait(spent * (1 - self.duty_cycle) / self.duty_cycle)  # a stop: at once
            u["yielded_s"] += time.perf_counter() - tic

    def unit(self, spent: float) -> None:
        """After a unit of a training step's forward and backward (the `between` the learner
        calls): as `__call__`, then `Stopped` when a stop was asked for."""
        self(spent)
        if self.stopping:
            raise Stopped(f"stopped after unit {self.units['units']} of the step")


class StepTurns:
    """One training step (or evaluation) at a time across the trainers of one process (the
    default adapter's and each personal adapter's, pipeline.py), taken in the order they asked:
    a ticket lock, so a trainer with work always waiting cannot take every step while another
    waits. Each step paces itself as above, so together they keep the one duty cycle. A trainer
    that is stopping gives up its place in the line (`take` returns False) instead of waiting
    for a turn it would only end at once; the line skips it. Any thread."""

    def __init__(self):
        self._cond = threading.Condition()
        self._next = self._now = 0
        self._gave_up: set[int] = set()

    def take(self, stopping: Callable[[], bool]) -> bool:
        """Wait for this caller's turn: True once it is here (`give` it back after), False
        when STOPPING says so first."""
        with self._cond:
            ticket, self._next = self._next, self._next + 1
            while self._now != ticket:
                if stopping():
                    self._gave_up.add(ticket)
                    return False
                self._cond.wait(timeout=0.1)
            return True

    def give(self) -> None:
        with self._cond:
            self._now += 1
            while self._now in self._gave_up:
                self._gave_up.discard(self._now)
                self._now += 1
            self._cond.notify_all()
