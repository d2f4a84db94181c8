"""Which rank of a launch (mlx.launch, mpirun) this process is, read from the environment
without importing MLX (the CLI decides with it whether to serve or to be a gradient worker:
training/distributed.py)."""

from __future__ import annotations

import os

RANK_VARIABLES = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")  # ring and JACCL; MPI


def launched_rank() -> int | None:
    """This process's rank under a launcher; None outside one."""
    for var in RANK_VARIABLES:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return None
