"""The aiohttp application: routes, middlewares, and the long-lived resources' lifetimes.

`create_app(settings)` builds everything; each resource (the model + engine thread) is set up and
torn down in one cleanup context and kept under a typed `web.AppKey`. Handlers parse at the edge
(api/edge.py reads every body once; protocol.py and api/*_input.py parse it), hand token work to
serving/completions.py, and never touch MLX themselves. Every error a client can cause is a 4xx in
OpenAI's error shape (Anthropic's under /v1/messages); a bug is a 500 in the same shape, and the
server keeps running. A client that went away is one INFO line. Serve the app with
`edge.AppRunner` (or `edge.run_app`) so aiohttp's own parse errors are JSON too.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from datetime import datetime, timezone

from aiohttp import web

from rlproxy.appkeys import (
    ENGINE, METRICS, MODEL, SCORER, SESSIONS, SETTINGS, STARTED, TRAINER,
)
from rlproxy.serving.blas import blas_in_use
from rlproxy.ops.progress import phase
from rlproxy.api import admin as control
from rlproxy.ops import metrics
from rlproxy.api import edge, responses
from rlproxy.api.chat import chat_completions
from rlproxy.api.edge import error_response
from rlproxy.api.feedback import feedback
from rlproxy.api.response_store import response_store_context
from rlproxy.api.messages import count_tokens, create_message
from rlproxy.api.turns import json_response, served_names
from rlproxy.serving.engine import Engine
from rlproxy.tinker.routes import add_tinker_routes
from rlproxy.scoring.judges import LocalJudge, RemoteJudge
from rlproxy.serving.model import LoadedModel, load_base_model, load_serving_model
from rlproxy.scoring.scorer import Scorer
from rlproxy.training.trainer import Trainer, released_turns, training_copy
from rlproxy.protocol import APIError, clip, shown
from rlproxy.sessions.store import SessionStore, sweep_idle_forever
from rlproxy.settings import Settings
from rlproxy.ops.ui.views import COOKIE, add_ui_routes, ui_context

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


def model_card(app: web.Application, name: str) -> dict:
    """One served model in a shape both SDKs parse: OpenAI's fields, then Anthropic's."""
    created = int(app[STARTED])
    return {"id": name, "object": "model", "created": created, "owned_by": "rlproxy",
            "type": "model", "display_name": name,
            "created_at": datetime.fromtimestamp(created, timezone.utc).strftime(
                "%Y-%m-%dT%H:%M:%SZ"),
            "max_input_tokens": app[MODEL].context_length}


async def list_models(request: web.Request) -> web.Response:
    data = [model_card(request.app, name) for name in served_names(request.app)]
    # has_more/first_id/last_id: Anthropic's page fields (one page holds every model).
    return json_response({"object": "list", "data": data, "has_more": False,
                          "first_id": data[0]["id"] if data else None,
                          "last_id": data[-1]["id"] if data else None})


async def get_model(request: web.Request) -> web.Response:
    name = request.match_info["model_id"]
    if name not in served_names(request.app):
        raise APIError(404, f"The model {shown(name)} does not exist", param="model",
                       code="model_not_found")
    return json_response(model_card(request.app, name))


async def healthz(request: web.Request) -> web.Response:
    engine, model = request.app[ENGINE], request.app[MODEL]
    ok = engine.alive and engine.error is None
    return json_response({
        "status": "ok" if ok else "error",
        "error": engine.error,
        "model": model.model_id,
        "model_source": {"path": model.source, "origin": model.origin},
        "served_model_names": served_names(request.app),
        "adapter_version": int(engine.adapter_version),
        "blas": blas_in_use(),
        "context_length": model.context_length,
        "engine": dict(engine.stats),
        "prefix_cache": (engine.prefix_cache.counters() if engine.prefix_cache is not None
                         else {"enabled": False, "reason": "--no-prefix-cache"}),
        "sessions_open": len(request.app[SESSIONS].open),
        "requests": {"admitted": request.app[edge.ADMISSION].admitted,
                     "limit": request.app[edge.ADMISSION].limit},
        "scoring": {**request.app[SCORER].stats, "pending": request.app[SCORER].pending,
                    "method": request.app[SETTINGS].scoring.method},
        "trainer": trainer_health(request.app),
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


def trainer_health(app: web.Application) -> dict:
    trainer = app.get(TRAINER)
    if trainer is None:
        return {"enabled": False}
    return {"enabled": True, "alive": trainer.alive, "error": trainer.error,
            "queued": trainer.inbox.qsize(), "step": trainer.step, **trainer.stats,
            "quarantined": len(trainer.journal.quarantined),
            "failed_steps": trainer.journal.failed_steps, "paused": trainer.paused}


def trainer_context(settings: Settings):
    async def ctx(app: web.Application):
        if not settings.trainer.train:
            yield
            return
        loop, loaded, engine = asyncio.get_running_loop(), app[MODEL], app[ENGINE]
        with phase("made the trainer's model"):
            model = training_copy(loaded)  # main thread: see engine_context
        ref = None
        if settings.trainer.kl_coef > 0:
            ref, _ = load_base_model(settings.model)
        trainer = Trainer(settings, model, loaded.lora_config, engine, ref_model=ref,
                          vocab_size=loaded.vocab_size, tokenizer=loaded.tokenizer)
        trainer.resume()
        # The scorer hands each released turn straight to the trainer (thread-safe submit). Set
        # before anything below awaits, so the scorer's task has released nothing yet; without a
        # trainer (--no-train) released turns go nowhere and nothing holds on to them.
        app[SCORER].on_released = trainer.submit
        s = settings.scoring
        # released before a restart but not trained yet: train them now (the trainer has
        # read its journal: quarantined turns stay out, a crashed step's turns come back alone)
        for scored in released_turns(settings.records.data_dir, s.w_opd, s.w_rl,
                                     skip=trainer.trained,
                                     max_attempts=settings.trainer.max_step_attempts):
            trainer.submit(scored)
        trainer.start()
        app[TRAINER] = trainer
        yield
        app[SCORER].on_released = lambda scored: None
        await loop.run_in_executor(None, trainer.stop)

    return ctx


def scoring_context(settings: Settings):
    async def ctx(app: web.Application):
        s, loop = settings.scoring, asyncio.get_running_loop()
        engine, model = app[ENGINE], app[MODEL]
        needs_judge = s.judge and s.method != "opd"
        needs_local = ((needs_judge or s.method != "rl") and s.judge_url is None) or (
            s.method != "rl" and s.teacher_url is None)
        local = None
        if needs_local:  # a second, adapter-free copy of the base model, on its own thread
            with phase("loaded the judge's base model"):
                base, tokenizer = load_base_model(settings.model)
            local = LocalJudge(base, tokenizer, busy=lambda: engine.stats["active"] > 0,
                               yield_ms=s.judge_yield_ms)
        remote = None
        if s.judge_url or s.teacher_url:
            remote = RemoteJudge(s.judge_url or s.teacher_url, s.judge_model, s.judge_api_key,
                                 s.judge_timeout_s, s.judge_retries, teacher_url=s.teacher_url)
        judge = remote if s.judge_url else local
        teacher = remote if s.teacher_url else local
        scorer = Scorer(s, settings.records.data_dir, judge, teacher, model.tokenizer,
                        fsync=settings.records.fsync, baseline=settings.trainer.baseline)
        app[SCORER] = scorer
        task = asyncio.create_task(scorer.run())
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await loop.run_in_executor(None, scorer.close)
        if remote is not None:
            await remote.close()
        if local is not None:
            await loop.run_in_executor(None, local.close)

    return ctx


def sessions_context(settings: Settings):
    async def ctx(app: web.Application):
        loop = asyncio.get_running_loop()
        store = SessionStore(settings.records.data_dir, settings.sessions.session_idle_timeout_s,
                             fsync=settings.records.fsync, on_trainable=app[SCORER].submit,
                             on_closed=app[SCORER].session_closed,
                             max_open_sessions=settings.sessions.max_open_sessions,
                             train_sessions_matching=settings.sessions.train_sessions_matching)
        app[SESSIONS] = store
        sweeper = asyncio.create_task(sweep_idle_forever(store))
        yield
        sweeper.cancel()
        await asyncio.gather(sweeper, return_exceptions=True)
        await loop.run_in_executor(None, store.close)  # joins the writer threads

    return ctx


def engine_context(settings: Settings, loaded: LoadedModel | None):
    async def ctx(app: web.Application):
        from rlproxy.kv.prefix_cache import open_prefix_cache

        loop = asyncio.get_running_loop()
        # Load on this (main) thread: MLX objects made on a pool thread abort at exit.
        with phase("loaded the serving model"):
            model = loaded or load_serving_model(settings.model)
        prefix_cache = None
        if settings.cache.prefix_cache:  # also MLX work (a weight digest): here too
            with phase("opened the prefix cache"):
                prefix_cache = open_prefix_cache(settings.records.data_dir / "prefix_cache",
                                                 settings.cache, model.model, model.model_id)
        engine = Engine(model.model, model.tokenizer.eos_token_ids,
                        max_batch=settings.engine.max_batch,
                        prefill_step_size=settings.engine.prefill_step_size,
                        prefix_cache=prefix_cache)
        engine.start()
        app[MODEL], app[ENGINE] = model, engine
        log.info("serving %s: %s (context %d tokens, BLAS: %s)", model.model_id,
                 model.origin or model.source, model.context_length, blas_in_use())
        yield
        await loop.run_in_executor(None, engine.stop)
        if prefix_cache is not None:  # after the engine: its last stores are flushed to disk
            await loop.run_in_executor(None, prefix_cache.close)

    return ctx


def create_app(settings: Settings, loaded: LoadedModel | None = None) -> web.Application:
    """The whole server. Pass `loaded` to reuse an already loaded model (tests, benchmarks)."""
    app = web.Application(
        # the body is read before admission: a slow upload holds its connection, not a slot
        middlewares=[metrics.metrics_middleware, errors_middleware, auth_middleware,
                     edge.body_middleware, edge.admission_middleware],
        client_max_size=int(settings.server.max_request_mb * 1024 * 1024),
    )
    app.on_response_prepare.append(edge.json_errors_on_prepare)
    app[SETTINGS] = settings
    app[STARTED] = time.time()
    app[edge.ADMISSION] = edge.Admission(settings.server.max_queued_requests)
    app.cleanup_ctx.append(engine_context(settings, loaded))
    app.cleanup_ctx.append(scoring_context(settings))
    app.cleanup_ctx.append(trainer_context(settings))
    app.cleanup_ctx.append(sessions_context(settings))
    app.cleanup_ctx.append(response_store_context(settings))
    app.cleanup_ctx.append(ui_context(settings))
    app[METRICS] = metrics.make_registry(app)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", responses.create_response)
    app.router.add_get("/v1/responses/{response_id}", responses.get_response)
    app.router.add_delete("/v1/responses/{response_id}", responses.delete_response)
    app.router.add_post("/v1/messages", create_message)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model_id:.+}", get_model)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/sessions", list_sessions)
    app.router.add_get("/v1/sessions/{session_id}", get_session)
    app.router.add_post("/v1/sessions/{session_id}/end", end_session)
    app.router.add_post("/v1/feedback", feedback)
    app.router.add_get("/metrics", metrics.metrics_handler)
    app.router.add_post("/v1/adapters/{step}/serve", control.serve_adapter)
    app.router.add_post("/v1/training/pause", control.pause_training)
    app.router.add_post("/v1/training/resume", control.resume_training)
    add_ui_routes(app)  # /ui: the dashboard (ops/ui/views.py)
    add_tinker_routes(app)  # /api/v1: the Tinker training API (tinker/routes.py)
    # No catch-all route: aiohttp's router then answers 404 for an unknown path and 405 (with
    # Allow) for a known one with the wrong method, both worded by errors_middleware.
    return app
