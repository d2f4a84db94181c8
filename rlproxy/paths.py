"""Every file and folder rlproxy keeps under its data directory (`--data-dir`), named once.

Plain names relative to the data directory; callers join them (`data_dir / TRAINING`). Imports
nothing of rlproxy and no MLX, so the CLI, the dashboard and the tests can name files cheaply.
Also `default_data_dir`: one data directory per model when `--data-dir` is not given, and
`lock_data_dir`: one process writing a data directory at a time (LOCK), and `records_size`: the
record files' bytes on disk.
"""

import fcntl
import hashlib
import json
import logging
import os
import re
from pathlib import Path

log = logging.getLogger("rlproxy.paths")

CONVERSATIONS = "conversations.jsonl"  # one line per served main turn (records.py)
PENDING = "pending_turns.jsonl"  # turns waiting for their next state (sessions/store.py)
SCORES = "prm_scores.jsonl"  # one line per scored turn and feedback change (scoring/scorer.py)
TRAINING = "training.jsonl"  # steps, skips, evaluations, rollbacks (training/)
JOURNAL = "train_journal.jsonl"  # which turns each step is about to train (training/journal.py)
CHECKPOINTS = "checkpoints"  # step_NNNNNN/ folders (training/checkpoints.py)
SEGMENTS = "segments"  # NNNNNN/ folders of compacted sessions' records (compaction.py)
REOPEN = "reopen.json"  # in a segment: each moved session's next turn index
RANK0_LOG = "rank0.log"  # mlx.launch: rank 0's output after a rank failed (training/distributed.py)
PREFIX_CACHE = "prefix_cache"  # the on-disk prefix KV store (kv/prefix_cache.py)
RESPONSES = "responses"  # stored Responses API objects (api/response_store.py)
TINKER = "tinker"  # the Tinker API's runs and checkpoints (tinker/)
ADAPTERS = "adapters"  # NAME/ folders: a personal adapter's own records and checkpoints
LOCK = "rlproxy.lock"  # flock'ed by the one process writing here; holds its PID (lock_data_dir)

# inside a checkpoint folder
TRAINER_STATE = "trainer_state.json"
ADAPTER_CONFIG = "adapter_config.json"


HOME = Path.home() / ".rlproxy"  # the default data dirs, one per model: HOME/<model>/
# Before per-model data dirs, HOME itself was the data dir; these at its top level say it holds
# records or checkpoints (`default_data_dir` keeps it in use for the model they belong to).
LEGACY_MARKS = (CONVERSATIONS, PENDING, SCORES, TRAINING, CHECKPOINTS)
RECORD_FILES = (CONVERSATIONS, PENDING, SCORES, TRAINING, JOURNAL)  # what records_size counts
DEFAULT_MODEL = "smollm2-135m-instruct"  # ModelSettings' default (what a legacy dir served)


def model_dir_name(model: str) -> str:
    """A folder name for --model MODEL: a named model, tiny/small or a hub id as it is (a hub
    id's '/' as '--'); a file or directory by its name plus a hash of its absolute path, so two
    folders both called `model` do not share records."""
    name = model.replace("/", "--")
    local = model.lower().endswith(".gguf") or Path(model).is_dir()
    if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}", name) and not local:
        return name
    path = Path(model).expanduser().resolve()
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem)[:64] or "model"
    return f"{stem}-{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"


def default_data_dir(model: str, home: Path = HOME) -> Path:
    """The data dir of --model MODEL when --data-dir is not given: HOME/<model_dir_name>/, so
    switching models keeps each one's records and checkpoints apart. A HOME that is itself a
    data dir from before (records or checkpoints at its top level) stays the data dir of the
    model they belong to: its newest checkpoint's, else the default model's."""
    if any((home / name).exists() for name in LEGACY_MARKS) and legacy_model(home) == model:
        log.info("data dir %s (the layout before per-model data dirs) holds %s's records: kept "
                 "in use; other models get %s/<model>/", home, model, home)
        return home
    return home / model_dir_name(model)


def legacy_model(home: Path) -> str:
    """The model a pre-per-model data dir HOME was serving: its newest checkpoint's --model (in
    trainer_state.json), else DEFAULT_MODEL."""
    for checkpoint in reversed(complete_checkpoints(home / CHECKPOINTS)):
        try:
            state = json.loads((checkpoint / TRAINER_STATE).read_text())
            return state["settings"]["model"]["model"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return DEFAULT_MODEL


def complete_checkpoints(root: Path) -> list[Path]:
    """The `step_*` folders under ROOT (a CHECKPOINTS folder), oldest first: only those whose
    last-written file (TRAINER_STATE) is there, so a save cut short is never listed."""
    root = Path(root)
    if not root.exists():
        return []
    return sorted(p for p in root.glob("step_*") if p.name[5:].isdigit() and complete(p))


def complete(checkpoint: Path) -> bool:
    return checkpoint.is_dir() and (checkpoint / TRAINER_STATE).exists()


def segment_dirs(data_dir: Path) -> list[Path]:
    """DATA_DIR's complete segments (compaction.py), oldest first."""
    root = Path(data_dir) / SEGMENTS
    try:
        return sorted(p for p in root.iterdir() if p.is_dir() and p.name.isdigit())
    except OSError:
        return []


def kept_checkpoint(root: Path, step: int) -> Path | None:
    """Checkpoint STEP under ROOT if it is complete now, else None."""
    path = Path(root) / f"step_{step:06d}"
    return path if complete(path) else None


def records_size(data_dir: Path) -> dict:
    """The bytes on disk of DATA_DIR's record files (/healthz `records`, /metrics, the
    dashboard): the records only grow, so an operator needs to see how much they take. Each of
    RECORD_FILES counts with its siblings `<name>*` (the `.corrupt-*` and `.torn-*` copies set
    aside beside it, never deleted), and `segments` the compacted sessions' (compaction.py) when
    there are any; `bytes` is their total, `checkpoints_bytes` the kept
    checkpoints' (the prefix cache's is its own `disk_bytes`). One listing of the folder and a
    stat per file, nothing read, so every scrape may call it; a missing file counts 0."""
    files = dict.fromkeys(RECORD_FILES, 0)
    try:
        entries = list(os.scandir(data_dir))
    except OSError:
        entries = []
    for entry in entries:
        name = next((n for n in RECORD_FILES if entry.name.startswith(n)), None)
        if name is not None:
            files[name] += entry_size(entry)
    segments = tree_size(Path(data_dir) / SEGMENTS)
    if segments:
        files[SEGMENTS] = segments
    return {"bytes": sum(files.values()), "files": files,
            "checkpoints_bytes": tree_size(Path(data_dir) / CHECKPOINTS)}


def entry_size(entry: os.DirEntry) -> int:
    """A file's size; 0 for a folder, or a file gone since the folder was listed."""
    try:
        return entry.stat().st_size if entry.is_file() else 0
    except OSError:
        return 0


def tree_size(root: Path) -> int:
    """The bytes of every file under ROOT (0 if it is not there)."""
    total = 0
    for folder, _, names in os.walk(root):
        for name in names:
            try:
                total += os.stat(os.path.join(folder, name)).st_size
            except OSError:
                pass  # pruned while we walked
    return total


class DataDirInUse(RuntimeError):
    """Another live process holds the data directory's LOCK."""


def lock_data_dir(data_dir: Path, url: str | None = None) -> int:
    """Take DATA_DIR's LOCK (creating the folder), write this PID in it (and a server's URL:
    `serving_url` reads it) and return its file descriptor: the lock lasts as long as the
    descriptor, so it ends with the process however that ends. A second server on one folder
    would interleave records and lose turns.
    Raises DataDirInUse, naming the holder's PID, when another process has it."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = (os.read(fd, 256).decode(errors="replace").split() or ["unknown"])[0]
        os.close(fd)
        raise DataDirInUse(f"{data_dir} is in use by another rlproxy (pid {holder}, lock "
                           f"{path}); stop that one or give this one another --data-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}{' ' + url if url else ''}\n".encode(), 0)
    return fd


def serving_url(data_dir: Path) -> str | None:
    """The URL of the server running on DATA_DIR now (the one holding its LOCK), or None when
    no process holds it (or the holder noted no URL: `rlproxy train`)."""
    try:
        fd = os.open(Path(data_dir) / LOCK, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None  # nobody holds it
        except BlockingIOError:
            words = os.read(fd, 256).decode(errors="replace").split()
            return words[1] if len(words) > 1 else None
    finally:
        os.close(fd)
