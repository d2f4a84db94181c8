"""Typed keys for the long-lived objects the aiohttp app holds (one place, no import cycles).

The component types are named for type checkers only: at run time this module imports no
component, so anything (the metrics collector, the dashboard) can read the app's objects by
these keys without importing what they are.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Callable

from aiohttp import web

if TYPE_CHECKING:
    import diskcache
    from prometheus_client import CollectorRegistry

    from rlproxy.api.edge import Admission
    from rlproxy.ops.ui.index import RecordIndex
    from rlproxy.pipeline import Adapters
    from rlproxy.scoring.scorer import Scorer
    from rlproxy.serving.engine import Engine
    from rlproxy.serving.model import LoadedModel
    from rlproxy.serving.saved import SavedAdapters
    from rlproxy.sessions.store import SessionStore
    from rlproxy.settings import Settings
    from rlproxy.tinker.state import TinkerState
    from rlproxy.training.loop import Trainer
    from rlproxy.training.rank_link import Link

SETTINGS: web.AppKey[Settings] = web.AppKey("settings")
MODEL: web.AppKey[LoadedModel] = web.AppKey("model")
ENGINE: web.AppKey[Engine] = web.AppKey("engine")
# adapters saved on disk served by name: MODEL@STEP requests, Tinker sampler weights
SAVED: web.AppKey[SavedAdapters] = web.AppKey("saved_adapters")
SESSIONS: web.AppKey[SessionStore] = web.AppKey("sessions")
SCORER: web.AppKey[Scorer] = web.AppKey("scorer")  # finished main turns go here
STARTED: web.AppKey[float] = web.AppKey("started")
TRAINER: web.AppKey[Trainer] = web.AppKey("trainer")  # absent with --no-train
# the personal adapters (pipeline.py), each with its own pipeline; absent when they are off,
# and ADAPTERS_OFF says why
ADAPTERS: web.AppKey[Adapters] = web.AppKey("adapters")
ADAPTERS_OFF: web.AppKey[str] = web.AppKey("adapters_off")
RESPONSES: web.AppKey[diskcache.Cache] = web.AppKey("responses")  # api/response_store.py
METRICS: web.AppKey[CollectorRegistry] = web.AppKey("metrics")  # what GET /metrics exposes
RECORD_INDEX: web.AppKey[RecordIndex] = web.AppKey("record_index")  # the dashboard's records
ADMISSION: web.AppKey[Admission] = web.AppKey("admission")  # generation requests let in
RANKS: web.AppKey[Link] = web.AppKey("ranks")  # under mlx.launch: rank 0's link to the others
TINKER: web.AppKey[TinkerState] = web.AppKey("tinker")  # the Tinker API's state (tinker/state.py)
# under mlx.launch, asked on SIGTERM: why rank 0 serves on (a rank failed), or None to stop
OUTLIVES: web.AppKey[Callable[[], str | None]] = web.AppKey("outlives")
LIVE: web.AppKey[deque] = web.AppKey("live")  # the dashboard's recent rates (ops/ui/views.py)
# Set when a SIGTERM/SIGINT starts the drain: the trainer's step ends at its next unit
# (api/server.py sets it; pipeline.py asks the trainer to stop)
DRAINING: web.AppKey[asyncio.Event] = web.AppKey("draining")
# Set when a SIGTERM/SIGINT drain runs out (--drain-timeout-s): every in-flight request ends
# now, a stream with an error event in its API's shape (and [DONE] for Chat), a request still
# waiting for its answer with 503 (api/server.py sets it; api/turns.py honours it)
STOPPING: web.AppKey[asyncio.Event] = web.AppKey("stopping")
