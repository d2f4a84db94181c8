"""POST /v1/chat/completions: the Chat Completions dialect.

Owns only this API's shapes: parsing the body (protocol.py), the `chat.completion` body, the
`chat.completion.chunk` SSE stream (`data: [DONE]` last, an error chunk before it when the turn
failed) and a kept response sent again. Everything else -- session, generation, the turn's
record -- happens in turns.py, the same for every dialect; the stream's bytes go through
streams.py.
"""

from __future__ import annotations

import orjson
from aiohttp import web

from rlproxy import protocol
from rlproxy.api.edge import StreamEnded, disk_full_error, json_body, json_response
from rlproxy.api.streams import open_stream, replay
from rlproxy.api.tags import parse_turn_tags
from rlproxy.api.turns import Call, Failed, Kept, drain, serve_turn
from rlproxy.records import WriteFailed

DONE = b"data: [DONE]\n\n"


async def chat_completions(request: web.Request) -> web.StreamResponse:
    req = await json_body(request, protocol.ChatRequest)
    tags = parse_turn_tags(request.headers, req)
    async with serve_turn(request, req, tags, "chat") as call:
        if isinstance(call, Kept):  # a repeated X-Request-Id: the kept response again
            if not req.stream:
                return await replay(request, call.body, None)
            return await replay(request, call.body, call.events or body_as_chunks(call.body))
        if req.stream:
            return await stream_completion(call)
        return await full_completion(call)


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


async def full_completion(call: Call) -> web.Response:
    body = final_body(call, protocol.completion_id(), await drain(call))
    await call.file(body)  # on disk before the client hears of it
    return json_response(body, headers=call.headers)


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


async def stream_completion(call: Call) -> web.StreamResponse:
    req, gen = call.req, call.gen
    stream = await open_stream(call.request, call.headers)
    cid, created = protocol.completion_id(), int(gen.started)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    sent: list[bytes] = []

    async def send(choices: list[dict], usage=None) -> None:
        data = protocol.chunk(cid, created, req.model, choices)
        if include_usage:  # OpenAI: "usage": null on every chunk but the last
            data["usage"] = usage
        payload = sse(data)
        sent.append(payload)
        await stream.send(payload)

    for i in range(req.n):
        await send([protocol.delta_choice(i, {"role": "assistant", "content": ""})])
    tool_counts = [0] * req.n
    events = []
    finishes: list[dict] = []  # held until the turn is journaled
    async for ev in call.events():
        if isinstance(ev, Failed):  # an error chunk, as OpenAI ends a failed stream
            return await stream.end(sse(ev.error.body()) + DONE)
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
    body = final_body(call, cid, events)
    try:
        await call.file(body, sent)  # the finish chunks go out once the turn is on disk
    except WriteFailed as e:  # it was not kept: an error chunk instead of the finish
        raise StreamEnded(await stream.end(sse(disk_full_error(e).body()) + DONE)) from e
    for f in finishes:
        await send([f])
    if include_usage:
        await send([], usage=gen.usage())
    sent.append(DONE)
    return await stream.end(DONE)


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
    out.append(DONE)
    return out
