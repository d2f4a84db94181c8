"""GET /v1/models and /v1/models/{id}: the served model names, in a shape both SDKs parse."""

from __future__ import annotations

from datetime import datetime, timezone

from aiohttp import web

from rlproxy import paths
from rlproxy.api.edge import json_response
from rlproxy.api.turns import STEP_SUFFIX
from rlproxy.appkeys import MODEL, SETTINGS, STARTED
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
    data = [model_card(request.app, name) for name in served_names(request.app)]
    # has_more/first_id/last_id: Anthropic's page fields (one page holds every model).
    return json_response({"object": "list", "data": data, "has_more": False,
                          "first_id": data[0]["id"] if data else None,
                          "last_id": data[-1]["id"] if data else None})


async def get_model(request: web.Request) -> web.Response:
    """A served name, or `NAME@STEP` while checkpoint STEP is kept (api/turns.py serves it)."""
    app, name = request.app, request.match_info["model_id"]
    step = STEP_SUFFIX.fullmatch(name)
    known = name in served_names(app) if step is None else (
        step[1] in served_names(app) and kept_checkpoint(
            app[SETTINGS].records.data_dir / paths.CHECKPOINTS, int(step[2])) is not None)
    if not known:
        raise APIError(404, f"The model {shown(name)} does not exist", param="model",
                       code="model_not_found")
    return json_response(model_card(app, name))
