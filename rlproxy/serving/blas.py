"""Which BLAS MLX's CPU backend uses, and preloading an optimized one on Linux.

The `mlx[cpu]` wheel links a reference BLAS (~5 GFLOP/s fp32 matmul here). Loading OpenBLAS with
RTLD_GLOBAL before `mlx` is imported makes MLX resolve its BLAS symbols there instead (~170-290
GFLOP/s on the same machine). This must run before the first `import mlx`, so `rlproxy/__init__`
calls it. On macOS MLX uses Accelerate/Metal and nothing is done.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

CANDIDATES = [
    "/usr/lib/{arch}-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/{arch}-linux-gnu/openblas-openmp/libblas.so.3",
    "/usr/lib/{arch}-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
]

_state = {"blas": "unknown"}


def preload_blas() -> str:
    """Load an optimized BLAS if one is installed; return a short description of the BLAS."""
    if _state["blas"] != "unknown":
        return _state["blas"]
    if sys.platform == "darwin":
        _state["blas"] = "accelerate"
        return _state["blas"]
    if "mlx.core" in sys.modules:
        _state["blas"] = "unknown (mlx was imported before rlproxy)"
        return _state["blas"]
    requested = os.environ.get("RLPROXY_BLAS")  # a path, or "reference" to keep the wheel's
    if requested == "reference":
        _state["blas"] = "reference (RLPROXY_BLAS=reference)"
        return _state["blas"]
    arch = platform.machine()
    paths = [requested] if requested else [p.format(arch=arch) for p in CANDIDATES]
    for path in paths:
        if path and os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            _state["blas"] = f"openblas ({path})"
            return _state["blas"]
    _state["blas"] = (
        "reference (slow; install OpenBLAS: apt-get install libopenblas0-pthread)"
    )
    return _state["blas"]


def blas_in_use() -> str:
    return _state["blas"]
