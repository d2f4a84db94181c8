"""Request ids and their results for the Tinker API's futures: every submit answers
{"request_id"} at once and the client polls `retrieve_future` for the outcome.

A poll on a pending request is held open up to `LONG_POLL_S` (the SDK re-polls at once, without
sleeping, on "try_again"). A finished result is kept `KEEP_S` seconds after it was done, then
forgotten: a poll for an unknown id is 410, the SDK's "promise expired". Results are JSON dicts
or protobuf bytes; failures are {"error", "category": "user"|"server"}. Nothing here runs work.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid

LONG_POLL_S = 10.0
KEEP_S = 900.0


class FutureStore:
    def __init__(self):
        self._futures: dict[str, asyncio.Future] = {}
        self._done_at: dict[str, float] = {}
        self._prefix = uuid.uuid4().hex[:8]
        self._count = itertools.count(1)

    def new(self) -> tuple[str, asyncio.Future]:
        self._expire()
        rid = f"{self._prefix}-{next(self._count)}"
        fut = asyncio.get_running_loop().create_future()
        fut.add_done_callback(lambda _: self._done_at.__setitem__(rid, time.monotonic()))
        self._futures[rid] = fut
        return rid, fut

    def settle(self, rid: str, fut: asyncio.Future, result=None, error: Exception | None = None):
        """From the event loop: result (dict or bytes) or an error (UserError -> "user")."""
        if fut.done():
            return
        if error is None:
            fut.set_result(result)
        else:
            from rlproxy.tinker.wire import UserError

            category = "user" if isinstance(error, UserError) else "server"
            message = str(error) if category == "user" else f"{type(error).__name__}: {error}"
            fut.set_result({"error": message, "category": category})

    async def wait(self, rid: str, timeout: float = LONG_POLL_S):
        """The result, None while still pending after `timeout`, KeyError if unknown/expired."""
        fut = self._futures[rid]
        if not fut.done():
            await asyncio.wait([fut], timeout=timeout)
        return fut.result() if fut.done() else None

    def _expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, t in self._done_at.items() if now - t > KEEP_S]:
            self._futures.pop(rid, None)
            self._done_at.pop(rid, None)
