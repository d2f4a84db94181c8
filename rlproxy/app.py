"""The composition root: `create_app(settings)` builds the whole server and names every route.

Three long-lived parts, each set up and torn down in one cleanup context and kept under the
typed keys of appkeys.py: the model and the engine thread (`engine_context`, here), the learning
path store -> scorer -> trainer (pipeline.py), and the stored Responses and the dashboard's
record index. Everything else is a front door in api/ (one module per API dialect, each parsing
its body at the edge and handing one internal request to api/turns.py), the Tinker API
(tinker/), or the dashboard (ops/ui/). Serve the app with `server.AppRunner` (or `server.run_app`, api/server.py)
so aiohttp's own parse errors are JSON too.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from rlproxy import paths
from rlproxy.api import admin, edge, hosted_tools, models, responses, sessions
from rlproxy.api.chat import chat_completions
from rlproxy.api.edge import json_response
from rlproxy.api.feedback import feedback
from rlproxy.api.messages import count_tokens, create_message
from rlproxy.api.middlewares import auth_middleware, errors_middleware
from rlproxy.api.response_store import response_store_context
from rlproxy.appkeys import ADMISSION, DRAINING, ENGINE, METRICS, MODEL, SAVED, SETTINGS, STARTED
from rlproxy.kv.prefix_cache import open_prefix_cache
from rlproxy.lru import LRU
from rlproxy.ops import metrics
from rlproxy.ops.health import health
from rlproxy.ops.progress import phase
from rlproxy.ops.ranks import launched_rank
from rlproxy.ops.ui.views import add_ui_routes, ui_context
from rlproxy.pipeline import pipeline_context, ranks_context
from rlproxy.remote.sampler import TinkerSampler
from rlproxy.remote.service import base_model_name
from rlproxy.serving.blas import blas_in_use
from rlproxy.serving.engine import Engine
from rlproxy.serving.saved import SavedAdapters
from rlproxy.serving.model import LoadedModel, load_serving_model, load_tokenizer_only
from rlproxy.settings import Settings
from rlproxy.tinker.routes import add_tinker_routes

log = logging.getLogger("rlproxy.server")


async def healthz(request: web.Request) -> web.Response:
    body, status = health(request.app, blas_in_use())
    return json_response(body, status=status)


def engine_context(settings: Settings, loaded: LoadedModel | None):
    if settings.remote.sampler == "tinker":
        return tinker_sampler_context(settings, loaded)

    async def ctx(app: web.Application):
        loop = asyncio.get_running_loop()
        # Load on this (main) thread: MLX objects made on a pool thread abort at exit.
        with phase("loaded the serving model"):
            model = loaded or load_serving_model(settings.model,
                                                 lora_seed=settings.trainer.train_seed)
        prefix_cache = None
        if settings.cache.prefix_cache:  # also MLX work (a weight digest): here too
            with phase("opened the prefix cache"):
                prefix_cache = open_prefix_cache(settings.records.data_dir / paths.PREFIX_CACHE,
                                                 settings.cache, model.model, model.kv_identity)
        engine = Engine(model.model, model.tokenizer.eos_token_ids,
                        max_batch=settings.engine.max_batch,
                        prefill_step_size=settings.engine.prefill_step_size,
                        prefix_cache=prefix_cache, merge=settings.engine.merge_lora,
                        speculate=settings.engine.speculate)
        if settings.engine.speculate == "auto" and engine.speculate == "off":
            log.info("speculation off: a quantized base on the CPU decodes slower with drafts "
                     "(--speculate ngram turns it on)")
        engine.start()
        app[MODEL], app[ENGINE], app[SAVED] = model, engine, SavedAdapters(model, engine)
        log.info("serving %s: %s (context %d tokens, BLAS: %s)", model.model_id,
                 model.origin or model.source, model.context_length, blas_in_use())
        yield
        await app[SAVED].aclose()
        await loop.run_in_executor(None, engine.stop)
        if prefix_cache is not None:  # after the engine: its last stores are flushed to disk
            await loop.run_in_executor(None, prefix_cache.close)

    return ctx


def tinker_sampler_context(settings: Settings, loaded: LoadedModel | None):
    """--sampler tinker: the tokenizer of --model and, in the engine's place, a Tinker
    SamplingClient (remote/sampler.py). No weights, so no prefix cache either."""
    async def ctx(app: web.Application):
        with phase("loaded the tokenizer"):
            model = loaded or load_tokenizer_only(settings.model)
        sampler = TinkerSampler(settings.remote, base_model_name(settings, model),
                                model.tokenizer.eos_token_ids,
                                max_batch=settings.engine.max_batch)
        with phase("asked the Tinker service for its models"):
            context = sampler.check()  # a wrong key or base model: a start-up error
        if context:
            model.context_length = min(model.context_length, int(context))
        sampler.start()
        app[MODEL], app[ENGINE] = model, sampler
        log.info("serving %s through the Tinker service at %s (base model %s, context %d "
                 "tokens; no local weights, no prefix cache)", model.model_id, sampler.url,
                 sampler.base_model, model.context_length)
        yield
        sampler.stop()

    return ctx


def create_app(settings: Settings, loaded: LoadedModel | None = None) -> web.Application:
    """The whole server. Pass `loaded` to reuse an already loaded model (tests, benchmarks)."""
    app = web.Application(
        # the body is read before admission: a slow upload holds its connection, not a slot
        middlewares=[edge.metrics_middleware, errors_middleware, auth_middleware,
                     edge.body_middleware, edge.admission_middleware],
        client_max_size=int(settings.server.max_request_mb * 1024 * 1024),
    )
    app.on_response_prepare.append(edge.json_errors_on_prepare)
    app[SETTINGS] = settings
    app[STARTED] = time.time()
    app[ADMISSION] = edge.Admission(settings.server.max_queued_requests)
    app[DRAINING] = asyncio.Event()  # set by the SIGTERM drain (api/server.py)
    app[hosted_tools.WARNED] = LRU(hosted_tools.MAX_CLIENTS)
    if launched_rank() is not None:  # mlx.launch: the other ranks first, last to go
        app.cleanup_ctx.append(ranks_context(settings))
    app.cleanup_ctx.append(engine_context(settings, loaded))
    app.cleanup_ctx.append(pipeline_context(settings))  # store -> scorer -> trainer
    app.cleanup_ctx.append(response_store_context(settings))
    app.cleanup_ctx.append(ui_context(settings))
    app[METRICS] = metrics.make_registry(app)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", responses.create_response)
    app.router.add_get("/v1/responses/{response_id}", responses.get_response)
    app.router.add_delete("/v1/responses/{response_id}", responses.delete_response)
    app.router.add_post("/v1/messages", create_message)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/v1/models", models.list_models)
    app.router.add_get("/v1/models/{model_id:.+}", models.get_model)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/sessions", sessions.list_sessions)
    app.router.add_get("/v1/sessions/{session_id}", sessions.get_session)
    app.router.add_post("/v1/sessions/{session_id}/end", sessions.end_session)
    app.router.add_post("/v1/feedback", feedback)
    app.router.add_get("/metrics", metrics.metrics_handler)
    admin.add_routes(app)  # the operator's actions: serve a checkpoint, pause, resume
    add_ui_routes(app)  # /ui: the dashboard (ops/ui/views.py)
    add_tinker_routes(app)  # /api/v1: the Tinker training API (tinker/routes.py)
    # No catch-all route: aiohttp's router then answers 404 for an unknown path and 405 (with
    # Allow) for a known one with the wrong method, both worded by errors_middleware.
    return app
