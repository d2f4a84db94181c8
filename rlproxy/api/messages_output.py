"""Anthropic Messages output: engine deltas -> content blocks, the message body, SSE events.

Owns the response side of /v1/messages: how a choice's ("content" | "reasoning" | "tool_call")
deltas become `text` / `thinking` / `tool_use` blocks, the stop_reason and usage mapping, the
event sequence (message_start ... message_stop, ping) and Anthropic's error shape. Pure data in,
data out: no HTTP, no engine, no sessions (messages.py wires these to the shared turn path).
"""

from __future__ import annotations

import asyncio
import secrets

import orjson

from rlproxy.protocol import APIError

# Our finish reasons -> Anthropic's. A stop string that matched is "stop_sequence" (see
# stop_reason); a completion budget clamped to the context still ends as "max_tokens".
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
BLOCK_TYPES = {"content": "text", "reasoning": "thinking", "tool_call": "tool_use"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 529: "overloaded_error"}


def message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def tool_use_id(call_id: str) -> str:
    """Anthropic's id style for a parsed tool call (`call_<hex>` -> `toolu_<hex>`)."""
    return "toolu_" + call_id.removeprefix("call_")


def error_body(err: APIError) -> dict:
    """`{"type": "error", "error": {"type", "message"}}`, the type named by the HTTP status."""
    kind = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    # Anthropic counts cache reads apart from input_tokens: their sum is the whole prompt.
    # Nothing is billed for writing the prefix cache, so cache_creation_input_tokens is 0.
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}


def stop_reason(finish_reason: str, stop_sequence: str | None) -> str:
    return "stop_sequence" if stop_sequence is not None else STOP_REASONS[finish_reason]


def message(mid: str, model: str, content: list[dict], stop: str | None,
            stop_sequence: str | None, use: dict) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop, "stop_sequence": stop_sequence,
            "usage": use}


def event(name: str, data: dict) -> bytes:
    """One server-sent event; `data.type` repeats the event name, as Anthropic sends it."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


PING = event("ping", {"type": "ping"})


class Blocks:
    """A message's content blocks, built as deltas arrive. Consecutive text (or thinking)
    deltas extend one block; each tool call is a block of its own. `add` and `close` return
    the stream events for what changed, so the body and the stream can never disagree."""

    def __init__(self):
        self.content: list[dict] = []
        self.open = False  # the last block may still grow

    def add(self, kind: str, value) -> list[tuple[str, dict]]:
        btype = BLOCK_TYPES.get(kind)
        if btype is None:  # a delta kind this dialect does not show
            return []
        if kind == "tool_call":
            return self.close() + self._tool_use(value)
        events = []
        if not (self.open and self.content[-1]["type"] == btype):
            events += self.close()
            block = ({"type": "text", "text": ""} if btype == "text"
                     else {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._start(block))
            self.open = True
        key, delta = ("text", "text_delta") if btype == "text" else ("thinking", "thinking_delta")
        self.content[-1][key] += value
        events.append(("content_block_delta", {"type": "content_block_delta",
                                               "index": len(self.content) - 1,
                                               "delta": {"type": delta, key: value}}))
        return events

    def close(self) -> list[tuple[str, dict]]:
        if not self.open:
            return []
        self.open = False
        return [("content_block_stop", {"type": "content_block_stop",
                                        "index": len(self.content) - 1})]

    def _start(self, block: dict) -> tuple[str, dict]:
        self.content.append(block)
        return ("content_block_start", {"type": "content_block_start",
                                        "index": len(self.content) - 1,
                                        "content_block": dict(block)})

    def _tool_use(self, call: dict) -> list[tuple[str, dict]]:
        fn = call["function"]
        block = {"type": "tool_use", "id": tool_use_id(call["id"]), "name": fn["name"]}
        # The whole call was parsed at its closing tag: one input_json_delta carries it.
        start = self._start({**block, "input": {}})
        self.content[-1]["input"] = orjson.loads(fn["arguments"])
        index = len(self.content) - 1
        return [start,
                ("content_block_delta", {"type": "content_block_delta", "index": index,
                                         "delta": {"type": "input_json_delta",
                                                   "partial_json": fn["arguments"]}}),
                ("content_block_stop", {"type": "content_block_stop", "index": index})]


def message_start(mid: str, model: str, prompt_tokens: int) -> bytes:
    # How much of the prompt the prefix cache held is known only once the engine took the job;
    # message_delta's usage carries the final split (the SDK overwrites these counts with it).
    return event("message_start", {"type": "message_start", "message": message(
        mid, model, [], None, None, usage(prompt_tokens, 0, 0))})


def message_end(stop: str, stop_sequence: str | None, use: dict) -> list[bytes]:
    return [event("message_delta", {"type": "message_delta",
                                     "delta": {"stop_reason": stop, "stop_sequence": stop_sequence},
                                     "usage": use}),
            event("message_stop", {"type": "message_stop"})]


def body_as_events(body: dict) -> list[bytes]:
    """A kept non-streamed message, re-sent to a streaming retry: the events it would have had."""
    out = [message_start(body["id"], body["model"],
                         body["usage"]["input_tokens"] + body["usage"]["cache_read_input_tokens"])]
    blocks = Blocks()
    for b in body["content"]:
        if b["type"] == "tool_use":
            call = {"id": b["id"].removeprefix("toolu_"),
                    "function": {"name": b["name"], "arguments": orjson.dumps(b["input"]).decode()}}
            pairs = blocks.add("tool_call", call)  # tool_use_id() gives b["id"] back
        else:
            pairs = blocks.add("content" if b["type"] == "text" else "reasoning",
                               b.get("text", b.get("thinking", "")))
        out += [event(name, data) for name, data in pairs]
    out += [event(name, data) for name, data in blocks.close()]
    return out + message_end(body["stop_reason"], body["stop_sequence"], body["usage"])


async def with_pings(events, interval_s: float):
    """Yield from an async iterator, and None whenever `interval_s` passes without an item (the
    caller sends a ping then). The pending read is never cancelled, so no item is lost."""
    it = aiter(events)
    pending = asyncio.ensure_future(anext(it))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield None
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            yield item
            pending = asyncio.ensure_future(anext(it))
    finally:
        pending.cancel()
