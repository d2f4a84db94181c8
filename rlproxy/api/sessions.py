"""GET /v1/sessions, GET /v1/sessions/{id}, POST /v1/sessions/{id}/end: the session store
seen from outside (sessions/store.py keeps them). With X-RL-Adapter: NAME, a personal adapter's
sessions; without it, the default adapter's (a session id not found there is looked up in the
personal adapters' stores too)."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from rlproxy.api.edge import json_response
from rlproxy.api.tags import adapter_header
from rlproxy.appkeys import ADAPTERS, ADAPTERS_OFF, SCORER, SESSIONS
from rlproxy.protocol import APIError, shown


async def learning_paths(request: web.Request) -> list[tuple]:
    """(session store, scorer) of the adapter X-RL-Adapter names; without the header, the
    default adapter's, then every loaded personal adapter's (where to look for a session:
    `find_session` refuses an id more than one of them holds). A named adapter resting on disk
    is brought back (pipeline.py `Adapters`)."""
    app, name = request.app, adapter_header(request.headers)
    adapters = app.get(ADAPTERS)
    if name is None:
        return [(app[SESSIONS], app[SCORER])] + [
            (a.pipeline.store, a.pipeline.scorer)
            for a in (adapters.by_name.values() if adapters is not None else [])]
    if adapters is None:
        raise APIError(400, f"X-RL-Adapter names '{name}', and this server has no personal "
                       f"adapters ({app.get(ADAPTERS_OFF)})", param="X-RL-Adapter",
                       code="adapters_off")
    personal = adapters.find(name, "X-RL-Adapter")
    if personal is None and adapters.on_disk_only(name):
        personal = await adapters.get(name, "X-RL-Adapter")
    if personal is None:
        raise APIError(404, f"no adapter named '{name}' (it has had no request yet)",
                       param="X-RL-Adapter", code="adapter_not_found")
    personal.used = time.monotonic()  # a lookup or feedback counts as use: not let go of now
    return [(personal.pipeline.store, personal.pipeline.scorer)]


async def find_session(request: web.Request, sid: str):
    """(the store that holds session SID, its scorer), or (None, None). Session ids are the
    clients' own: one that two adapters hold is refused unless X-RL-Adapter says which."""
    held = [(store, scorer) for store, scorer in await learning_paths(request)
            if store.find(sid) is not None]
    if len(held) > 1:
        raise APIError(409, f"session {shown(sid)} is held by more than one adapter: name one "
                       "with X-RL-Adapter", param="session_id", code="ambiguous_session")
    return held[0] if held else (None, None)


async def list_sessions(request: web.Request) -> web.Response:
    store = (await learning_paths(request))[0][0]
    data = [s.summary() for s in store.open.values()]
    data += [s.summary() for s in reversed(store.closed)]
    return json_response({"object": "list", "data": data})


async def get_session(request: web.Request) -> web.Response:
    store, _ = await find_session(request, request.match_info["session_id"])
    session = store.find(request.match_info["session_id"]) if store is not None else None
    if session is None:
        raise APIError(404, f"no session {shown(request.match_info['session_id'])} (open or "
                       "recently closed)", param="session_id", code="session_not_found")
    return json_response(session.summary(with_turns=True))


async def end_session(request: web.Request) -> web.Response:
    sid = request.match_info["session_id"]
    store, _ = await find_session(request, sid)
    written = store.end(sid, "ended") if store is not None else None
    if written is None:
        raise APIError(404, f"no open session {shown(sid)}", param="session_id",
                       code="session_not_found")
    await asyncio.wrap_future(written)  # its records are on disk before the answer
    return json_response({"id": sid, "object": "session", "open": False, "closed": "ended"})
