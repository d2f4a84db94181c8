"""User reward functions (`--reward-function module:function`): loading them, and calling them
off the event loop with a time limit.

A reward function is called as `function(turn, next_state, choice=i)` when it declares a
parameter named `choice` (i indexes `turn["choices"]`: the choice being scored), and as
`function(turn, next_state)` otherwise; such a two-argument function gets a copy of the turn
whose `chosen_choice` is i, so the usual `turn["choices"][turn["chosen_choice"]]` reads the
choice being scored. It returns a number (clipped to [-1, 1]) or None. Every choice of a request
is scored against the same next state (None for a session's last turn).

Each call runs on a thread of its own and is waited for at most `timeout_s`: a slow, hanging or
raising function is recorded as an error and never holds up serving or other scoring. A call
that overran keeps its thread until it returns (Python cannot stop a thread), and its slot: at
most `max_running` calls of one function run at once, and a call that finds no free slot within
its time limit fails the same way, so a function that always hangs cannot pile up threads.
Scorer-free, so the trainer's eval gate can use it: `call_with_timeout` is the same thread, waited
for from a thread instead of the event loop.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import threading
from typing import Callable


def load_reward_functions(names: list[str]) -> list[Callable]:
    out = []
    for name in names:
        module, func = name.split(":")
        try:
            out.append(getattr(importlib.import_module(module), func))
        except (ImportError, AttributeError) as e:
            raise ValueError(f"reward function {name!r} cannot be loaded: {e}") from None
    return out


def takes_choice(fn: Callable) -> bool:
    try:
        return "choice" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False


def call(fn: Callable, turn: dict, next_state, choice: int, new_style: bool):
    if new_style:
        return fn(turn, next_state, choice=choice)
    if choice != turn.get("chosen_choice", 0):
        turn = {**turn, "chosen_choice": choice}
    return fn(turn, next_state)


class Overran(TimeoutError):
    """A call that gave no answer within its time limit (its thread runs on)."""


def call_in_thread(fn: Callable, args: tuple, done: Callable, name: str) -> threading.Thread:
    """Start FN(*ARGS) on a daemon thread of its own, which calls DONE(result, error) when it
    returns or raises. Python cannot stop a thread: a call that hangs keeps it until it ends."""
    def run() -> None:
        try:
            result, error = fn(*args), None
        except Exception as e:  # handed to DONE
            result, error = None, e
        except BaseException as e:  # SystemExit & co. must not end the caller
            result, error = None, RuntimeError(f"raised {type(e).__name__}")
        done(result, error)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def call_with_timeout(fn: Callable, args: tuple, timeout_s: float, name: str):
    """FN(*ARGS) on a thread of its own, waited for at most TIMEOUT_S: its result, or its
    exception raised here, or Overran (the thread is left running: a hung user function must not
    hold the caller)."""
    box: list = []
    call_in_thread(fn, args, lambda result, error: box.append((result, error)), name).join(
        timeout_s)
    if not box:
        raise Overran(f"no answer within {timeout_s:g} s")
    result, error = box[0]
    if error is not None:
        raise error
    return result


def clip_reward(value) -> float | None:
    """A function's answer as a reward; ValueError for anything but a finite number or None."""
    if value is None:
        return None
    try:
        r = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"returned {str(value)[:80]!r}, not a number") from None
    if math.isnan(r):
        raise ValueError("returned NaN")
    return max(-1.0, min(1.0, r))


class RewardFunctions:
    def __init__(self, names: list[str], timeout_s: float, max_running: int = 8):
        self.functions = load_reward_functions(names)
        self.names = list(names)
        self.new_style = [takes_choice(fn) for fn in self.functions]
        self.timeout_s, self.max_running = timeout_s, max_running
        # A call holds its function's slot until its thread ends, late or not.
        self.slots = [asyncio.Semaphore(max_running) for _ in self.functions]

    def __bool__(self) -> bool:
        return bool(self.functions)

    async def score(self, turn: dict, choices: list[int]) -> tuple[dict[int, float | None],
                                                                    list[dict]]:
        """Each choice's reward (the first function that returns a number wins) and the errors
        met on the way: [{"function", "choice", "error"}]."""
        results = await asyncio.gather(*[self._choice(turn, i) for i in choices])
        rewards = {i: r for i, (r, _) in zip(choices, results)}
        return rewards, [e for _, errors in results for e in errors]

    async def _choice(self, turn: dict, i: int) -> tuple[float | None, list[dict]]:
        errors = []
        for k in range(len(self.functions)):
            try:
                value = clip_reward(await self._call(k, turn, i))
            except Exception as e:
                errors.append({"function": self.names[k], "choice": i,
                               "error": f"{type(e).__name__}: {e}"[:500]})
                continue
            if value is not None:
                return value, errors
        return None, errors

    async def _call(self, k: int, turn: dict, i: int):
        """One call on a thread of its own; the time limit covers waiting for a slot."""
        loop, slot = asyncio.get_running_loop(), self.slots[k]
        deadline = loop.time() + self.timeout_s
        try:
            await asyncio.wait_for(slot.acquire(), self.timeout_s)
        except TimeoutError:
            raise TimeoutError(f"no answer within {self.timeout_s:g} s: {self.max_running} "
                               "earlier calls are still running (--reward-timeout-s)") from None
        future = loop.create_future()

        def ended(result, error) -> None:  # on the event loop
            slot.release()
            settle(future, result, error)

        def handed_back(result, error) -> None:  # on the call's thread
            try:
                loop.call_soon_threadsafe(ended, result, error)
            except RuntimeError:  # the event loop is gone (shutdown)
                pass

        call_in_thread(call, (self.functions[k], turn, turn["next_state"], i, self.new_style[k]),
                       handed_back, f"reward-{self.names[k]}")
        try:
            return await asyncio.wait_for(asyncio.shield(future),
                                          max(0.0, deadline - loop.time()))
        except TimeoutError:
            if future.done():
                raise  # the function's own TimeoutError
            raise TimeoutError(f"no answer within {self.timeout_s:g} s "
                               "(--reward-timeout-s)") from None


def settle(future: asyncio.Future, result, error) -> None:
    """Resolve FUTURE with a worker thread's outcome, unless its waiter already gave up."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
