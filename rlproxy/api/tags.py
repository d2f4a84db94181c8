"""The session protocol at the edge: X-Session-Id, X-Turn-Type, X-Session-Done, the step and
idempotency keys, X-RL-Opt-Out, and their body fallbacks, parsed once into `TurnTags`.

Every value a client sends here is checked before anything is generated; a bad one is a 400 that
names the header. Ids are matched whole (`fullmatch`: a `$` would let a final newline through,
and the session id goes back out in the X-Session-Id response header). Knows nothing of
sessions themselves (sessions/store.py files the turns).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rlproxy.protocol import APIError, shown
from rlproxy.settings import adapter_name

SESSION_ID = re.compile(r"[A-Za-z0-9._:@-]{1,128}")  # fullmatch only
STEP_INDEX = re.compile(r"[0-9]{1,19}")  # ASCII digits: str.isdigit() also takes "²"
INT64_MAX = 2**63 - 1  # records are JSON that orjson writes: it refuses larger integers
TRUE, FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def valid_session_id(sid) -> bool:
    return isinstance(sid, str) and SESSION_ID.fullmatch(sid) is not None


@dataclass
class TurnTags:
    session_id: str | None = None
    turn_type: str = "main"
    session_done: bool = False
    turn_id: str | None = None
    step_index: int | None = None
    request_id: str | None = None
    opt_out: bool = False
    explicit_type: bool = False  # X-Turn-Type (or turn_type) was given: no rule overrides it
    train: bool | None = None  # X-RL-Train: 1|0 decides whether a main turn trains (None: rules)
    adapter: str | None = None  # X-RL-Adapter: a personal adapter's name (None: the default)


def _flag(name: str, raw) -> bool:
    if isinstance(raw, bool):
        return raw
    value = str(raw).strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise APIError(400, f"{name} must be one of 1, true, yes, on (or 0, false, no, off), "
                   f"not {shown(raw)}", param=name)


def parse_turn_tags(headers, req) -> TurnTags:
    """Headers first, then the body fallbacks (`session_id`, `turn_type`, `session_done`)."""
    def named(*names):  # (the spelling the client used, its value)
        for n in names:
            if n in headers:
                return n, headers[n]
        return names[0], None

    def header(*names):
        return named(*names)[1]

    tags = TurnTags()
    sid = header("X-Session-Id") or req.session_id
    if sid is not None:
        if not valid_session_id(sid):
            raise APIError(400, "X-Session-Id must be 1-128 characters of A-Z a-z 0-9 . _ : @ -",
                           param="X-Session-Id")
        tags.session_id = sid
    turn_type = header("X-Turn-Type") or req.turn_type
    tags.explicit_type = turn_type is not None
    turn_type = turn_type or "main"
    if turn_type.strip().lower() not in ("main", "side"):
        raise APIError(400, f"X-Turn-Type must be 'main' or 'side', not {shown(turn_type)}",
                       param="X-Turn-Type")
    tags.turn_type = turn_type.strip().lower()
    done = header("X-Session-Done")
    if done is None:
        done = req.session_done
    tags.session_done = False if done is None else _flag("X-Session-Done", done)
    tags.turn_id = header("X-Turn-Id", "X-Hermes-Outer-Turn-Id")
    name, step = named("X-Step-Index", "X-Hermes-Step-Index")
    if step is not None:
        tags.step_index = step_index(name, step)
    for name, value in (("X-Turn-Id", tags.turn_id),
                        ("X-Request-Id", header("X-Request-Id", "X-Hermes-Request-Id"))):
        if value is not None and not (0 < len(value) <= 256 and value.isprintable()):
            raise APIError(400, f"{name} must be 1-256 printable characters", param=name)
    tags.request_id = header("X-Request-Id", "X-Hermes-Request-Id")
    opt_out = header("X-RL-Opt-Out")
    tags.opt_out = False if opt_out is None else _flag("X-RL-Opt-Out", opt_out)
    train = header("X-RL-Train")
    tags.train = None if train is None else _flag("X-RL-Train", train)
    tags.adapter = adapter_header(headers)
    return tags


def adapter_header(headers) -> str | None:
    """X-RL-Adapter: NAME (kept in lower case), or None for none or `default`."""
    raw = headers.get("X-RL-Adapter")
    if raw is None or raw.strip().lower() in ("", "default"):
        return None
    try:
        return adapter_name(raw)
    except ValueError as e:
        raise APIError(400, f"X-RL-Adapter: {e}", param="X-RL-Adapter") from None


def step_index(name: str, raw: str) -> int:
    """A step index header: ASCII digits, at most 2**63 - 1."""
    value = raw.strip()
    if not STEP_INDEX.fullmatch(value) or int(value) > INT64_MAX:
        raise APIError(400, f"{name} must be a non-negative integer below 2**63, not "
                       f"{shown(raw)}", param=name)
    return int(value)
