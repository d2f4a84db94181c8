"""Idempotency by X-Request-Id: the response each recent request id got, and the attempt that is
still running for one, so a retry replays the answer instead of generating (and filing) it again.

Keeps the last `keep` responses within KEEP_RESPONSES_BYTES, oldest out first, in memory only.
Knows nothing of HTTP or of what a kept response holds beyond its size (the caller, api/turns.py,
decides what to keep and how to replay it). Not thread-safe: the event loop owns it.
"""

from __future__ import annotations

import asyncio

import orjson

from rlproxy.lru import LRU

KEEP_RESPONSES_BYTES = 256 * 2**20  # kept X-Request-Id responses, at most


def kept_size(kept) -> int:
    """About the bytes a kept response holds: its SSE payloads, else its body."""
    if isinstance(kept, dict) and kept.get("events"):
        return sum(len(p) for p in kept["events"])
    return len(orjson.dumps(kept.get("body") if isinstance(kept, dict) else kept,
                            default=str))


class ReplayCache:
    def __init__(self, keep: int = 1024):
        # the last `keep`, within KEEP_RESPONSES_BYTES (streams with logprobs run to
        # megabytes each): the oldest go first, the newest is always kept
        self.kept: LRU[str, object] = LRU(max_items=keep, max_bytes=KEEP_RESPONSES_BYTES)
        self.running: dict[str, asyncio.Future] = {}  # request id -> its attempt running

    def stored_response(self, request_id: str):
        """The kept response; the future of the attempt still running; or None."""
        return self.running.get(request_id) or self.kept.peek(request_id)

    def start_response(self, request_id: str) -> asyncio.Future:
        """This attempt runs: a repeat waits on the future until `finish_response`."""
        running = self.running[request_id] = asyncio.get_running_loop().create_future()
        return running

    def finish_response(self, request_id: str, kept) -> None:
        """The attempt ended: keep its response, or None (it failed: a repeat runs anew)."""
        running = self.running.pop(request_id, None)
        if kept is not None:
            self.kept.put(request_id, kept, kept_size(kept))
        if running is not None and not running.done():
            running.set_result(kept)
