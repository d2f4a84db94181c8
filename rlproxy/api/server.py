"""The listening server: aiohttp's low-level connection handling, made JSON and made safe.

Owns:
- `RequestHandler`: aiohttp's own answers to requests it cannot parse (headers too long or too
  many, bad chunking or Content-Length, unknown methods, non-ASCII paths, br/zstd bodies) in
  JSON in the API's shape. A client that went away or sent garbage is logged at INFO in one line.
- `AppRunner`: aiohttp's runner whose connections are `RequestHandler`s.
- `run_app`: serve until SIGINT or SIGTERM, then clean up.

Does not own anything a handler or middleware does (api/edge.py), nor any route.
"""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus

from aiohttp import http_exceptions as hx
from aiohttp import web

from rlproxy.api.edge import both_shapes, error_response, json_response
from rlproxy.protocol import APIError, shown

log = logging.getLogger("rlproxy.edge")


LOW_LEVEL_CODES = ((hx.LineTooLong, "header_too_large"), (hx.BadHttpMethod, "invalid_method"),
                   (hx.InvalidURLError, "invalid_url"),
                   (hx.ContentEncodingError, "unsupported_encoding"),
                   (hx.TransferEncodingError, "invalid_chunked_body"),
                   (hx.ContentLengthError, "invalid_content_length"),
                   (hx.InvalidHeader, "invalid_header"), (hx.BadStatusLine, "invalid_request_line"))


def low_level_error(status: int, exc: BaseException | None, message: str | None) -> APIError:
    """aiohttp's parse error as an APIError: its first line without the raw bytes it quotes."""
    code = next((c for cls, c in LOW_LEVEL_CODES if isinstance(exc, cls)), None)
    if isinstance(exc, hx.ContentEncodingError):  # br or zstd: aiohttp lacks the decoder here
        text = ("the body's Content-Encoding is not supported (rlproxy reads identity, gzip "
                "and deflate)")
    elif status >= 500:
        text = ("the request handler timed out" if status == 504
                else "internal error in rlproxy; see the server log")
    else:
        first = ((exc.message if isinstance(exc, hx.HttpProcessingError) else message)
                 or HTTPStatus(status).phrase).strip().split("\n")[0]
        text = first.split(": b'")[0].split(': b"')[0].rstrip(":. ")
        if "Too many headers" in text:
            code = "too_many_headers"
        text = f"the request could not be parsed: {text[:200]}"
    if status >= 500:
        return APIError(status, text, type="server_error")
    return APIError(status, text, code=code or "bad_request")


class RequestHandler(web.RequestHandler):
    """One connection, as aiohttp's, but its own error answers are JSON in the API's shape, and
    what a client did wrong is an INFO line, not an error with a traceback."""

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        expect = request.headers.get("Expect", "100-continue").lower()
        if status == 500 and expect != "100-continue" and isinstance(exc, UnicodeError):
            # aiohttp runs the expect handler before the handler, and its 417 for an unknown
            # Expect fails to build when the value is not UTF-8 (so nothing else ran)
            log.info("unmet Expect from %s: %s", request.remote, shown(expect))
            resp = error_response(APIError(417, "only 'Expect: 100-continue' is supported",
                                           code="expectation_failed"), request.path)
            resp.force_close()
            return resp
        if isinstance(exc, ConnectionError):
            log.info("client %s went away: %s", request.remote, exc)
        elif status < 500:  # the client sent something unparsable: its problem, not a bug
            log.info("unparsable request from %s: %s", request.remote,
                     shown(str(getattr(exc, "message", None) or message or exc), 200))
        else:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
        if request.writer.output_size > 0:  # as aiohttp: a response was begun, end the line
            raise ConnectionError("Response is sent already, cannot send another response "
                                  "with the error message")
        resp = json_response(both_shapes(low_level_error(status, exc, message)), status)
        resp.force_close()
        return resp

    def log_exception(self, *args, **kw) -> None:
        # After answering a request whose body it never read (a 417, a 404), aiohttp reads the
        # rest to keep the connection; a broken body then fails there, and is the client's.
        exc = kw.get("exc_info")
        if isinstance(exc, (web.RequestPayloadError, ConnectionError)):
            log.info("unread body of a request from %s: %s", self.transport and
                     self.transport.get_extra_info("peername"), shown(str(exc), 200))
            return
        super().log_exception(*args, **kw)


class _Server(web.Server):
    def __call__(self) -> RequestHandler:
        return RequestHandler(self, loop=self._loop, **self._kwargs)


class AppRunner(web.AppRunner):
    """web.AppRunner whose connections are `RequestHandler`s. aiohttp has no option for the
    handler class (an app's `handler_args` only reach its keyword arguments), so this gives the
    server aiohttp built the one method that differs, `__call__`, which makes a connection."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server
        return server



def run_app(app: web.Application, *, host: str, port: int, print=print) -> None:
    """web.run_app with this module's AppRunner (aiohttp's builds its own): serve until SIGINT
    or SIGTERM, then clean up."""
    async def serve() -> None:
        runner = AppRunner(app, handle_signals=True, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
            print(f"======== Running on http://{host}:{port} ========\n(Press CTRL+C to quit)")
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(serve())
    except (web.GracefulExit, KeyboardInterrupt):  # the runner's signal handlers raise these
        pass
