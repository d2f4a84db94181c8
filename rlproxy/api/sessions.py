"""GET /v1/sessions, GET /v1/sessions/{id}, POST /v1/sessions/{id}/end: the session store
seen from outside (sessions/store.py keeps them)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from rlproxy.api.edge import json_response
from rlproxy.appkeys import SESSIONS
from rlproxy.protocol import APIError, shown


async def list_sessions(request: web.Request) -> web.Response:
    store = request.app[SESSIONS]
    data = [s.summary() for s in store.open.values()]
    data += [s.summary() for s in reversed(store.closed)]
    return json_response({"object": "list", "data": data})


async def get_session(request: web.Request) -> web.Response:
    session = request.app[SESSIONS].find(request.match_info["session_id"])
    if session is None:
        raise APIError(404, f"no session {shown(request.match_info['session_id'])} (open or "
                       "recently closed)", param="session_id", code="session_not_found")
    return json_response(session.summary(with_turns=True))


async def end_session(request: web.Request) -> web.Response:
    sid = request.match_info["session_id"]
    written = request.app[SESSIONS].end(sid, "ended")
    if written is None:
        raise APIError(404, f"no open session {shown(sid)}", param="session_id",
                       code="session_not_found")
    await asyncio.wrap_future(written)  # its records are on disk before the answer
    return json_response({"id": sid, "object": "session", "open": False, "closed": "ended"})
