"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages dialect.

Parses and translates the body (messages_input.py), runs the turn through turns.serve_turn like
every other dialect (session, generation, record: `api: "messages"`), and writes the answer back
as a message body or its SSE events (messages_output.py; the bytes through streams.py), pings
included while a long prompt prefills. Also reads Claude Code's own session header into the
session protocol.
"""

from __future__ import annotations

import asyncio
import re
from contextlib import aclosing

from aiohttp import web
from multidict import CIMultiDict

from rlproxy.api import hosted_tools
from rlproxy.api import messages_output as out
from rlproxy.api.edge import StreamEnded, disk_full_error, json_body, json_response, \
    max_json_depth
from rlproxy.api.messages_input import CountTokensRequest, MessagesRequest, drop_server_tools, \
    to_chat_request
from rlproxy.api.tags import parse_turn_tags
from rlproxy.api.streams import open_stream, replay
from rlproxy.api.turns import Call, Failed, Kept, drain, serve_turn
from rlproxy.appkeys import MODEL
from rlproxy.protocol import APIError
from rlproxy.records import WriteFailed
from rlproxy.serving.completions import build_prompt

PING_INTERVAL_S = 5.0  # a long prompt's prefill takes minutes here; keep the line alive


def session_headers(headers):
    """Claude Code names its session in X-Claude-Code-Session-Id (a UUID): read it as the
    session protocol's X-Session-Id, unless the client set that one itself. Its title, probe and
    sub-agent calls then share the session, and threads (sessions/store.py) tell them apart."""
    claude_code = headers.get("X-Claude-Code-Session-Id")
    if claude_code is None or "X-Session-Id" in headers:
        return headers
    merged = CIMultiDict(headers)
    merged["X-Session-Id"] = claude_code
    return merged


async def create_message(request: web.Request) -> web.StreamResponse:
    body = await json_body(request, MessagesRequest)
    if hosted_tools.dropping(request):
        hosted_tools.warn_dropped(request, body.session_id, drop_server_tools(body))
    req = to_chat_request(body, max_json_depth(request))
    tags = parse_turn_tags(session_headers(request.headers), req)
    try:
        async with serve_turn(request, req, tags, "messages") as call:
            if isinstance(call, Kept):  # a repeated X-Request-Id: the kept response again
                if not req.stream:
                    return await replay(request, call.body, None)
                return await replay(request, call.body,
                                    call.events or out.body_as_events(call.body))
            if req.stream:
                return await stream_message(call)
            return await full_message(call)
    except APIError as e:
        raise in_anthropic_words(e) from None


def in_anthropic_words(err: APIError) -> APIError:
    """A context overflow said as Anthropic says it. Claude Code matches these words: on
    "prompt is too long: N tokens > M" it compacts its history, on "input length and
    `max_tokens` exceed context limit: P + T > M" it retries with a smaller max_tokens.
    The numbers come from completions.sampling_params' message (test_messages checks both)."""
    if err.code != "context_length_exceeded":
        return err
    numbers = [int(n) for n in re.findall(r"\d+", err.message)]
    if err.param == "messages":  # "... length is {context} tokens ... resulted in {prompt} ..."
        context, prompt = numbers[:2]
        message = (f"prompt is too long: {prompt} tokens > {context} maximum (or serve a "
                   "longer window: rlproxy --context-length, RoPE scaling)")
    else:  # "... length is {context} ... requested {sum} tokens ({prompt} in the messages, {max})"
        context, _, prompt, max_tokens = numbers[:4]
        message = (f"input length and `max_tokens` exceed context limit: {prompt} + "
                   f"{max_tokens} > {context}, decrease input length or `max_tokens` and try again")
    return APIError(err.status, message, param=err.param, code=err.code)


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's length exactly as /v1/messages would template it."""
    body = await json_body(request, CountTokensRequest)
    if hosted_tools.dropping(request):  # counted as /v1/messages would template it
        drop_server_tools(body)
    req = to_chat_request(body, max_json_depth(request))
    loop = asyncio.get_running_loop()
    prompt = await loop.run_in_executor(None, build_prompt, request.app[MODEL].tokenizer, req)
    return json_response({"input_tokens": len(prompt.ids)})


def _ending(call: Call) -> tuple[str, str | None, dict]:
    """stop_reason, stop_sequence and usage of the finished (single) choice."""
    rec, text = call.gen.records[0], call.gen.texts[0]
    u = call.gen.usage()
    use = out.usage(u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"],
                    u["completion_tokens"])
    return out.stop_reason(rec.finish_reason, text.stop_sequence), text.stop_sequence, use


async def full_message(call: Call) -> web.Response:
    blocks = out.Blocks()
    for ev in await drain(call):
        for kind, value in ev.deltas:
            blocks.add(kind, value)
    stop, stop_sequence, use = _ending(call)
    body = out.message(out.message_id(), call.req.model, blocks.content, stop, stop_sequence, use)
    await call.file(body)  # on disk before the client hears of it
    return json_response(body, headers=call.headers)


async def stream_message(call: Call) -> web.StreamResponse:
    stream = await open_stream(call.request, call.headers)
    mid, sent = out.message_id(), []

    async def send(payload: bytes) -> None:
        sent.append(payload)
        await stream.send(payload)

    await send(out.message_start(mid, call.req.model, len(call.prompt.ids)))
    await stream.send(out.PING)
    blocks = out.Blocks()
    async with aclosing(out.with_pings(call.events(), PING_INTERVAL_S)) as events:
        async for ev in events:
            if ev is None:  # still prefilling (or a long silence): tell the client we are here
                await stream.send(out.PING)
                continue
            if isinstance(ev, Failed):
                return await stream.end(out.event("error", out.error_body(ev.error)))
            for kind, value in ev.deltas:
                for name, data in blocks.add(kind, value):
                    await send(out.event(name, data))
    for name, data in blocks.close():
        await send(out.event(name, data))
    stop, stop_sequence, use = _ending(call)
    body = out.message(mid, call.req.model, blocks.content, stop, stop_sequence, use)
    try:
        await call.file(body, sent)  # journaled before the client hears the message is done
    except WriteFailed as e:  # not kept: an error event instead of the message's end
        error = out.event("error", out.error_body(disk_full_error(e)))
        raise StreamEnded(await stream.end(error)) from e
    for payload in out.message_end(stop, stop_sequence, use):
        await send(payload)
    return await stream.end()
