"""The HTTP edge: what happens to a request before a handler reads it, and to the errors aiohttp
answers itself.

Owns:
- `metrics_middleware` (outermost): every answer counted by API and status
  (`rlproxy_requests`), and the request's checked session id set for the JSON log lines.
- `body_middleware`: every request body is read once, here, within
  `--body-read-timeout-s` (a stalled body is a 408, not a held connection), and a body that
  cannot be decoded (bad gzip/deflate, broken chunking) is a 400 on every route. Handlers then
  read the cached bytes and parse them with `json_body` (`--max-json-depth`).
- `admission_middleware`: at most `--max-queued-requests` generation requests (chat, responses,
  messages) running or waiting at once; past it a 429 with Retry-After. `/healthz` shows the
  gate's `health()`.
- `error_response`: the API's error shape for a path (Anthropic's under /v1/messages).
- `json_errors_on_prepare`: aiohttp's text errors raised before the middlewares (a bad
  `Expect`) in JSON. The connection-level server (aiohttp's own parse errors, the runner) is
  api/server.py.

Knows nothing of any dialect's fields (protocol.py and api/*_input.py) or of generation. The
one way a handler answers JSON, `json_response`, is protocol.py's (the dashboard, below api/,
uses it too); handlers may import it from here.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from dataclasses import dataclass
from http import HTTPStatus
from typing import TypeVar

import orjson
from aiohttp import http_exceptions as hx
from aiohttp import web
from pydantic import BaseModel

from rlproxy.api.messages_output import error_body as messages_error_body
from rlproxy.api.tags import valid_session_id
from rlproxy.appkeys import ADMISSION, SETTINGS
from rlproxy.ops.logs import SESSION_ID, TURN_UID
from rlproxy.ops.metrics import REQUESTS
from rlproxy.protocol import APIError, json_response, load_json, validate
from rlproxy.records import WriteFailed

log = logging.getLogger("rlproxy.edge")

GENERATION_ROUTES = frozenset({"/v1/chat/completions", "/v1/responses", "/v1/messages"})
OFFLOAD_BYTES = 1 << 20  # decode larger bodies on a worker thread: the loop serves streams
DISK_FULL_RETRY_S = 30  # space comes back when an operator frees it: not within a second
RETRY_AFTER_S = 1  # a 4-token request takes well under a second; SDKs honour the header


# ---- the error shape ----

class StreamEnded(Exception):
    """A streamed response that has already ended with its API's error event: the handler's
    answer is that response (errors_middleware returns it)."""

    def __init__(self, response: web.StreamResponse):
        super().__init__("the stream ended with an error event")
        self.response = response


def disk_full_error(e: WriteFailed) -> APIError:
    """A turn whose lines the disk refused, naming the file (nothing of it was kept, so a retry
    is safe): 507 when space ran out, 503 for another write error (a disk remounted read-only,
    a failing device)."""
    space = e.cause.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    return APIError(507 if space else 503, f"{e.strerror}. " + (
        "Free space on the data directory's disk and retry" if space else
        "Check the data directory's disk and retry") + "; the server resumes by itself once "
        "writes succeed.", type="server_error",
        code="insufficient_storage" if space else "records_unwritable",
        headers={"Retry-After": str(DISK_FULL_RETRY_S)})


def error_response(err: APIError, path: str) -> web.Response:
    # Anthropic's SDK and Claude Code read errors in Anthropic's shape; all else gets OpenAI's.
    body = messages_error_body(err) if path.startswith("/v1/messages") else err.body()
    return json_response(body, err.status, err.headers)


def both_shapes(err: APIError) -> dict:
    """For an error whose path is unknown (the request line itself was bad): a body both SDKs
    read, OpenAI's `error` object inside Anthropic's `{"type": "error"}`."""
    return {"type": "error", **err.body()}


# ---- counting every answer ----

def api_of(path: str) -> str:
    """A low-cardinality label for a request path."""
    for prefix, name in (("/v1/chat/", "chat"), ("/v1/responses", "responses"),
                         ("/v1/messages", "messages"), ("/v1/models", "models"),
                         ("/v1/sessions", "sessions"), ("/v1/feedback", "feedback"),
                         ("/v1/adapters", "control"), ("/v1/training", "control"),
                         ("/ui", "ui"), ("/metrics", "metrics"), ("/healthz", "healthz")):
        if path.startswith(prefix):
            return name
    return "other"


@web.middleware
async def metrics_middleware(request: web.Request, handler):
    """Outermost: counts every answer by API and status, after errors became responses."""
    sid = request.headers.get("X-Session-Id")
    SESSION_ID.set(sid if valid_session_id(sid) else None)  # log lines carry checked ids only
    TURN_UID.set(None)
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except web.HTTPException as e:
        status = e.status
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        status = 499  # the client went away (nginx's code): not a server error
        raise
    finally:
        REQUESTS.labels(api_of(request.path), str(status)).inc()


# ---- the body, read once ----

@web.middleware
async def body_middleware(request: web.Request, handler):
    """Read the whole body before the handler runs (aiohttp caches it for `request.read()`;
    no route here takes multipart, which aiohttp would parse from the stream instead)."""
    if request.body_exists:
        err = await read_body(request)
        if err is not None:
            return await answer_and_close(request, error_response(err, request.path))
    return await handler(request)


async def read_body(request: web.Request) -> APIError | None:
    """The error to answer instead, or None once the body is read. Too large is aiohttp's 413,
    which errors_middleware words."""
    limit_s = request.app[SETTINGS].server.body_read_timeout_s
    try:
        async with asyncio.timeout(limit_s):
            await request.read()
    except TimeoutError:
        return APIError(408, f"the request body did not arrive within {limit_s:g} s "
                        "(--body-read-timeout-s): send as many bytes as Content-Length says",
                        code="request_timeout")
    except web.RequestPayloadError as e:
        return payload_error(e.__cause__)
    return None


def payload_error(cause: BaseException | None) -> APIError:
    if isinstance(cause, hx.ContentEncodingError):
        return APIError(400, "the body could not be decoded as its Content-Encoding says "
                        "(rlproxy reads identity, gzip and deflate)", code="invalid_encoding")
    if isinstance(cause, hx.DecompressSizeError):
        return APIError(413, "the body is larger than the limit once decompressed "
                        "(--max-request-mb)", code="request_too_large")
    if isinstance(cause, hx.TransferEncodingError):
        return APIError(400, "the chunked body is malformed", code="invalid_chunked_body")
    if isinstance(cause, hx.ContentLengthError):
        return APIError(400, "the body ended before its Content-Length",
                        code="invalid_content_length")
    return APIError(400, "the body could not be read", code="invalid_body")


async def answer_and_close(request: web.Request, resp: web.Response) -> web.Response:
    """Send `resp`, then close the connection: the rest of a broken or stalled body is never
    read. (Left open, aiohttp would keep reading it for 10 more seconds, and log its error.)"""
    resp.force_close()
    await resp.prepare(request)
    await resp.write_eof()
    request.protocol.force_close()
    return resp


M = TypeVar("M", bound=BaseModel)


async def json_body(request: web.Request, model: type[M]) -> M:
    """The body (read by body_middleware) as `model`, from a JSON object at most
    `--max-json-depth` deep; any bad input raises APIError(400)."""
    raw, depth = await request.read(), max_json_depth(request)
    if len(raw) > OFFLOAD_BYTES:
        data = await asyncio.get_running_loop().run_in_executor(None, load_json, raw, depth)
    else:
        data = load_json(raw, depth)
    return validate(model, data, max_depth=depth)


def max_json_depth(request: web.Request) -> int:
    return request.app[SETTINGS].server.max_json_depth


# ---- admission control ----

@dataclass
class Admission:
    """Generation requests admitted and not yet answered (running, or waiting in the engine)."""

    limit: int
    admitted: int = 0

    def health(self) -> dict:
        """What /healthz shows under "requests"."""
        return {"admitted": self.admitted, "limit": self.limit}




@web.middleware
async def admission_middleware(request: web.Request, handler):
    if request.method != "POST" or request.path not in GENERATION_ROUTES:
        return await handler(request)
    gate = request.app[ADMISSION]
    if gate.admitted >= gate.limit:
        raise APIError(429, f"rlproxy is busy: {gate.limit} generation requests are running or "
                       "waiting (--max-queued-requests); retry shortly",
                       type="rate_limit_error", code="too_many_requests",
                       headers={"Retry-After": str(RETRY_AFTER_S)})
    gate.admitted += 1
    try:
        return await handler(request)
    finally:
        gate.admitted -= 1


# ---- what aiohttp answers itself ----

async def json_errors_on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """aiohttp's text errors raised before the middlewares run (a 417 for an unknown `Expect`)
    in the API's shape. Errors from handlers never get here as text: errors_middleware words
    them."""
    if not (isinstance(response, web.HTTPException) and response.status >= 400
            and response.content_type == "text/plain"):
        return
    text = (response.text or response.reason).strip().split("\n")[0]
    err = APIError(response.status, text if len(text) <= 200 else text[:197] + "...",
                   code=HTTPStatus(response.status).phrase.lower().replace(" ", "_"))
    body = orjson.dumps(messages_error_body(err) if request.path.startswith("/v1/messages")
                        else err.body())
    response.body = body
    response.content_type = "application/json"
    response.headers["Content-Length"] = str(len(body))
    # the body was never read, and aiohttp reads it after this answer: if that fails (a broken
    # gzip) it drops the line, so the client must not count on it (too late for force_close()
    # to say so: the Connection header is already decided)
    response.headers["Connection"] = "close"
    response.force_close()
