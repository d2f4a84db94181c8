"""The aiohttp application: routes, middlewares, and the long-lived resources' lifetimes.

`create_app(settings)` builds everything; each resource (the model + engine thread) is set up and
torn down in one cleanup context and kept under a typed `web.AppKey`. Handlers parse at the edge
(protocol.py), hand token work to completions.py, and never touch MLX themselves. Every error a
client can cause is a 4xx in OpenAI's error shape; a bug is a 500 in the same shape, and the
server keeps running.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from rlproxy.appkeys import ENGINE, MODEL, SESSIONS, SETTINGS, STARTED, TRAINABLE
from rlproxy.blas import blas_in_use
from rlproxy.chat import chat_completions, json_response, served_names
from rlproxy.engine import Engine
from rlproxy.model import LoadedModel, load_serving_model
from rlproxy.protocol import APIError
from rlproxy.sessions import SessionStore
from rlproxy.settings import Settings

log = logging.getLogger("rlproxy.server")

OPEN_PATHS = {"/healthz"}  # no API key needed: nothing secret, and load balancers probe it


def error_response(err: APIError) -> web.Response:
    return json_response(err.body(), status=err.status)


@web.middleware
async def errors_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except APIError as e:
        return error_response(e)
    except web.HTTPException as e:  # aiohttp's own: 404, 405, 413 ... in OpenAI's shape
        if e.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status)
        message = e.reason if e.status != 404 else f"no route for {request.method} {request.path}"
        if e.status == 413:
            limit = request.app[SETTINGS].server.max_request_mb
            message = f"request body is larger than the limit of {limit} MB (--max-request-mb)"
        return error_response(APIError(e.status, message, code=code))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(APIError(500, "internal error in rlproxy; see the server log",
                                       type="server_error"))


@web.middleware
async def auth_middleware(request: web.Request, handler):
    key = request.app[SETTINGS].server.api_key
    if key and request.path not in OPEN_PATHS:
        header = request.headers.get("Authorization", "")
        if header != f"Bearer {key}":
            raise APIError(401, "Incorrect API key provided. Send it as 'Authorization: Bearer "
                           "<key>' (--api-key / RLPROXY_API_KEY).", code="invalid_api_key")
    return await handler(request)


async def list_models(request: web.Request) -> web.Response:
    created = int(request.app[STARTED])
    data = [{"id": name, "object": "model", "created": created, "owned_by": "rlproxy"}
            for name in served_names(request.app)]
    return json_response({"object": "list", "data": data})


async def get_model(request: web.Request) -> web.Response:
    name = request.match_info["model_id"]
    if name not in served_names(request.app):
        raise APIError(404, f"The model '{name}' does not exist", param="model",
                       code="model_not_found")
    return json_response({"id": name, "object": "model", "created": int(request.app[STARTED]),
                          "owned_by": "rlproxy"})


async def healthz(request: web.Request) -> web.Response:
    engine, model = request.app[ENGINE], request.app[MODEL]
    ok = engine.alive and engine.error is None
    return json_response({
        "status": "ok" if ok else "error",
        "error": engine.error,
        "model": model.model_id,
        "served_model_names": served_names(request.app),
        "adapter_version": int(engine.adapter_version),
        "blas": blas_in_use(),
        "context_length": model.context_length,
        "engine": dict(engine.stats),
        "sessions_open": len(request.app[SESSIONS].open),
        "trainable_turns_queued": request.app[TRAINABLE].qsize(),
        "uptime_s": round(time.time() - request.app[STARTED], 1),
    }, status=200 if ok else 503)


async def list_sessions(request: web.Request) -> web.Response:
    store = request.app[SESSIONS]
    data = [s.summary() for s in store.open.values()]
    data += [s.summary() for s in reversed(store.closed)]
    return json_response({"object": "list", "data": data})


async def get_session(request: web.Request) -> web.Response:
    session = request.app[SESSIONS].find(request.match_info["session_id"])
    if session is None:
        raise APIError(404, f"no session {request.match_info['session_id']!r} (open or recently "
                       "closed)", param="session_id", code="session_not_found")
    return json_response(session.summary(with_turns=True))


async def end_session(request: web.Request) -> web.Response:
    sid = request.match_info["session_id"]
    if not request.app[SESSIONS].end(sid, "ended"):
        raise APIError(404, f"no open session {sid!r}", param="session_id",
                       code="session_not_found")
    return json_response({"id": sid, "object": "session", "open": False, "closed": "ended"})


async def not_found(request: web.Request) -> web.Response:
    # Ollama-style probes (/api/show, /api/v1/models) and anything else: a clean JSON 404.
    raise APIError(404, f"no route for {request.method} {request.path}; rlproxy speaks the "
                   "OpenAI API under /v1", code="not_found")


def sessions_context(settings: Settings):
    async def ctx(app: web.Application):
        queue: asyncio.Queue = asyncio.Queue()
        store = SessionStore(settings.records.data_dir, settings.sessions.session_idle_timeout_s,
                             fsync=settings.records.fsync, on_trainable=queue.put_nowait)
        app[SESSIONS], app[TRAINABLE] = store, queue
        sweeper = asyncio.create_task(sweep_idle_sessions(store))
        yield
        sweeper.cancel()
        store.close()

    return ctx


async def sweep_idle_sessions(store: SessionStore) -> None:
    while True:
        await asyncio.sleep(min(5.0, store.idle_timeout_s / 4))
        for sid in store.sweep_idle():
            log.info("session %s closed after %.0f s idle", sid, store.idle_timeout_s)


def engine_context(settings: Settings, loaded: LoadedModel | None):
    async def ctx(app: web.Application):
        model = loaded or await asyncio.get_running_loop().run_in_executor(
            None, load_serving_model, settings.model)
        engine = Engine(model.model, model.tokenizer.eos_token_ids,
                        max_batch=settings.engine.max_batch,
                        prefill_step_size=settings.engine.prefill_step_size)
        engine.start()
        app[MODEL], app[ENGINE] = model, engine
        log.info("serving %s (context %d tokens, BLAS: %s)", model.model_id,
                 model.context_length, blas_in_use())
        yield
        await asyncio.get_running_loop().run_in_executor(None, engine.stop)

    return ctx


def create_app(settings: Settings, loaded: LoadedModel | None = None) -> web.Application:
    """The whole server. Pass `loaded` to reuse an already loaded model (tests, benchmarks)."""
    app = web.Application(
        middlewares=[errors_middleware, auth_middleware],
        client_max_size=int(settings.server.max_request_mb * 1024 * 1024),
    )
    app[SETTINGS] = settings
    app[STARTED] = time.time()
    app.cleanup_ctx.append(sessions_context(settings))
    app.cleanup_ctx.append(engine_context(settings, loaded))
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model_id:.+}", get_model)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/sessions", list_sessions)
    app.router.add_get("/v1/sessions/{session_id}", get_session)
    app.router.add_post("/v1/sessions/{session_id}/end", end_session)
    app.router.add_route("*", "/{tail:.*}", not_found)
    return app
