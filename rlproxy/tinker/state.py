"""What the Tinker API keeps between requests (the worker, models, samplers, futures), the
app key it lives under, and the small helpers every handler shares: JSON in (JSON out is
api/edge.py's `json_response`), and where a named checkpoint lives on disk. No handlers here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from aiohttp import web

from rlproxy.tinker.futures import FutureStore
from rlproxy.tinker.models import Worker
from rlproxy.tinker.sampling import Samplers
from rlproxy.tinker.wire import UserError

NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")  # fullmatch: "x\n" is not a name


@dataclass
class TinkerState:
    loaded: object
    root: Path  # <data_dir>/tinker (paths.TINKER)
    max_models: int
    worker: Worker
    samplers: Samplers
    futures: FutureStore = field(default_factory=FutureStore)
    models: dict = field(default_factory=dict)  # model_id -> TinkerModel
    tasks: set = field(default_factory=set)


TINKER = web.AppKey("tinker", TinkerState)




async def read_json(request: web.Request) -> dict:
    try:
        body = orjson.loads(await request.read() or b"{}")
    except orjson.JSONDecodeError as e:
        raise web.HTTPBadRequest(text=orjson.dumps({"error": f"bad JSON: {e}",
                                                    "category": "user"}).decode(),
                                 content_type="application/json") from None
    return body if isinstance(body, dict) else {}


def state(request: web.Request) -> TinkerState:
    return request.app[TINKER]


def checkpoint_dir(st: TinkerState, run: str, kind: str, name: str) -> Path:
    if not NAME.fullmatch(name or ""):
        raise UserError(f"checkpoint name {name!r} must be 1-128 letters, digits, '.', '_', '-'")
    return st.root / run / kind / name


def parse_path(st: TinkerState, path: str) -> Path:
    m = re.fullmatch(r"tinker://([^/]+)/(weights|sampler_weights)/([^/]+)", path or "")
    if not m or not NAME.fullmatch(m.group(1)):
        raise UserError(f"{path!r} is not a tinker://RUN/weights/NAME or "
                        "tinker://RUN/sampler_weights/NAME path")
    return checkpoint_dir(st, m.group(1), m.group(2), m.group(3))
