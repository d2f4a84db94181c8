"""One way to run MLX work on a thread of its own: `with mlx_thread() as stream: ...`.

MLX streams belong to the thread that made them, and MLX objects destroyed at interpreter exit
from another thread can abort the process. So every long-lived MLX thread (engine, trainer,
local judge, prefix-cache writer, Tinker worker) makes its own stream on entry and, on the way
out, drops its garbage, waits for its stream, then clears its streams -- in that order: clearing
first would leave arrays still pending on a stream that no longer exists.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

import mlx.core as mx


@contextmanager
def mlx_thread() -> Iterator[mx.Stream]:
    """Make this thread's stream the default for the block; tear it down safely after."""
    stream = mx.new_stream(mx.default_device())
    try:
        with mx.stream(stream):
            yield stream
    finally:
        gc.collect()  # free this thread's arrays here, not at interpreter exit
        mx.synchronize(stream)
        mx.clear_streams()  # each MLX thread must, or the process can abort at exit
