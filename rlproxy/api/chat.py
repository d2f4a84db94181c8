"""POST /v1/chat/completions: the Chat Completions dialect.

Owns only this API's shapes: parsing the body (protocol.py), the `chat.completion` body, the
`chat.completion.chunk` SSE stream and replaying a kept response. Everything else -- session,
generation, the turn's record -- happens in turns.py, the same for every dialect.
"""

from __future__ import annotations

import functools

import orjson
from aiohttp import web

from rlproxy import protocol
from rlproxy.api.edge import json_body, json_response
from rlproxy.api.tags import parse_turn_tags
from rlproxy.api.turns import Call, drain, generation_error, open_sse, replay_kept, serve_turn
from rlproxy.serving.completions import EngineFailure, Interrupted


async def chat_completions(request: web.Request) -> web.StreamResponse:
    req = await json_body(request, protocol.ChatRequest)
    tags = parse_turn_tags(request.headers, req)
    write = stream_completion if req.stream else full_completion
    return await serve_turn(request, req, tags, "chat", write, replay)


def final_body(call: Call, cid: str, events) -> dict:
    req, gen = call.req, call.gen
    logprobs: dict[int, list] = {i: [] for i in range(req.n)}
    for ev in events:
        logprobs[ev.index] += ev.logprobs
    choices = []
    for r in gen.records:
        c = protocol.choice(r.index, r.text, r.tool_calls or None, r.finish_reason,
                            {"content": logprobs[r.index], "refusal": None} if req.logprobs
                            else None)
        if r.reasoning:  # the model's <think> text, where vLLM puts it
            c["message"]["reasoning_content"] = r.reasoning
        choices.append(c)
    return protocol.chat_completion(cid, int(gen.started), req.model, choices, gen.usage())


async def full_completion(call: Call):
    body = final_body(call, protocol.completion_id(), await drain(call))
    call.file_turn(body)
    return json_response(body, headers=call.headers), {"body": body, "events": None}


def sse(data) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def chunk_delta(kind: str, value, tool_index: int) -> dict | None:
    """One ChoiceText delta as a chunk's `delta`; None for kinds this dialect does not show."""
    if kind == "content":
        return {"content": value}
    if kind == "reasoning":
        return {"reasoning_content": value}
    if kind == "tool_call":
        return {"tool_calls": [{"index": tool_index, **value}]}
    return None


async def stream_completion(call: Call):
    req, gen = call.req, call.gen
    resp = await open_sse(call.request, call.headers)
    cid, created = protocol.completion_id(), int(gen.started)
    resp.on_disk_full = lambda err: resp.write(sse(err.body()) + b"data: [DONE]\n\n")
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
    events = []
    finishes: list[dict] = []  # held until the turn is journaled
    try:
        async for ev in call.events():
            events.append(ev)
            lp = {"content": ev.logprobs, "refusal": None} if req.logprobs else None
            for kind, value in ev.deltas:
                delta = chunk_delta(kind, value, tool_counts[ev.index])
                if delta is None:
                    continue
                tool_counts[ev.index] += kind == "tool_call"
                await send([protocol.delta_choice(ev.index, delta, None, lp)])
                lp = None  # a token's logprobs ride on its first delta only
            if lp and ev.logprobs:  # text held back (maybe a stop string): logprobs still go
                await send([protocol.delta_choice(ev.index, {}, None, lp)])
            if ev.finish_reason is not None:
                finishes.append(protocol.delta_choice(ev.index, {}, ev.finish_reason))
    except (EngineFailure, Interrupted) as e:  # an error chunk, as OpenAI ends a failed stream
        err = generation_error(e)
        await resp.write(sse(err.body()) + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp, None
    body = final_body(call, cid, events)
    call.file_turn(body)
    for f in finishes:
        await send([f])
    if include_usage:
        await send([], usage=gen.usage())
    sent.append(b"data: [DONE]\n\n")
    await resp.write(sent[-1])
    await resp.write_eof()
    return resp, {"body": body, "events": sent}


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


replay = functools.partial(replay_kept, body_as_events=body_as_chunks)
