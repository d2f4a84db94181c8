"""Typed keys for the long-lived objects the aiohttp app holds (one place, no import cycles)."""

import asyncio

from aiohttp import web

from rlproxy.engine import Engine
from rlproxy.model import LoadedModel
from rlproxy.scorer import Scorer
from rlproxy.sessions import SessionStore
from rlproxy.settings import Settings
from rlproxy.trainer import Trainer

SETTINGS = web.AppKey("settings", Settings)
MODEL = web.AppKey("model", LoadedModel)
ENGINE = web.AppKey("engine", Engine)
SESSIONS = web.AppKey("sessions", SessionStore)
SCORER = web.AppKey("scorer", Scorer)  # finished main turns go here to be scored
TRAINING = web.AppKey("training", asyncio.Queue)  # scored turns released for training
STARTED = web.AppKey("started", float)
TRAINER = web.AppKey("trainer", Trainer)  # absent with --no-train
