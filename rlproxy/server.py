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

import orjson
from aiohttp import web

from rlproxy import protocol
from rlproxy.blas import blas_in_use
from rlproxy.completions import (
    EngineFailure, Generation, build_prompt, sampling_params,
)
from rlproxy.engine import Engine
from rlproxy.model import LoadedModel, load_serving_model
from rlproxy.protocol import APIError
from rlproxy.settings import Settings

log = logging.getLogger("rlproxy.server")

SETTINGS = web.AppKey("settings", Settings)
MODEL = web.AppKey("model", LoadedModel)
ENGINE = web.AppKey("engine", Engine)
STARTED = web.AppKey("started", float)

OPEN_PATHS = {"/healthz"}  # no API key needed: nothing secret, and load balancers probe it


def json_response(data, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


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


def served_names(app: web.Application) -> list[str]:
    return app[SETTINGS].server.served_model_name or [app[MODEL].model_id]


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
        "uptime_s": round(time.time() - request.app[STARTED], 1),
    }, status=200 if ok else 503)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    app = request.app
    settings, model, engine = app[SETTINGS], app[MODEL], app[ENGINE]
    req = protocol.parse_chat_request(await request.read())
    if settings.server.strict_model_names and req.model not in served_names(app):
        raise APIError(404, f"The model '{req.model}' does not exist", param="model",
                       code="model_not_found")
    if engine.error is not None or not engine.alive:
        raise APIError(503, f"the engine is not running: {engine.error}", type="server_error")
    loop = asyncio.get_running_loop()
    # Templating a 15k-token agent prompt takes tens of ms: keep it off the event loop.
    prompt = await loop.run_in_executor(None, build_prompt, model.tokenizer, req)
    params = sampling_params(req, len(prompt.ids), model.context_length,
                             settings.engine.default_max_tokens)
    gen = Generation(engine, model.tokenizer, prompt, params, req)
    try:
        if req.stream:
            return await stream_completion(request, req, gen)
        return await full_completion(request, req, gen)
    finally:
        gen.cancel()  # no-op for finished choices; stops generation for a gone client


async def full_completion(request: web.Request, req, gen: Generation) -> web.Response:
    logprobs: dict[int, list] = {i: [] for i in range(req.n)}
    try:
        async for ev in gen.events():
            logprobs[ev.index] += ev.logprobs
            if request.transport is None or request.transport.is_closing():
                raise ConnectionResetError("client went away")
    except EngineFailure as e:
        raise APIError(500, f"generation failed: {e}", type="server_error") from None
    choices = [
        protocol.choice(r.index, r.text, r.tool_calls or None, r.finish_reason,
                        {"content": logprobs[r.index], "refusal": None} if req.logprobs else None)
        for r in gen.records
    ]
    body = protocol.chat_completion(protocol.completion_id(), int(gen.started), req.model,
                                    choices, gen.usage())
    return json_response(body)


async def stream_completion(request: web.Request, req, gen: Generation) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    cid, created = protocol.completion_id(), int(gen.started)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    usage_field = None  # OpenAI: with include_usage every chunk carries "usage": null but the last

    async def send(choices: list[dict]) -> None:
        data = protocol.chunk(cid, created, req.model, choices)
        if include_usage:
            data["usage"] = usage_field
        await resp.write(b"data: " + orjson.dumps(data) + b"\n\n")

    for i in range(req.n):
        await send([protocol.delta_choice(i, {"role": "assistant", "content": ""})])
    tool_counts = [0] * req.n
    try:
        async for ev in gen.events():
            for kind, value in ev.deltas:
                lp = {"content": ev.logprobs, "refusal": None} if req.logprobs else None
                if kind == "content":
                    await send([protocol.delta_choice(ev.index, {"content": value}, None, lp)])
                else:
                    delta = {"tool_calls": [{"index": tool_counts[ev.index], **value}]}
                    tool_counts[ev.index] += 1
                    await send([protocol.delta_choice(ev.index, delta, None, lp)])
                ev.logprobs = []  # attach a token's logprobs to its first delta only
            if ev.logprobs and req.logprobs:  # held-back text: logprobs ride on an empty delta
                await send([protocol.delta_choice(ev.index, {}, None,
                                                  {"content": ev.logprobs, "refusal": None})])
            if ev.finish_reason is not None:
                await send([protocol.delta_choice(ev.index, {}, ev.finish_reason)])
    except EngineFailure as e:
        err = APIError(500, f"generation failed: {e}", type="server_error")
        await resp.write(b"data: " + orjson.dumps(err.body()) + b"\n\n")
    else:
        if include_usage:
            usage_field = gen.usage()
            await send([])
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def not_found(request: web.Request) -> web.Response:
    # Ollama-style probes (/api/show, /api/v1/models) and anything else: a clean JSON 404.
    raise APIError(404, f"no route for {request.method} {request.path}; rlproxy speaks the "
                   "OpenAI API under /v1", code="not_found")


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
    app.cleanup_ctx.append(engine_context(settings, loaded))
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model_id:.+}", get_model)
    app.router.add_get("/healthz", healthz)
    app.router.add_route("*", "/{tail:.*}", not_found)
    return app
