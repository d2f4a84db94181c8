"""Stored Responses (`store: true`): what GET/DELETE /v1/responses/{id} and
`previous_response_id` read, kept under `<data dir>/responses`.

One diskcache directory, bounded by `--responses-store-mb` (the oldest stored go first), durable
across restarts (SQLite in WAL mode). An entry is JSON: the Response object as sent, the chat
conversation it ended (input messages + the assistant reply, without `instructions`), and the
session and thread the turn was filed under, so a follow-up continues the same session thread.
Not a record file: the turns themselves are recorded by the session store. A store whose SQLite
file is damaged is set aside at start as `responses.corrupt-<time>` and a new one opened: the
server starts, and only those stored Responses are gone from the API. One that cannot be opened
for another reason (a full disk, no permission) is intact: kept, and the server does not start,
saying why (rlproxy/stores.py).
"""

from __future__ import annotations

import asyncio
import errno
import re
import sqlite3
from pathlib import Path

import diskcache
import orjson
from aiohttp import web

from rlproxy import paths
from rlproxy.appkeys import RESPONSES
from rlproxy.records import WriteFailed
from rlproxy.settings import Settings
from rlproxy.stores import open_or_set_aside


def open_response_store(directory: Path, limit_mb: float) -> diskcache.Cache:
    def make() -> diskcache.Cache:
        return diskcache.Cache(str(directory), size_limit=int(limit_mb * 1024 * 1024),
                               eviction_policy="least-recently-stored")

    return open_or_set_aside(Path(directory), make, "the stored Responses")


def keep(store: diskcache.Cache, response_id: str, entry: dict) -> None:
    """Store ENTRY; WriteFailed (the API's 507 or 503, as for a turn's own lines) when SQLite
    cannot write it: "database or disk is full" is ENOSPC, any other write error EIO."""
    try:
        store.set(response_id, orjson.dumps(entry))
    except sqlite3.OperationalError as e:
        full = "full" in str(e)
        raise WriteFailed(Path(store.directory) / "cache.db", OSError(
            errno.ENOSPC if full else errno.EIO,
            f"the stored Responses: {e}")) from e


RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")  # responses.new_id's; fullmatch only


def find(store: diskcache.Cache, response_id: str) -> dict | None:
    if not RESPONSE_ID.fullmatch(response_id):  # never ours: no lookup with a client's blob
        return None
    raw = store.get(response_id)
    return None if raw is None else orjson.loads(raw)


def forget(store: diskcache.Cache, response_id: str) -> bool:
    return bool(RESPONSE_ID.fullmatch(response_id)) and store.delete(response_id)


def response_store_context(settings: Settings):
    async def ctx(app: web.Application):
        store = open_response_store(settings.records.data_dir / paths.RESPONSES,
                                    settings.records.responses_store_mb)
        app[RESPONSES] = store
        yield
        await asyncio.get_running_loop().run_in_executor(None, store.close)

    return ctx
