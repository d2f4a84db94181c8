"""POST /v1/chat/completions: one request from parse to response, filed into its session.

Order of work: parse the body and the session tags (4xx on bad input) -> replay a stored
response for a repeated X-Request-Id -> resolve the session (which links the session's previous
turn to its next state) -> template and generate -> journal the finished turn -> only then send
the response's last bytes. A request that opted out (X-RL-Opt-Out) is served and never filed.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import asdict

import orjson
from aiohttp import web

from rlproxy import protocol
from rlproxy.appkeys import ENGINE, MODEL, SESSIONS, SETTINGS
from rlproxy.completions import EngineFailure, Generation, build_prompt, sampling_params
from rlproxy.protocol import APIError
from rlproxy.sessions import Turn, parse_turn_tags

LOGPROB_DEFINITION = ("log_softmax(logits) at temperature 1, after logit_bias and penalties, "
                      "before temperature and top_p")


def json_response(data, status: int = 200, headers=None) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json",
                        headers=headers)


def served_names(app: web.Application) -> list[str]:
    return app[SETTINGS].server.served_model_name or [app[MODEL].model_id]


async def chat_completions(request: web.Request) -> web.StreamResponse:
    app = request.app
    settings, model, engine, store = app[SETTINGS], app[MODEL], app[ENGINE], app[SESSIONS]
    req = protocol.parse_chat_request(await request.read())
    tags = parse_turn_tags(request.headers, req)
    if settings.server.strict_model_names and req.model not in served_names(app):
        raise APIError(404, f"The model '{req.model}' does not exist", param="model",
                       code="model_not_found")
    if tags.request_id and not tags.opt_out:
        stored = store.stored_response(tags.request_id)
        if isinstance(stored, asyncio.Future):  # the first attempt is still running
            stored = await asyncio.shield(stored)
        if stored is not None:
            return await replay(request, req, stored)
    if engine.error is not None or not engine.alive:
        raise APIError(503, f"the engine is not running: {engine.error}", type="server_error")

    loop = asyncio.get_running_loop()
    # Templating a 15k-token agent prompt takes tens of ms: keep it off the event loop.
    prompt = await loop.run_in_executor(None, build_prompt, model.tokenizer, req)
    params = sampling_params(req, len(prompt.ids), model.context_length,
                             settings.engine.default_max_tokens, model.vocab_size)
    session = None
    if not tags.opt_out:
        session = store.resolve(tags, prompt.messages)
    waiter = None
    if tags.request_id and not tags.opt_out:
        waiter = loop.create_future()
        store.store_response(tags.request_id, waiter)
    headers = {"X-Session-Id": session.id} if session else {}

    def file_turn(gen: Generation) -> None:
        """Journal the finished turn; called before the response's last bytes are sent."""
        if session is None:
            return
        turn = Turn(
            uid=uuid.uuid4().hex, session_id=session.id, index=store.next_index(session),
            turn_type=tags.turn_type, requested_model=req.model, messages=prompt.messages,
            tools=prompt.tools, prompt_ids=prompt.ids,
            choices=[asdict(r) for r in gen.records],
            sampling={"temperature": req.temperature, "top_p": req.top_p,
                      "max_tokens": params[0].max_tokens, "seeds": [p.seed for p in params],
                      "logit_bias": req.logit_bias, "presence_penalty": req.presence_penalty,
                      "frequency_penalty": req.frequency_penalty,
                      "logprobs_are": LOGPROB_DEFINITION},
            timings={"received": gen.started,
                     "first_token_s": round((gen.first_token_at or gen.started) - gen.started, 4),
                     "total_s": round(time.time() - gen.started, 4)},
            turn_id=tags.turn_id, step_index=tags.step_index, request_id=tags.request_id,
        )
        store.complete(session, turn, tags.session_done)
        headers["X-Turn-Uid"] = turn.uid

    gen = Generation(engine, model.tokenizer, prompt, params, req)
    stored = None
    try:
        if req.stream:
            resp, stored = await stream_completion(request, req, gen, file_turn, headers)
        else:
            resp, stored = await full_completion(request, req, gen, file_turn, headers)
        return resp
    finally:
        gen.cancel()  # no-op for finished choices; stops generation for a gone client
        if waiter is not None:
            if stored is None:  # failed: a retry must generate anew
                store.forget_response(tags.request_id)
            else:
                store.store_response(tags.request_id, stored)
            waiter.set_result(stored)


def final_body(req, gen: Generation, cid: str, logprobs: dict[int, list]) -> dict:
    choices = [
        protocol.choice(r.index, r.text, r.tool_calls or None, r.finish_reason,
                        {"content": logprobs[r.index], "refusal": None} if req.logprobs else None)
        for r in gen.records
    ]
    return protocol.chat_completion(cid, int(gen.started), req.model, choices, gen.usage())


async def full_completion(request, req, gen: Generation, file_turn, headers):
    logprobs: dict[int, list] = {i: [] for i in range(req.n)}
    try:
        async for ev in gen.events():
            logprobs[ev.index] += ev.logprobs
            if request.transport is None or request.transport.is_closing():
                raise ConnectionResetError("client went away")
    except EngineFailure as e:
        raise APIError(500, f"generation failed: {e}", type="server_error") from None
    body = final_body(req, gen, protocol.completion_id(), logprobs)
    file_turn(gen)
    return json_response(body, headers=headers), {"body": body, "chunks": None}


def sse(data) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


async def stream_completion(request, req, gen: Generation, file_turn, headers):
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                       **headers})
    await resp.prepare(request)
    cid, created = protocol.completion_id(), int(gen.started)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    sent: list[bytes] = []

    async def send(choices: list[dict], usage=None) -> None:
        data = protocol.chunk(cid, created, req.model, choices)
        if include_usage:  # OpenAI: "usage": null on every chunk but the last
            data["usage"] = usage
        payload = sse(data)
        sent.append(payload)
        await resp.write(payload)

    for i in range(req.n):
        await send([protocol.delta_choice(i, {"role": "assistant", "content": ""})])
    tool_counts = [0] * req.n
    logprobs: dict[int, list] = {i: [] for i in range(req.n)}
    finishes: list[dict] = []  # held until the turn is journaled
    try:
        async for ev in gen.events():
            logprobs[ev.index] += ev.logprobs
            lp = {"content": ev.logprobs, "refusal": None} if req.logprobs else None
            for kind, value in ev.deltas:
                if kind == "content":
                    delta = {"content": value}
                else:
                    delta = {"tool_calls": [{"index": tool_counts[ev.index], **value}]}
                    tool_counts[ev.index] += 1
                await send([protocol.delta_choice(ev.index, delta, None, lp)])
                lp = None  # a token's logprobs ride on its first delta only
            if lp and ev.logprobs:  # text held back (maybe a stop string): logprobs still go
                await send([protocol.delta_choice(ev.index, {}, None, lp)])
            if ev.finish_reason is not None:
                finishes.append(protocol.delta_choice(ev.index, {}, ev.finish_reason))
    except EngineFailure as e:
        err = APIError(500, f"generation failed: {e}", type="server_error")
        await resp.write(sse(err.body()) + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp, None
    body = final_body(req, gen, cid, logprobs)
    file_turn(gen)
    for f in finishes:
        await send([f])
    if include_usage:
        await send([], usage=gen.usage())
    sent.append(b"data: [DONE]\n\n")
    await resp.write(sent[-1])
    await resp.write_eof()
    return resp, {"body": body, "chunks": sent}


async def replay(request, req, stored: dict) -> web.StreamResponse:
    """A repeated X-Request-Id: the stored response again, nothing generated or recorded."""
    headers = {"X-Idempotent-Replay": "true"}
    if not req.stream:
        return json_response(stored["body"], headers=headers)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache", **headers})
    await resp.prepare(request)
    chunks = stored["chunks"] or body_as_chunks(stored["body"])
    for payload in chunks:
        await resp.write(payload)
    await resp.write_eof()
    return resp


def body_as_chunks(body: dict) -> list[bytes]:
    """A stored non-streamed response, re-sent to a streaming retry."""
    out = []
    for c in body["choices"]:
        m = c["message"]
        delta = {"role": "assistant", "content": m["content"] or ""}
        if m.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **tc} for i, tc in enumerate(m["tool_calls"])]
        out.append(sse(protocol.chunk(body["id"], body["created"], body["model"],
                                      [protocol.delta_choice(c["index"], delta, None,
                                                             c["logprobs"])])))
        out.append(sse(protocol.chunk(body["id"], body["created"], body["model"],
                                      [protocol.delta_choice(c["index"], {},
                                                             c["finish_reason"])])))
    out.append(b"data: [DONE]\n\n")
    return out
