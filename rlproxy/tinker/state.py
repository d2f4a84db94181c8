"""What the Tinker API keeps between requests (the worker, runs, client handles, samplers,
futures, and the counts /healthz and /metrics read through `TinkerState.health`, by its app key
in appkeys.py), and the small helpers every handler shares: JSON in (JSON out is
`json_response`), and where a named checkpoint lives on disk. No handlers here, and no MLX: the
worker and sampler types are named for type checkers only.

Every client string that becomes part of a path passes `checked_name` (and the path a
containment check), so no name reaches the disk as '.', '..', a separator or a hidden folder:
a save replaces its target folder, so a name that resolves elsewhere would delete that.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from rlproxy.appkeys import TINKER
from rlproxy.tinker.futures import FutureStore
from rlproxy.tinker.wire import UserError

if TYPE_CHECKING:
    from rlproxy.mlx_threads import Worker
    from rlproxy.tinker.sampling import Samplers

# fullmatch ("x\n" is not a name). No leading '.': not '.' or '..', nor the hidden temp
# folder of a save in progress (training/checkpoints.py's written_whole), which a save replaces.
NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
KINDS = ("weights", "sampler_weights", "external_weights")


@dataclass
class TinkerState:
    loaded: object
    root: Path  # <data_dir>/tinker (paths.TINKER)
    max_models: int  # live runs (each holds weights + AdamW state); a handle costs its gradient
    worker: Worker
    samplers: Samplers
    futures: FutureStore = field(default_factory=FutureStore)
    runs: dict = field(default_factory=dict)  # run name -> models.Run (changed on the worker)
    evicted: dict = field(default_factory=dict)  # run name -> a Run handles hold, saved to disk
    models: dict = field(default_factory=dict)  # model_id -> models.TinkerModel (a handle)
    tasks: set = field(default_factory=set)
    forward_backward: int = 0  # calls that accumulated gradients (not forward-only ones)
    optim_steps: int = 0
    seen: dict = field(default_factory=dict)  # session id -> time.monotonic() of its last sign
    compute: object = None  # models.value_grads' stand-in (under mlx.launch: tinker/ranks.py)

    def health(self) -> dict:
        return {"models": len(self.runs), "handles": len(self.models),
                "forward_backward": self.forward_backward, "optim_steps": self.optim_steps,
                "samplers": len(self.samplers.sessions)}


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


def checked_name(what: str, name) -> str:
    """NAME as one path component, or UserError saying what a name may be."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise UserError(f"{what} {name!r} must be 1-128 letters, digits, '.', '_' or '-', not "
                        "starting with '.'")
    return name


def run_name(model_id: str) -> str:
    """The folder of a model's checkpoints when it joined no named run: its id
    ("SESSION:train:N") with ':' as '_'."""
    return checked_name("model id", re.sub(r"[^A-Za-z0-9._-]", "_", str(model_id)))


def checkpoint_dir(st: TinkerState, run: str, kind: str, name) -> Path:
    """<root>/RUN/KIND/NAME, or UserError for a name that is not one plain folder under it."""
    checked_name("run", run)
    checked_name("checkpoint name", name)
    if kind not in KINDS:
        raise UserError(f"checkpoint kind {kind!r} must be one of {', '.join(KINDS)}")
    path = st.root / run / kind / name
    if not path.resolve().is_relative_to((st.root / run / kind).resolve()):  # a symlink
        raise UserError(f"checkpoint name {name!r} leads outside its run's folder")
    return path


def parse_path(st: TinkerState, path: str) -> Path:
    m = re.fullmatch(r"tinker://([^/]+)/([^/]+)/([^/]+)", path if isinstance(path, str) else "")
    if not m:
        raise UserError(f"{path!r} is not a tinker://RUN/KIND/NAME path (KIND: "
                        f"{', '.join(KINDS)})")
    return checkpoint_dir(st, m.group(1), m.group(2), m.group(3))
