"""A reply's bytes on the wire: a text/event-stream that a slow or gone client cannot hold, and a
kept reply sent again.

Owns: opening a stream (small send buffers, so a client that stops reading shows within seconds),
the limits on each write, ending a stream, and replaying a kept response (X-Request-Id). Every
streamed byte goes through `SseStream.send`, which waits while the socket is over its
high-water mark and gives up on a client that takes nothing for `--stall-timeout-s`: the
connection is aborted (close() would wait for the unread bytes forever) and `ClientStalled`
raised, which api/turns.py counts and logs as `client_stalled`.

Knows nothing of any dialect's shapes (a dialect hands it bytes) or of turns: when a reply's last
bytes may go out (its turn on disk) is turns.py's `Call.file`, awaited by the dialect.
"""

from __future__ import annotations

import asyncio
import socket
from contextlib import asynccontextmanager

from aiohttp import web

from rlproxy.api.edge import json_response
from rlproxy.appkeys import SETTINGS

# A stream's send buffers, kernel and asyncio: Linux grows a socket's to 4 MB (~27k chunks)
# when the client does not read, which would hide a stall for minutes; 16 KiB still carries
# an SSE stream's ~30 KB/s at a 500 ms round trip.
SSE_SEND_BUFFER = 16 * 1024
REPLAYED = {"X-Idempotent-Replay": "true"}


class ClientStalled(ConnectionResetError):
    """A streaming client took no bytes for --stall-timeout-s; its connection is aborted."""


class SseStream:
    """One prepared text/event-stream response. aiohttp's `write` waits for the socket only
    once per 64 KiB written, and with no limit of its own: `send` waits after every payload
    while the transport is over its high-water mark (SSE_SEND_BUFFER), so a reader that stops
    reading stops its writer within a few hundred chunks, and the whole write is bounded by
    --stall-timeout-s."""

    def __init__(self, request: web.Request, resp: web.StreamResponse, stall_timeout_s: float):
        self.request, self.resp, self.stall_timeout_s = request, resp, stall_timeout_s

    async def send(self, payload: bytes) -> None:
        async with self._stall_limit():
            await self.resp.write(payload)
            await self.request.writer.drain()  # waits while over the high-water mark

    async def end(self, payload: bytes = b"") -> web.StreamResponse:
        """Send `payload` (if any), then the end of the stream: the handler's answer."""
        if payload:
            await self.send(payload)
        async with self._stall_limit():
            await self.resp.write_eof()
        return self.resp

    @asynccontextmanager
    async def _stall_limit(self):
        """A write the client does not take within --stall-timeout-s aborts its connection."""
        try:
            async with asyncio.timeout(self.stall_timeout_s):
                yield
        except TimeoutError:
            transport = self.request.transport
            if transport is not None:
                transport.abort()  # close() would wait for the unread bytes forever
            raise ClientStalled(f"the client read nothing for {self.stall_timeout_s:g} s") \
                from None


async def open_stream(request: web.Request, headers: dict[str, str]) -> SseStream:
    """A prepared text/event-stream response with small send buffers."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                       **headers})
    await resp.prepare(request)
    transport = request.transport
    if transport is not None:  # the client went away: the first write will say so
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SSE_SEND_BUFFER)
        transport.set_write_buffer_limits(high=SSE_SEND_BUFFER)
    return SseStream(request, resp, request.app[SETTINGS].server.stall_timeout_s)


async def replay(request: web.Request, body: dict,
                 events: list[bytes] | None) -> web.StreamResponse:
    """A repeated X-Request-Id: the kept response again, nothing generated or recorded. `events`:
    the SSE payloads for a streaming repeat (the dialect's, from the kept body when the first
    attempt was not streamed); None for a whole body."""
    if events is None:
        return json_response(body, headers=REPLAYED)
    stream = await open_stream(request, REPLAYED)
    for payload in events:
        await stream.send(payload)
    return await stream.end()
