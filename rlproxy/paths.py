"""Every file and folder rlproxy keeps under its data directory (`--data-dir`), named once.

Plain names relative to the data directory; callers join them (`data_dir / TRAINING`). Imports
nothing of rlproxy and no MLX, so the CLI, the dashboard and the tests can name files cheaply.
Also `lock_data_dir`: one process writing a data directory at a time (LOCK).
"""

import fcntl
import os
from pathlib import Path

CONVERSATIONS = "conversations.jsonl"  # one line per served main turn (records.py)
PENDING = "pending_turns.jsonl"  # turns waiting for their next state (sessions/store.py)
SCORES = "prm_scores.jsonl"  # one line per scored turn and feedback change (scoring/scorer.py)
TRAINING = "training.jsonl"  # steps, skips, evaluations, rollbacks (training/)
JOURNAL = "train_journal.jsonl"  # which turns each step is about to train (training/journal.py)
CHECKPOINTS = "checkpoints"  # step_NNNNNN/ folders (training/checkpoints.py)
RANK0_LOG = "rank0.log"  # mlx.launch: rank 0's output after a rank failed (training/distributed.py)
PREFIX_CACHE = "prefix_cache"  # the on-disk prefix KV store (kv/prefix_cache.py)
RESPONSES = "responses"  # stored Responses API objects (api/response_store.py)
TINKER = "tinker"  # the Tinker API's runs and checkpoints (tinker/)
LOCK = "rlproxy.lock"  # flock'ed by the one process writing here; holds its PID (lock_data_dir)

# inside a checkpoint folder
TRAINER_STATE = "trainer_state.json"
ADAPTER_CONFIG = "adapter_config.json"


def complete_checkpoints(root: Path) -> list[Path]:
    """The `step_*` folders under ROOT (a CHECKPOINTS folder), oldest first: only those whose
    last-written file (TRAINER_STATE) is there, so a save cut short is never listed."""
    root = Path(root)
    if not root.exists():
        return []
    return sorted(p for p in root.glob("step_*") if p.name[5:].isdigit() and complete(p))


def complete(checkpoint: Path) -> bool:
    return checkpoint.is_dir() and (checkpoint / TRAINER_STATE).exists()


def kept_checkpoint(root: Path, step: int) -> Path | None:
    """Checkpoint STEP under ROOT if it is complete now, else None."""
    path = Path(root) / f"step_{step:06d}"
    return path if complete(path) else None


class DataDirInUse(RuntimeError):
    """Another live process holds the data directory's LOCK."""


def lock_data_dir(data_dir: Path) -> int:
    """Take DATA_DIR's LOCK (creating the folder), write this PID in it and return its file
    descriptor: the lock lasts as long as the descriptor, so it ends with the process however
    that ends. A second server on one folder would interleave records and lose turns.
    Raises DataDirInUse, naming the holder's PID, when another process has it."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise DataDirInUse(f"{data_dir} is in use by another rlproxy (pid {holder}, lock "
                           f"{path}); stop that one or give this one another --data-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
