"""The listening server: aiohttp's low-level connection handling, made JSON and made safe.

Owns:
- `RequestHandler`: aiohttp's own answers to requests it cannot parse (headers too long or too
  many, bad chunking or Content-Length, unknown methods, non-ASCII paths, br/zstd bodies) in
  JSON in the API's shape. A client that went away or sent garbage is logged at INFO in one line.
- Connection limits, on every connection (`RequestHandler`, `_Server`): one that has not sent
  a whole request line and headers within --header-timeout-s is closed (aiohttp's own
  keepalive_timeout closes idle keep-alive ones); at --max-connections a new connection closes
  the oldest one waiting for a request (silent, dribbling or idle: it holds a file descriptor
  and nothing else), and is itself refused with a 503 only when all are busy in a request. So a
  flood of silent connections costs no more than the cap, and /healthz still answers. Each of
  these is counted into one log line per LOG_EVERY_S, as are failed accepts (EMFILE).
- `AppRunner`: aiohttp's runner whose connections are `RequestHandler`s; at setup it raises the
  open-file limit mlx_lm.utils lowers on import (`raise_open_file_limit`).
- `run_app`: serve until SIGINT or SIGTERM, then drain (`drain`): stop accepting, let
  in-flight requests finish for --drain-timeout-s, end the rest (`app[STOPPING]`), clean up.

Does not own anything a handler or middleware does (api/edge.py), nor any route.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import signal
from dataclasses import dataclass
from http import HTTPStatus

import orjson
from aiohttp import http_exceptions as hx
from aiohttp import web

from rlproxy.api.edge import both_shapes, error_response, json_response
from rlproxy.appkeys import ADMISSION, DRAINING, OUTLIVES, SETTINGS, STOPPING
from rlproxy.ops.ranks import launched_rank
from rlproxy.protocol import APIError, shown
from rlproxy.settings import ServerSettings

log = logging.getLogger("rlproxy.edge")

# Noted before mlx_lm.utils is imported: it sets (2048, 4096) on import, hard limit included.
NOFILE_AT_IMPORT = resource.getrlimit(resource.RLIMIT_NOFILE)
LOG_EVERY_S = 10.0
ACCEPT_FAILED = "socket.accept() out of system resource"  # asyncio's message (selector_events)


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


class Tally:
    """An event counted into at most one log line per LOG_EVERY_S: the first at once, the rest
    as one count when the interval ends, so a flood of them is a line every few seconds."""

    def __init__(self, level: int, message: str, *args):
        self.level, self.message, self.args = level, message, args  # MESSAGE: the count first
        self.count, self.timer = 0, None

    def add(self) -> None:
        self.count += 1
        if self.timer is None:
            self._flush()

    def _flush(self) -> None:
        self.timer = None
        if self.count:
            log.log(self.level, self.message, self.count, *self.args)
            self.count = 0
            self.timer = asyncio.get_running_loop().call_later(LOG_EVERY_S, self._flush)


@dataclass
class Tallies:
    late: Tally  # closed for not sending whole headers in time
    evicted: Tally  # closed, waiting for a request, to make room for a new one
    refused: Tally  # new ones turned away: every connection busy in a request
    accept_failed: Tally  # accept() out of file descriptors (or memory)


def make_tallies(cap: int, nofile: int, header_timeout_s: float) -> Tallies:
    return Tallies(
        Tally(logging.INFO, "closed %d connection(s) that sent no whole request line and headers "
              "within %g s (--header-timeout-s)", header_timeout_s),
        Tally(logging.WARNING, "%d new connection(s) past --max-connections %d: closed as many "
              "of the oldest ones waiting for a request", cap),
        Tally(logging.WARNING, "refused %d connection(s) with 503: all --max-connections %d are "
              "busy in a request", cap),
        Tally(logging.WARNING, "could not accept a connection %d time(s): out of file "
              "descriptors (open-file limit %d, --max-connections %d); clients wait in the "
              "listen backlog", nofile, cap))


def raise_open_file_limit(wanted: tuple[int, int] = NOFILE_AT_IMPORT) -> int:
    """Raise the soft open-file limit to WANTED's hard limit where allowed (mlx_lm.utils lowers
    it to 4096 on import; raising a hard limit needs privileges), else to the current hard
    one. Returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for limit in (wanted[1], hard):
        if limit == resource.RLIM_INFINITY or limit <= soft:  # (macOS refuses an infinite soft)
            continue
        new_hard = hard if hard == resource.RLIM_INFINITY else max(limit, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, new_hard))
            break
        except (ValueError, OSError):  # above the hard limit, unprivileged: try the next
            continue
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def tally_accept_failures(previous, tally: Tally):
    """A loop exception handler: asyncio's accept() failure (EMFILE) counted into TALLY, not
    logged with a traceback each time a listening socket retries (once a second, each); the rest
    as before. A runner set up again on the same loop replaces its own handler, not wraps it."""
    previous = getattr(previous, "previous", previous)

    def handle(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if context.get("message") == ACCEPT_FAILED:
            tally.add()
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)
    handle.previous = previous
    return handle


def refusal() -> bytes:
    """The whole answer a refused connection gets before it is closed."""
    body = orjson.dumps(both_shapes(APIError(
        503, "too many open connections (--max-connections), all busy; retry shortly",
        type="server_error", code="too_many_connections")))
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
            % (len(body), body))


REFUSAL = refusal()


def make_room(server: _Server) -> bool:
    """Close the oldest connection waiting for a request (it holds a descriptor and no work);
    False when every connection is busy in one."""
    oldest = next((h for h in server._connections if h.waiting()), None)
    if oldest is None:
        return False
    server.tallies.evicted.add()
    oldest.force_close()
    # no longer counted: aiohttp forgets it only once its task ends, a loop turn or two later,
    # and one burst of accepts would otherwise find the cap full of closing connections
    server._connections.pop(oldest, None)
    return True


class RequestHandler(web.RequestHandler):
    """One connection, as aiohttp's, but its own error answers are JSON in the API's shape, and
    what a client did wrong is an INFO line, not an error with a traceback. It is closed if a
    request's line and headers take longer than the server's header timeout, and refused when
    the server is at its cap with no waiting connection to close instead."""

    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        server = self._manager
        if len(server._connections) >= server.max_connections and not make_room(server):
            server.tallies.refused.add()
            transport.write(REFUSAL)
            transport.close()
            self._manager = None  # never joined the server: connection_lost has nothing to undo
            return
        super().connection_made(transport)
        self._header_timer = self._loop.call_later(server.header_timeout_s, self._headers_late)

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and data and self.waiting():  # a next request begins
            self._header_timer = self._loop.call_later(self._manager.header_timeout_s,
                                                       self._headers_late)
        parsed = self._request_count
        super().data_received(data)
        if self._request_count != parsed and self._header_timer is not None:  # headers whole
            self._header_timer.cancel()
            self._header_timer = None

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def waiting(self) -> bool:
        """Open and no request in hand: none received whole yet, or between two (aiohttp
        awaits its waiter only then)."""
        return not self._force_close and (self._request_count == 0 or (
            self._waiter is not None and not self._waiter.done()))

    def _headers_late(self) -> None:
        self._header_timer = None
        if self._manager is not None and not self._force_close:
            self._manager.tallies.late.add()
            self.force_close()

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
    """aiohttp's server with the limits its RequestHandlers read (set by AppRunner)."""

    max_connections: int
    header_timeout_s: float
    tallies: Tallies

    def __call__(self) -> RequestHandler:
        return RequestHandler(self, loop=self._loop, **self._kwargs)


class AppRunner(web.AppRunner):
    """web.AppRunner whose connections are `RequestHandler`s. aiohttp has no option for the
    handler class (an app's `handler_args` only reach its keyword arguments), so this gives the
    server aiohttp built the one method that differs, `__call__`, which makes a connection.

    The limits are the app's settings (--header-timeout-s, --keepalive-timeout-s,
    --max-connections; defaults for an app without them, such as a test's stub)."""

    def __init__(self, app: web.Application, **kwargs):
        self.limits = app[SETTINGS].server if SETTINGS in app else ServerSettings()
        kwargs.setdefault("keepalive_timeout", self.limits.keepalive_timeout_s)
        super().__init__(app, **kwargs)

    async def _make_server(self) -> web.Server:
        nofile = raise_open_file_limit()
        cap = self.limits.max_connections or nofile * 3 // 4  # the rest: records, model, cache
        log.info("open-file limit %d: at most %d client connections (header timeout %g s, "
                 "keep-alive %g s)", nofile, cap, self.limits.header_timeout_s,
                 self.limits.keepalive_timeout_s)
        server = await super()._make_server()
        server.__class__ = _Server
        server.max_connections, server.header_timeout_s = cap, self.limits.header_timeout_s
        server.tallies = make_tallies(cap, nofile, self.limits.header_timeout_s)
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(tally_accept_failures(loop.get_exception_handler(),
                                                         server.tallies.accept_failed))
        return server


def run_app(app: web.Application, *, host: str, port: int, print=print) -> None:
    """Serve until SIGINT or SIGTERM (`handled_signals`), then drain: stop accepting, let
    in-flight requests finish for up to --drain-timeout-s, then set `app[STOPPING]` so the rest
    end now (a stream with its API's error event, a waiting request with 503), give them
    STOP_GRACE_S to say so, and run the app's cleanup (records and journal flushed). A second
    signal skips the drain.
    Under mlx.launch (`app[OUTLIVES]`) a SIGTERM or SIGHUP first asks whether a rank failed:
    then rank 0 serves on, and only SIGINT stops it.

    Not aiohttp's `handle_signals`: it raises GracefulExit inside the loop, and asyncio.run
    then cancels every task at once, handlers and cleanup alike."""
    async def serve() -> None:
        loop = asyncio.get_running_loop()
        signalled = asyncio.Event()
        stopping = app.setdefault(STOPPING, asyncio.Event())  # create_app may have made it

        checking: set = set()

        def on_signal(sig: signal.Signals) -> None:
            if signalled.is_set():  # a second signal: no more waiting
                log.info("%s again: ending in-flight requests now", sig.name)
                stopping.set()
            elif sig != signal.SIGINT and OUTLIVES in app:  # mlx.launch's, maybe
                if not checking:  # one check answers for the signals that come meanwhile
                    checking.add(asyncio.ensure_future(outlive(sig)))
                return
            signalled.set()

        async def outlive(sig: signal.Signals) -> None:
            """mlx.launch sends SIGTERM to rank 0 when another rank exits with an error: then
            serving goes on (training waits); from anyone else the signal stops the server."""
            try:
                reason = await loop.run_in_executor(None, app[OUTLIVES])
            finally:
                checking.clear()
            if reason is None:
                signalled.set()
            else:
                log.warning("%s: not stopping: %s", sig.name, reason)

        signals = handled_signals()
        for sig in signals:
            loop.add_signal_handler(sig, on_signal, sig)
        runner = AppRunner(app, access_log=None, shutdown_timeout=STOP_GRACE_S)
        try:
            # in the try: an error while the contexts start (a refused learner, a missing key)
            # still runs the cleanup of those that had started, so the engine's MLX thread ends
            # before the interpreter does (a daemon MLX thread alive at exit can abort it)
            await runner.setup()
            await web.TCPSite(runner, host, port).start()
            print(f"======== Running on http://{host}:{port} ========\n(Press CTRL+C to quit)")
            await signalled.wait()
            app[DRAINING].set()  # long background work stops now, beside the drain
            await drain(runner, app[SETTINGS].server.drain_timeout_s, stopping)
        finally:
            await runner.cleanup()  # handlers left after the grace are cancelled; cleanup_ctx
            for sig in signals:
                loop.remove_signal_handler(sig)

    asyncio.run(serve())


def handled_signals() -> tuple:
    """SIGINT and SIGTERM; under mlx.launch SIGHUP too (a remote rank 0 gets it when the
    launcher's ssh goes), unless it is ignored (nohup)."""
    if launched_rank() is not None and signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:
        return (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    return (signal.SIGINT, signal.SIGTERM)


STOP_GRACE_S = 5.0  # after STOPPING: for handlers to write their error event or 503


async def drain(runner: web.AppRunner, timeout_s: float, stopping: asyncio.Event) -> None:
    """Close the listening sockets and idle keep-alive connections, wait until no generation
    request is in flight (the admission gate's count: the only requests that run long) or
    `timeout_s` passed, then set `stopping`. Other requests get the runner's STOP_GRACE_S."""
    for site in list(runner.sites):
        await site.stop()
    runner.server.pre_shutdown()  # aiohttp: idle connections close now, busy ones after
    gate = runner.app[ADMISSION]
    log.info("shutting down: %d generation request(s) in flight; draining for up to %g s",
             gate.admitted, timeout_s)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while gate.admitted and not stopping.is_set():
        if loop.time() >= deadline:
            log.info("drain ran out with %d generation request(s) in flight: ending them",
                     gate.admitted)
            break
        await asyncio.sleep(0.05)
    stopping.set()
