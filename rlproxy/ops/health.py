"""`/healthz`: one JSON object about the whole server, collected from what each component
reports about itself (its `health()`), and the status code that goes with it.

Reads the app's objects by the keys in appkeys.py (the Tinker API's too) and imports none of
them; the HTTP handler is app.py's. The object's
keys and their order are a contract (`rlproxy status`, probes, tests): add, never rename.

`status` is "ok", "degraded" (serving, but a record file's last write failed: a full disk;
`disk.failing` names each file, and the status is ok again once a write to it succeeds; the
answer stays 200, so that a liveness probe does not restart a server that only needs space; also
while --sampler tinker's service does not answer: `error` and `engine.service_error` say so), or
"error" (503: the engine thread died).
"""

from __future__ import annotations

import time

from aiohttp import web

from rlproxy import paths, records
from rlproxy.ops.metrics import process_memory
from rlproxy.appkeys import (
    ADAPTERS, ADAPTERS_OFF, ADMISSION, ENGINE, MODEL, RANKS, SCORER, SESSIONS, SETTINGS, STARTED,
    TINKER, TRAINER,
)

NO_PREFIX_CACHE = {"enabled": False, "reason": "--no-prefix-cache"}


def served_names(app: web.Application) -> list[str]:
    """The model names this server answers to (--served-model-name, else the model's id and
    its aliases: the default model's hub id)."""
    model = app[MODEL]
    return app[SETTINGS].server.served_model_name or [model.model_id, *model.aliases]


def health(app: web.Application, blas: str) -> tuple[dict, int]:
    """(the body, 200, or 503 once the engine thread has died). BLAS: which BLAS MLX uses
    (serving/blas.py, read by the caller: ops/ imports no serving module)."""
    engine, model = app[ENGINE], app[MODEL]
    # --sampler tinker: a service that is down is not a dead server (no liveness restart)
    remote_down = engine.health().get("service_error") is not None
    ok = engine.alive and (engine.error is None or remote_down)
    failing = records.failing()
    body = {
        "status": "error" if not ok else "degraded" if failing or remote_down else "ok",
        "error": engine.error,
        "model": model.model_id,
        "model_source": {"path": model.source, "origin": model.origin},
        "served_model_names": served_names(app),
        "adapter_version": int(engine.adapter_version),
        # the folder served from the start (--adapter, or with --no-train the data dir's
        # newest checkpoint); None: a fresh adapter, i.e. the base model until a step
        "adapter": app[SETTINGS].model.adapter,
        "data_dir": str(app[SETTINGS].records.data_dir),
        "blas": blas,
        "context_length": model.context_length,
        "engine": engine.health(),
        "prefix_cache": prefix_cache_health(app),
        "sessions_open": app[SESSIONS].health()["open"],
        "requests": app[ADMISSION].health(),
        "scoring": app[SCORER].health(),
        "trainer": trainer_health(app),
        "adapters": adapters_health(app),
        "uptime_s": round(time.time() - app[STARTED], 1),
        "disk": {"failing": failing},
        "tinker": tinker_health(app),
        # under mlx.launch: the ranks and, once one failed, why (training waits, serving goes on)
        "ranks": ({"size": app[RANKS].size, "error": app[RANKS].broken} if RANKS in app
                  else {"size": 1, "error": None}),
        "memory": process_memory(),  # this process's resident memory now, and its peak
        # the record files' bytes on disk (they only grow), each and in all, and the checkpoints'
        "records": paths.records_size(app[SETTINGS].records.data_dir),
    }
    return body, 200 if ok else 503


def prefix_cache_health(app: web.Application) -> dict:
    cache = app[ENGINE].prefix_cache
    return cache.health() if cache is not None else dict(NO_PREFIX_CACHE)


def trainer_health(app: web.Application) -> dict:
    trainer = app.get(TRAINER)
    return trainer.health() if trainer is not None else {"enabled": False}


def adapters_health(app: web.Application) -> dict:
    """The personal adapters (pipeline.py `Adapters`), or why there are none."""
    adapters = app.get(ADAPTERS)
    if adapters is None:
        return {"enabled": False, "reason": app.get(ADAPTERS_OFF)}
    return {"enabled": True, **adapters.health()}


def tinker_health(app: web.Application) -> dict:
    """The Tinker API's live runs, client handles and sampling sessions, and the calls done."""
    tinker = app.get(TINKER)
    return {"enabled": True, **tinker.health()} if tinker is not None else {"enabled": False}
