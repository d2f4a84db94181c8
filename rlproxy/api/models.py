"""GET /v1/models and /v1/models/{id}: the served model names, in a shape both SDKs parse; the
personal adapters made so far are listed as `MODEL:NAME` (pipeline.py `Adapters`)."""

from __future__ import annotations

from datetime import datetime, timezone

from aiohttp import web

from rlproxy import paths
from rlproxy.api.edge import json_response
from rlproxy.api.turns import model_name
from rlproxy.appkeys import ADAPTERS, MODEL, SETTINGS, STARTED
from rlproxy.ops.health import served_names
from rlproxy.paths import kept_checkpoint
from rlproxy.protocol import APIError, shown


def model_card(app: web.Application, name: str) -> dict:
    """One served model in a shape both SDKs parse: OpenAI's fields, then Anthropic's, then
    the window as OpenRouter-style listings say it (`context_length`: Hermes Agent reads it
    first, and refuses to start below 64,000 tokens), and, with --max-completion-tokens, that
    cap (`max_completion_tokens`: what `rlproxy connect` sizes an agent's budget to)."""
    created = int(app[STARTED])
    context = app[MODEL].context_length
    card = {"id": name, "object": "model", "created": created, "owned_by": "rlproxy",
            "type": "model", "display_name": name,
            "created_at": datetime.fromtimestamp(created, timezone.utc).strftime(
                "%Y-%m-%dT%H:%M:%SZ"),
            "max_input_tokens": context, "context_length": context}
    if (cap := app[SETTINGS].engine.max_completion_tokens) is not None:
        card["max_completion_tokens"] = cap
    return card


async def list_models(request: web.Request) -> web.Response:
    app = request.app
    names = served_names(app)
    adapters = sorted({*app[ADAPTERS].by_name, *app[ADAPTERS].resting,
                       *app[ADAPTERS].stopping}) \
        if ADAPTERS in app and names else []
    data = [model_card(app, name) for name in names + [f"{names[0]}:{a}" for a in adapters]]
    # has_more/first_id/last_id: Anthropic's page fields (one page holds every model).
    return json_response({"object": "list", "data": data, "has_more": False,
                          "first_id": data[0]["id"] if data else None,
                          "last_id": data[-1]["id"] if data else None})


async def get_model(request: web.Request) -> web.Response:
    """A served name; `NAME:ADAPTER` for a personal adapter that exists, or that a request
    would make now; either with `@STEP` while that adapter's checkpoint STEP is kept (api/
    turns.py serves them)."""
    app, model = request.app, request.match_info["model_id"]
    served = served_names(app)
    try:
        name = model_name(model, served)
    except APIError:  # a malformed adapter name
        name = None
    known = name is not None and name.base in served and (
        name.adapter is None or adapter_known(app, name.adapter))
    if known and name.step is not None:
        folder = app[SETTINGS].records.data_dir
        if name.adapter is not None:
            folder = folder / paths.ADAPTERS / name.adapter
        known = kept_checkpoint(folder / paths.CHECKPOINTS, name.step) is not None
    if not known:
        raise APIError(404, f"The model {shown(model)} does not exist", param="model",
                       code="model_not_found")
    return json_response(model_card(app, model))


def adapter_known(app: web.Application, adapter: str) -> bool:
    adapters = app.get(ADAPTERS)
    if adapters is None:
        return False
    s = app[SETTINGS].sessions
    known = {*adapters.by_name, *adapters.making, *adapters.failed, *adapters.resting,
             *adapters.stopping}  # as `Adapters.get` counts them against the limit
    return adapter in known and adapter not in adapters.failed or (
        s.adapter_names == "open" and len(known) < s.max_adapters)
