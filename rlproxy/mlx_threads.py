"""MLX work on a thread of its own: `with mlx_thread() as stream: ...`, or a Worker's jobs.

MLX streams belong to the thread that made them, and MLX objects destroyed at interpreter exit
from another thread can abort the process. So every long-lived MLX thread (engine, trainer,
local judge, prefix-cache writer, Tinker worker) makes its own stream on entry and, on the way
out, drops its garbage, waits for its stream, then clears its streams -- in that order: clearing
first would leave arrays still pending on a stream that no longer exists.
"""

from __future__ import annotations

import concurrent.futures
import gc
import queue
import threading
from contextlib import contextmanager
from typing import Iterator

import mlx.core as mx


@contextmanager
def mlx_thread(device: mx.Device | None = None) -> Iterator[mx.Stream]:
    """Make this thread's stream (on DEVICE, default: the default device) the default for the
    block; tear it down safely after."""
    stream = mx.new_stream(device or mx.default_device())
    try:
        with mx.stream(stream):
            yield stream
    finally:
        gc.collect()  # free this thread's arrays here, not at interpreter exit
        mx.synchronize(stream)
        mx.clear_streams()  # each MLX thread must, or the process can abort at exit


class Worker:
    """One MLX thread whose jobs run one at a time, in submit order (the Tinker API's MLX work;
    the exchanges with other ranks, training/distributed.py, on a CPU stream)."""

    def __init__(self, name: str = "rlproxy-tinker", device: mx.Device | None = None):
        self._jobs: queue.Queue = queue.Queue()
        self._device = device
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def run(self, fn, *args) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fut, fn, args))
        return fut

    def stop(self, wait_s: float = 60) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=wait_s)

    def _run(self) -> None:
        with mlx_thread(self._device):
            while (job := self._jobs.get()) is not None:
                fut, fn, args = job
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(*args))
                    except BaseException as e:  # reported on the request's future
                        fut.set_exception(e)
                del job, fut, fn, args
