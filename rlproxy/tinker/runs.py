"""Which run a new client handle trains: its own (no `rlproxy_run` in the create_model call's
user_metadata, as the hosted service does), or a named run that several clients share.

A named run that is live in memory is joined (the same rank, or a user error naming both). One
that is not live but has saved states under <root>/NAME/weights/ (save_state: weights +
optimizer + trainer_state.json) resumes from the newest complete one, step count included, so a
restarted learner goes on where it was saved. Otherwise the run starts fresh. A named run stays
in memory after its clients finish, until its slot (--tinker-max-models) is needed.

Slots: when a new run needs one and all are taken, sessions that stopped heartbeating
(SESSION_EXPIRY_S) are finished, then the run idle longest (IDLE_S without a request, or a named
run no client holds) is saved as weights/evicted-step-N and leaves memory, so nothing it learned
is lost: a client that still holds it finds it loaded back on its next request (`live`), and a
named run is resumed from that save when a client joins it again. With no run idle, the new one
is refused with the time the next slot frees. Everything here runs on the worker thread
(models.py's Worker), one call at a time, so two clients creating the same new run never build
it twice. Request handling is routes.py's.
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


# The SDK heartbeats every 10 s (tinker's internal_client_holder.py). Three missed beats: one
# late beat (a loaded machine, a GC pause, a slow link) never costs a live client its handles,
# and a client that exited without ServiceClient.close() (the cookbook's recipes never call it)
# lets go of them within 30 s.
SESSION_EXPIRY_S = 30.0
# A run with no request for this long is idle: when a new run needs its slot, it is saved and
# leaves memory, and its handles' next request brings it back from that save (`live`), so its
# client loses nothing but the reload. One heartbeat period: a client in the middle of a step
# (forward_backward, optim_step, save) is never idle that long; one sampling between steps may be.
IDLE_S = 10.0


def _evict(st: TinkerState, run: models.Run) -> None:
    """RUN saved as weights/evicted-step-N (save_state's layout: a rejoin by name resumes it,
    create_training_client_from_state opens it) and out of memory; a run its handles still hold
    waits in st.evicted for their next request."""
    models.evict(run, st.root / run.name / "weights" / f"evicted-step-{run.step}")
    del st.runs[run.name]
    if run.handles:
        st.evicted[run.name] = run


def _expire_sessions(st: TinkerState, now: float) -> None:
    """Sessions silent for SESSION_EXPIRY_S (a client killed, or gone without finishing) are
    finished as if they had called close(), their changed runs saved first."""
    for sid, last in list(st.seen.items()):
        if now - last > SESSION_EXPIRY_S:
            st.seen.pop(sid, None)
            detach(st, sid, save=True)


def _frees_in(run: models.Run, now: float) -> float:
    """Seconds until RUN is idle if no request comes. (Its clients' sessions expire later: a
    session's last sign of life is no older than its last request, and SESSION_EXPIRY_S >
    IDLE_S.)"""
    return max(0.0, run.last_used + IDLE_S - now)


def _check_room(st: TinkerState) -> None:
    """Room for one more run in memory: at the limit, silent sessions expire, then the run idle
    longest (a named run no client holds is always idle) is saved and leaves; else a user error
    that says when a slot frees."""
    if len(st.runs) < st.max_models:
        return
    now = time.monotonic()
    _expire_sessions(st, now)
    if len(st.runs) < st.max_models:
        return
    idle = [r for r in st.runs.values() if not r.handles or now - r.last_used >= IDLE_S]
    if idle:
        _evict(st, min(idle, key=lambda r: r.last_used))
        return
    each = max(map(models.memory_bytes, st.runs.values()), default=0) / 2**20
    soonest = min(st.runs.values(), key=lambda r: r.last_used, default=None)
    when = ("" if soonest is None else
            f"; the next slot frees in about {_frees_in(soonest, now):.0f} s, when run "
            f"{soonest.name!r} has had no request for {IDLE_S:g} s (it is then saved to disk "
            "and loaded back on its next request)")
    raise UserError(f"this server already holds {len(st.runs)} Tinker training runs "
                    f"(--tinker-max-models {st.max_models}; about {each:.1f} MiB each), each "
                    f"used by a client in the last {IDLE_S:g} s{when}. Retry then, finish a "
                    "session (ServiceClient.close), or raise --tinker-max-models")


def live(st: TinkerState, tm: models.TinkerModel) -> models.Run:
    """TM's run, in memory: loaded back from its save if it was evicted (making room first).
    Marks it used. On the worker thread, before each request on a handle."""
    run = tm.run
    if run.evicted is not None:
        _check_room(st)
        models.restore(st.loaded, run)
        st.evicted.pop(run.name, None)
        st.runs[run.name] = run
    run.last_used = time.monotonic()
    return run


def attach(st: TinkerState, model_id: str, name: str | None, base: str, rank: int,
           seed) -> models.TinkerModel:
    """A new handle MODEL_ID bound to run NAME (joined, resumed or created), or to a fresh run
    of its own when NAME is None. On the worker thread."""
    if name is None:
        _check_room(st)
        run = models.new_run(st.loaded, run_name(model_id), rank, seed)
    elif name in st.runs or name in st.evicted:
        run = st.runs.get(name) or st.evicted[name]
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
    tm = models.TinkerModel(model_id, run)
    if run.evicted is None:
        st.runs[run.name] = run
    else:  # joined while its other clients' handles hold it on disk: back in memory
        live(st, tm)
    run.handles.add(model_id)
    run.last_used = time.monotonic()
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
    run.last_used = time.monotonic()
    st.models[model_id] = tm
    return tm


def detach(st: TinkerState, session_id: str, save: bool = False) -> None:
    """A session finished: drop its handles, and each run of a handle's own with it (SAVE: a
    run in memory that changed is saved as weights/evicted-step-N first, for a session that
    expired rather than finished). A named run stays for the clients that rejoin it (in memory:
    its unsaved steps would be lost otherwise; evicted: a rejoin resumes its save). On the
    worker thread."""
    for model_id in [m for m in st.models if m.startswith(f"{session_id}:")]:
        run = st.models.pop(model_id).run
        run.handles.discard(model_id)
        run.last_used = time.monotonic()
        if run.handles:
            continue
        st.evicted.pop(run.name, None)  # its save stays on disk
        if not run.named and run.name in st.runs:
            if save and run.version > 0:
                models.evict(run, st.root / run.name / "weights" / f"evicted-step-{run.step}")
            del st.runs[run.name]
