"""Every file and folder rlproxy keeps under its data directory (`--data-dir`), named once.

Plain names relative to the data directory; callers join them (`data_dir / TRAINING`). Imports
nothing of rlproxy and no MLX, so the CLI, the dashboard and the tests can name files cheaply.
"""

from pathlib import Path

CONVERSATIONS = "conversations.jsonl"  # one line per served main turn (records.py)
PENDING = "pending_turns.jsonl"  # turns waiting for their next state (sessions/store.py)
SCORES = "prm_scores.jsonl"  # one line per scored turn and feedback change (scoring/scorer.py)
TRAINING = "training.jsonl"  # steps, skips, evaluations, rollbacks (training/)
JOURNAL = "train_journal.jsonl"  # which turns each step is about to train (training/journal.py)
CHECKPOINTS = "checkpoints"  # step_NNNNNN/ folders (training/checkpoints.py)
PREFIX_CACHE = "prefix_cache"  # the on-disk prefix KV store (kv/prefix_cache.py)
RESPONSES = "responses"  # stored Responses API objects (api/response_store.py)
TINKER = "tinker"  # the Tinker API's runs and checkpoints (tinker/)

# inside a checkpoint folder
TRAINER_STATE = "trainer_state.json"
ADAPTER_CONFIG = "adapter_config.json"


def complete_checkpoints(root: Path) -> list[Path]:
    """The `step_*` folders under ROOT (a CHECKPOINTS folder), oldest first: only those whose
    last-written file (TRAINER_STATE) is there, so a save cut short is never listed."""
    root = Path(root)
    if not root.exists():
        return []
    return sorted(p for p in root.glob("step_*") if complete(p))


def complete(checkpoint: Path) -> bool:
    return checkpoint.is_dir() and (checkpoint / TRAINER_STATE).exists()


def kept_checkpoint(root: Path, step: int) -> Path | None:
    """Checkpoint STEP under ROOT if it is complete now, else None."""
    path = Path(root) / f"step_{step:06d}"
    return path if complete(path) else None
