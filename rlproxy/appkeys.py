"""Typed keys for the long-lived objects the aiohttp app holds (one place, no import cycles)."""

from collections import deque

import diskcache
from aiohttp import web
from prometheus_client import CollectorRegistry

from rlproxy.engine import Engine
from rlproxy.model import LoadedModel
from rlproxy.scorer import Scorer
from rlproxy.sessions import SessionStore
from rlproxy.settings import Settings
from rlproxy.trainer import Trainer
from rlproxy.ui.index import RecordIndex

SETTINGS = web.AppKey("settings", Settings)
MODEL = web.AppKey("model", LoadedModel)
ENGINE = web.AppKey("engine", Engine)
SESSIONS = web.AppKey("sessions", SessionStore)
SCORER = web.AppKey("scorer", Scorer)  # finished main turns go here; it hands them to TRAINER
STARTED = web.AppKey("started", float)
TRAINER = web.AppKey("trainer", Trainer)  # absent with --no-train
RESPONSES = web.AppKey("responses", diskcache.Cache)  # stored Responses (api/response_store.py)
METRICS = web.AppKey("metrics", CollectorRegistry)  # what GET /metrics exposes (metrics.py)
RECORD_INDEX = web.AppKey("record_index", RecordIndex)  # the dashboard's view of the records
LIVE = web.AppKey("live", deque)  # the dashboard's recent samples of rates (ui/views.py)
