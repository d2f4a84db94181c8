"""POST/GET/DELETE /v1/responses: the OpenAI Responses dialect (Codex CLI, openai-agents).

Owns this API's output: the Response object (`message` items with `output_text` parts,
`function_call` items, a `reasoning` item for the model's <think> text, `usage`), its SSE event
sequence (`response.created` ... `response.completed`, each with a `sequence_number`), and the
`store` / `previous_response_id` chain. Parsing and the translation to the internal chat request
live in responses_input.py; the turn itself (session, generation, record) in turns.py, the same
as for every dialect. A `previous_response_id` chain is one session and one thread: the follow-up
carries the stored response's session id and thread as its own.
"""

from __future__ import annotations

import asyncio
import secrets

import orjson
from aiohttp import web

from rlproxy.api import hosted_tools, response_store
from rlproxy.api.edge import StreamEnded, disk_full_error, json_body, json_response, \
    max_json_depth
from rlproxy.api.responses_input import ResponsesRequest, drop_hosted_tools, input_messages, \
    to_chat_request, tool_namespaces
from rlproxy.api.tags import parse_turn_tags
from rlproxy.api.streams import SseStream, open_stream, replay
from rlproxy.api.turns import Call, Failed, Kept, drain, serve_turn
from rlproxy.appkeys import RESPONSES
from rlproxy.protocol import APIError, shown
from rlproxy.records import WriteFailed
from rlproxy.serving.completions import ChoiceEvent, ChoiceRecord


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


async def create_response(request: web.Request) -> web.StreamResponse:
    r = await json_body(request, ResponsesRequest)
    if hosted_tools.dropping(request):  # before anything reads r.tools: the echo too
        hosted_tools.warn_dropped(request, r.session_id, drop_hosted_tools(r))
    store = request.app[RESPONSES]
    prev = None
    if r.previous_response_id is not None:
        prev = await asyncio.to_thread(response_store.find, store, r.previous_response_id)
        if prev is None:
            raise APIError(400, f"Previous response with id {shown(r.previous_response_id)} "
                           "not found (never stored, deleted, or evicted; store defaults to "
                           "true)",
                           param="previous_response_id", code="previous_response_not_found")
    conversation = input_messages(r, prev["conversation"] if prev else [])
    req = to_chat_request(r, conversation, max_json_depth(request))
    tags = parse_turn_tags(request.headers, req)
    if prev is not None and tags.session_id is None:
        tags.session_id = prev["session_id"]  # the chain is the session, no prefix guessing
    rid = new_id("resp")
    async with serve_turn(request, req, tags, "responses",
                          thread_hint=prev["thread"] if prev else None) as call:
        if isinstance(call, Kept):  # a repeated X-Request-Id: the kept response again
            if not r.stream:
                return await replay(request, call.body, None)
            return await replay(request, call.body, call.events or body_as_events(call.body))
        if r.stream:
            return await stream_response(call, r, rid, conversation)
        return await full_response(call, r, rid, conversation)


async def get_response(request: web.Request) -> web.Response:
    entry = await asyncio.to_thread(response_store.find, request.app[RESPONSES],
                                    request.match_info["response_id"])
    if entry is None:
        raise not_found(request.match_info["response_id"])
    return json_response(entry["response"])


async def delete_response(request: web.Request) -> web.Response:
    rid = request.match_info["response_id"]
    if not await asyncio.to_thread(response_store.forget, request.app[RESPONSES], rid):
        raise not_found(rid)
    return json_response({"id": rid, "object": "response.deleted", "deleted": True})


def not_found(rid: str) -> APIError:
    return APIError(404, f"No response found with id {shown(rid)}.", param="response_id",
                    code="response_not_found")


# ---- the Response object ----

def response_body(r: ResponsesRequest, rid: str, created: int, status: str, output: list[dict],
                  usage: dict | None = None, error: dict | None = None) -> dict:
    return {
        "id": rid, "object": "response", "created_at": created, "status": status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
        "model": r.model, "output": output, "parallel_tool_calls": r.parallel_tool_calls,
        "previous_response_id": r.previous_response_id, "reasoning": r.reasoning,
        "store": r.store, "temperature": r.temperature, "text": {"format": {"type": "text"}},
        "tool_choice": r.tool_choice or "auto", "tools": r.tools or [], "top_p": r.top_p,
        "truncation": "disabled", "usage": usage, "user": r.user, "metadata": r.metadata or {},
    }


def responses_usage(chat_usage: dict) -> dict:
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"],
                "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text)]}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(call: dict, status: str, namespaces: dict[str, str]) -> dict:
    name = call["function"]["name"]
    item = {"id": new_id("fc"), "type": "function_call", "status": status,
            "call_id": call["id"], "name": name, "arguments": call["function"]["arguments"]}
    if name in namespaces:  # a function offered inside a namespace tool
        item["namespace"] = namespaces[name]
    return item


async def finished(call: Call, r: ResponsesRequest, rid: str, conversation: list[dict],
                   output: list[dict], sent: list[bytes] | None = None) -> dict:
    """File the turn and keep the response for a chain; once the turn is on disk (WriteFailed
    when the disk refused it) the last bytes may go out."""
    rec = call.gen.records[0]
    status = "incomplete" if rec.finish_reason == "length" else "completed"
    body = response_body(r, rid, int(call.gen.started), status, output,
                         responses_usage(call.gen.usage()))
    on_disk = call.file(body, sent)
    if r.store:
        reply = {"role": "assistant", "content": rec.text or None}
        if rec.tool_calls:
            reply["tool_calls"] = rec.tool_calls
        turn = call.turn
        # diskcache (SQLite) on a worker thread: the event loop never waits on the disk
        try:
            await asyncio.to_thread(response_store.keep, call.request.app[RESPONSES], rid, {
                "response": body, "conversation": conversation + [reply],
                "session_id": turn.session_id if turn else None,
                "thread": turn.thread if turn else None})
        except WriteFailed:  # a full disk: the answer is 507, once the turn's line settled
            await asyncio.gather(on_disk, return_exceptions=True)
            raise
    await on_disk
    return body


async def full_response(call: Call, r: ResponsesRequest, rid: str, conversation: list[dict]):
    # The same item logic as the stream, unsent: both give one output, in the order it came.
    events = EventWriter(None, tool_namespaces(r.tools))
    for ev in await drain(call):
        await events.add(ev)
    await events.end(call.gen.records[0])
    body = await finished(call, r, rid, conversation, events.output)
    return json_response(body, headers=call.headers)


# ---- streaming ----

def sse_event(data: dict) -> bytes:
    return b"event: " + data["type"].encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class EventWriter:
    """The output items of one response, and their event stream: numbers the events and tracks
    the item being written (a reasoning item or a message takes text deltas until another kind
    of output starts). With no `stream` it only builds the items (a non-streamed response)."""

    def __init__(self, stream: SseStream | None, namespaces: dict[str, str]):
        self.stream, self.seq, self.sent, self.namespaces = stream, 0, [], namespaces
        self.output: list[dict] = []  # finished items
        self.open: dict | None = None  # the reasoning or message item being streamed

    async def add(self, ev: ChoiceEvent) -> None:
        for kind, value in ev.deltas:
            if kind in ("content", "reasoning") and value:
                await self.text(kind, value)
            elif kind == "tool_call":
                await self.tool_call(value)

    async def end(self, rec: ChoiceRecord) -> None:
        """Close the output: the item cut by the token limit is `incomplete`; an empty answer
        is still one message."""
        status = "incomplete" if rec.finish_reason == "length" else "completed"
        await self.close(status)
        if not rec.text and not rec.tool_calls:
            await self.text("content", "")
            await self.close(status)

    async def send(self, type_: str, **fields) -> None:
        if self.stream is None:
            return
        payload = sse_event({"type": type_, "sequence_number": self.seq, **fields})
        self.seq += 1
        self.sent.append(payload)
        await self.stream.send(payload)

    async def text(self, kind: str, delta: str) -> None:
        item_type = "reasoning" if kind == "reasoning" else "message"
        if self.open is None or self.open["type"] != item_type:
            await self.close("completed")
            await self._start(item_type)
        item, where = self.open, self._where()
        item["content"][0]["text"] += delta
        if not delta:
            return
        if item_type == "message":
            await self.send("response.output_text.delta", **where, delta=delta, logprobs=[])
        else:
            await self.send("response.reasoning_text.delta", **where, delta=delta)

    async def tool_call(self, call: dict) -> None:
        await self.close("completed")
        item, index = call_item(call, "completed", self.namespaces), len(self.output)
        await self.send("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "arguments": ""})
        where = {"item_id": item["id"], "output_index": index}
        await self.send("response.function_call_arguments.delta", **where,
                        delta=item["arguments"])
        await self.send("response.function_call_arguments.done", **where,
                        name=item["name"], arguments=item["arguments"])
        self.output.append(item)
        await self.send("response.output_item.done", output_index=index, item=item)

    async def _start(self, item_type: str) -> None:
        if item_type == "message":
            self.open, part = message_item(new_id("msg"), "", "in_progress"), text_part("")
        else:
            self.open = reasoning_item(new_id("rs"), "", "in_progress")
            part = {"type": "reasoning_text", "text": ""}
        self.open["content"] = []  # as OpenAI announces an item: parts come next
        await self.send("response.output_item.added", output_index=len(self.output),
                        item=self.open)
        self.open["content"].append(part)
        await self.send("response.content_part.added", **self._where(), part=part)

    async def close(self, status: str) -> None:
        """End the open item: its `.done` events, then it joins the output."""
        item = self.open
        if item is None:
            return
        where, part = self._where(), item["content"][0]
        done = "output_text" if item["type"] == "message" else "reasoning_text"
        extra = {"logprobs": []} if done == "output_text" else {}
        await self.send(f"response.{done}.done", **where, text=part["text"], **extra)
        await self.send("response.content_part.done", **where, part=part)
        item["status"] = status
        self.output.append(item)
        self.open = None
        await self.send("response.output_item.done", output_index=len(self.output) - 1,
                        item=item)

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.output),
                "content_index": 0}


async def stream_response(call: Call, r: ResponsesRequest, rid: str,
                          conversation: list[dict]) -> web.StreamResponse:
    stream = await open_stream(call.request, call.headers)
    events = EventWriter(stream, tool_namespaces(r.tools))
    created = int(call.gen.started)

    async def failed(err: APIError) -> None:
        await events.send("response.failed", response=response_body(
            r, rid, created, "failed", events.output,
            error={"code": err.code or err.type, "message": err.message}))

    await events.send("response.created",
                      response=response_body(r, rid, created, "in_progress", []))
    await events.send("response.in_progress",
                      response=response_body(r, rid, created, "in_progress", []))
    async for ev in call.events():
        if isinstance(ev, Failed):
            await events.close("incomplete")  # the item cut off gets its .done events first
            await failed(ev.error)
            return await stream.end()
        await events.add(ev)
    await events.end(call.gen.records[0])
    try:
        body = await finished(call, r, rid, conversation, events.output, events.sent)
    except WriteFailed as e:  # the turn was not kept: the response failed, not completed
        await failed(disk_full_error(e))
        raise StreamEnded(await stream.end()) from e
    await events.send(f"response.{body['status']}", response=body)
    return await stream.end()


def body_as_events(body: dict) -> list[bytes]:
    """A kept non-streamed response, re-sent to a streaming retry (whole items, no deltas)."""
    start = {**body, "status": "in_progress", "output": [], "usage": None}
    events = [{"type": "response.created", "response": start}]
    for i, item in enumerate(body["output"]):
        events.append({"type": "response.output_item.added", "output_index": i, "item": item})
        events.append({"type": "response.output_item.done", "output_index": i, "item": item})
    events.append({"type": f"response.{body['status']}", "response": body})
    return [sse_event({**e, "sequence_number": n}) for n, e in enumerate(events)]
