"""The app's middlewares, outermost first after metrics: errors in the API's own shape, then the
API key.

`errors_middleware` turns every exception a handler raises into an answer: an `APIError` in its
API's error shape, aiohttp's own HTTP errors (404, 405, 413) worded for agents, a record that
that could not be written (records.py `WriteFailed`) as a 507 Insufficient Storage when space
ran out, or a 503 for another disk error, naming the file, with Retry-After (nothing of the
turn was kept, so a retry is safe; edge.py `disk_full_error`; a stream says it in its own error
event and ends, `StreamEnded`), a
client that went away as one INFO line (499), and a bug as a 500 in the same shape, after which
the server keeps running. `auth_middleware` checks `--api-key` (Bearer, x-api-key, or the dashboard's
cookie) and keeps the dashboard's POST actions to its own pages.

Not here: reading and admitting bodies, metrics (api/edge.py); the handlers.
"""

from __future__ import annotations

import asyncio
import hmac
import logging

from aiohttp import web

from rlproxy.api.edge import StreamEnded, disk_full_error, error_response
from rlproxy.appkeys import SETTINGS
from rlproxy.ops.ui.views import COOKIE
from rlproxy.protocol import APIError, clip
from rlproxy.records import WriteFailed

log = logging.getLogger("rlproxy.server")

OPEN_PATHS = {"/healthz", "/ui/login"}  # no key needed: health probes; the key's own form


@web.middleware
async def errors_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except APIError as e:
        return error_response(e, request.path)
    except web.HTTPException as e:  # aiohttp's own: 404, 405, 413 ... in OpenAI's shape
        if e.status < 400:
            raise
        return error_response(http_error(request, e), request.path)
    except asyncio.CancelledError:
        raise
    except StreamEnded as e:  # a stream that already said what went wrong in its own shape
        log.error("%s %s: %s", request.method, request.path, e.__cause__ or e)
        return e.response
    except WriteFailed as e:  # the records' disk refused the turn: not a bug, no traceback
        log.error("%s %s: %s", request.method, request.path, e)
        return error_response(disk_full_error(e), request.path)
    except ConnectionError as e:
        if request.transport is None or request.transport.is_closing():
            # The client went away (a dropped stream, a timeout on its side): normal, one line.
            # Re-raised, aiohttp would log it as an error with a traceback.
            log.info("client went away during %s %s: %s", request.method, request.path,
                     e or type(e).__name__)
            return web.Response(status=499)  # nginx's code; nothing is sent on a closed line
        return internal_error(request)
    except Exception:
        return internal_error(request)


def internal_error(request: web.Request) -> web.Response:
    log.exception("unhandled error in %s %s", request.method, request.path)
    return error_response(APIError(500, "internal error in rlproxy; see the server log",
                                   type="server_error"), request.path)


def http_error(request: web.Request, e: web.HTTPException) -> APIError:
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status)
    message, headers = e.reason, None
    where = f"{request.method} {clip(request.path)}"
    if e.status == 404:
        # Ollama-style probes (/api/show, /api/v1/models) and anything else
        message = (f"no route for {where}; rlproxy speaks the OpenAI and Anthropic APIs "
                   "under /v1")
    elif e.status == 405:
        allowed = ", ".join(sorted(e.allowed_methods))
        message, headers = f"{where} is not allowed; this path takes {allowed}", {"Allow": allowed}
    elif e.status == 413:
        limit = request.app[SETTINGS].server.max_request_mb
        message = f"request body is larger than the limit of {limit} MB (--max-request-mb)"
    return APIError(e.status, message, code=code, headers=headers)


@web.middleware
async def auth_middleware(request: web.Request, handler):
    server = request.app[SETTINGS].server
    key = server.api_key
    public = request.path in OPEN_PATHS or (server.metrics_public and request.path == "/metrics")
    if key and not public and not authorized(request, key):
        if request.method == "GET" and request.path in ("/ui", "/ui/"):
            raise web.HTTPFound("/ui/login")  # a browser: the form sets the pages' cookie
        raise APIError(401, "Incorrect API key provided. Send it as 'Authorization: Bearer "
                       "<key>' or 'x-api-key: <key>' (--api-key / RLPROXY_API_KEY).",
                       code="invalid_api_key")
    if request.method == "POST" and request.path.startswith("/ui/api/") \
            and not (key and header_authorized(request, key)) and not same_origin(request):
        raise APIError(403, "the dashboard's actions take requests from its own pages only "
                       "(send header 'X-RLProxy-UI: 1', or use /v1/... with the API key)",
                       code="cross_site_request")
    return await handler(request)


def header_authorized(request: web.Request, key: str) -> bool:
    # OpenAI clients send a Bearer token, Anthropic's send x-api-key
    return (same_key(request.headers.get("Authorization"), f"Bearer {key}")
            or same_key(request.headers.get("x-api-key"), key))


def authorized(request: web.Request, key: str) -> bool:
    # the dashboard's pages send the cookie its login form set (HttpOnly, valid under /ui only)
    return header_authorized(request, key) or (
        request.path.startswith("/ui") and same_key(request.cookies.get(COOKIE), key))


def same_key(given: str | None, key: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), key.encode())


def same_origin(request: web.Request) -> bool:
    """Whether a cookie-carrying POST comes from the dashboard's own pages. SameSite does not
    tell ports apart, so a page on another port of this host would pass it: a browser sends
    the custom header only after a CORS preflight this server never grants cross-site."""
    if request.headers.get("X-RLProxy-UI") == "1":
        return True
    if request.headers.get("Sec-Fetch-Site") == "same-origin":
        return True
    origin = request.headers.get("Origin")
    return origin is not None and origin == f"{request.scheme}://{request.host}"
