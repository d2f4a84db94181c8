"""Typed keys for the long-lived objects the aiohttp app holds (one place, no import cycles)."""

import asyncio

from aiohttp import web

from rlproxy.engine import Engine
from rlproxy.model import LoadedModel
from rlproxy.sessions import SessionStore
from rlproxy.settings import Settings

SETTINGS = web.AppKey("settings", Settings)
MODEL = web.AppKey("model", LoadedModel)
ENGINE = web.AppKey("engine", Engine)
SESSIONS = web.AppKey("sessions", SessionStore)
TRAINABLE = web.AppKey("trainable", asyncio.Queue)  # finished main turns, for scoring/training
STARTED = web.AppKey("started", float)
