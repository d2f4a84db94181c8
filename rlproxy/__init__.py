"""rlproxy: an OpenAI-compatible proxy that serves an MLX model and learns from agent traffic."""

from rlproxy.serving.blas import preload_blas

# Before anything imports mlx: an optimized BLAS is 30-60x faster than the wheel's on Linux.
preload_blas()

__version__ = "0.1.0"
