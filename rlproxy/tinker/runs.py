"""Which run a new client handle trains: its own (no `rlproxy_run` in the create_model call's
user_metadata, as the hosted service does), or a named run that several clients share.

A named run that is live in memory is joined (the same rank, or a user error naming both). One
that is not live but has saved states under <root>/NAME/weights/ (save_state: weights +
optimizer + trainer_state.json) resumes from the newest complete one, step count included, so a
restarted learner goes on where it was saved. Otherwise the run starts fresh. A named run stays
in memory after its clients finish, until its slot (--tinker-max-models) is needed: then it is
saved as weights/evicted-step-N first, so nothing it learned is lost. Everything here
runs on the worker thread (models.py's Worker), one call at a time, so two clients creating the
same new run never build it twice. Request handling is routes.py's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rlproxy.paths import ADAPTER_CONFIG, TRAINER_STATE
from rlproxy.tinker import models
from rlproxy.tinker.state import TinkerState, run_name
from rlproxy.tinker.wire import UserError

RUN_KEY = "rlproxy_run"  # the create_model user_metadata key that names a shared run
STATE_FILES = ("adapters.safetensors", "optimizer.safetensors", ADAPTER_CONFIG, TRAINER_STATE)


def newest_state(root: Path, name: str) -> Path | None:
    """The newest complete save_state folder of run NAME (a save in progress is a hidden temp
    folder, and a folder missing a file is skipped), or None."""
    folder = root / name / "weights"
    done = [p for p in folder.glob("*") if not p.name.startswith(".")
            and all((p / f).exists() for f in STATE_FILES)] if folder.is_dir() else []
    return max(done, key=lambda p: (p / TRAINER_STATE).stat().st_mtime_ns, default=None)


def _resumed(st: TinkerState, name: str, path: Path) -> models.Run:
    state = json.loads((path / TRAINER_STATE).read_text())
    base = state.get("base_model", st.loaded.model_id)
    if base != st.loaded.model_id:
        raise UserError(f"run {name!r} was saved training base {base}; this server serves "
                        f"{st.loaded.model_id}")
    rank = int(models.config_of(path)["lora_parameters"]["rank"])
    run = models.new_run(st.loaded, name, rank, None, named=True)
    models.load(models.TinkerModel("-", run), path, True)
    return run


SESSION_EXPIRY_S = 60.0  # no heartbeat for this long (the SDK sends one every 10 s): gone


def _check_room(st: TinkerState) -> None:
    """Room for one more run: at the limit, a named run no client holds is saved (save_state's
    layout, so a rejoin resumes it) and leaves memory; else a user error."""
    if len(st.runs) < st.max_models:
        return
    now = time.monotonic()  # a client that died without finishing (kill -9) holds nothing
    for sid, last in list(st.seen.items()):
        if now - last > SESSION_EXPIRY_S:
            st.seen.pop(sid, None)
            detach(st, sid)
    if len(st.runs) < st.max_models:
        return
    idle = [r for r in st.runs.values() if r.named and not r.handles]
    if idle:
        run = min(idle, key=lambda r: r.last_used)
        models.save(models.TinkerModel("-", run), st.root / run.name / "weights" /
                    f"evicted-step-{run.step}", True)
        del st.runs[run.name]
        return
    each = max(map(models.memory_bytes, st.runs.values()), default=0) / 2**20
    raise UserError(f"this server already holds {len(st.runs)} Tinker training runs "
                    f"(--tinker-max-models {st.max_models}; about {each:.1f} MiB each), each "
                    "with a client; finish a session or raise the limit")


def attach(st: TinkerState, model_id: str, name: str | None, base: str, rank: int,
           seed) -> models.TinkerModel:
    """A new handle MODEL_ID bound to run NAME (joined, resumed or created), or to a fresh run
    of its own when NAME is None. On the worker thread."""
    if name is None:
        _check_room(st)
        run = models.new_run(st.loaded, run_name(model_id), rank, seed)
    elif name in st.runs:
        run = st.runs[name]
        if run.rank != rank:
            raise UserError(f"run {name!r} trains base {run.base_model} at rank {run.rank}; "
                            f"this client asked for base {base} rank {rank}")
    else:
        _check_room(st)
        saved = newest_state(st.root, name)
        run = (_resumed(st, name, saved) if saved is not None
               else models.new_run(st.loaded, name, rank, seed, named=True))
        if run.rank != rank:
            raise UserError(f"run {name!r} (saved at {saved.name!r}) trains base "
                            f"{run.base_model} at rank {run.rank}; this client asked for base "
                            f"{base} rank {rank}")
    st.runs[run.name] = run
    run.handles.add(model_id)
    run.last_used = time.monotonic()
    tm = models.TinkerModel(model_id, run)
    st.models[model_id] = tm
    return tm


def attach_loaded(st: TinkerState, model_id: str, rank: int, path: Path,
                  with_optimizer: bool) -> models.TinkerModel:
    """Create-via-load (create_training_client_from_state): a run of the handle's own, from a
    saved checkpoint. On the worker thread."""
    _check_room(st)
    run = models.new_run(st.loaded, run_name(model_id), rank, None)
    tm = models.TinkerModel(model_id, run)
    models.load(tm, path, with_optimizer)
    st.runs[run.name] = run
    run.handles.add(model_id)
    st.models[model_id] = tm
    return tm


def detach(st: TinkerState, session_id: str) -> None:
    """A session finished: drop its handles, and each run of a handle's own with it. A named
    run stays live for the clients that rejoin it (its unsaved steps would be lost otherwise).
    On the worker thread."""
    for model_id in [m for m in st.models if m.startswith(f"{session_id}:")]:
        run = st.models.pop(model_id).run
        run.handles.discard(model_id)
        run.last_used = time.monotonic()
        if not run.handles and not run.named:
            st.runs.pop(run.name, None)
