"""The one path every API dialect takes: from an internal chat request to a filed turn.

Order of work: claim the X-Request-Id (before any await, so a concurrent repeat waits for this
attempt instead of running its own) or replay the response kept for it -> template the prompt ->
token budget -> resolve the session (which links the session's previous turn to its next
state) -> generate -> the dialect writes its response from `Generation.events()` and calls
`Call.file_turn()` (journal the finished turn) before the response's last bytes -> cancel what
a gone client left running -> keep the response for a repeat, or, when the attempt failed, let
exactly one waiting repeat run anew. A request that opted out (X-RL-Opt-Out) is served and never
filed.

Durable before acknowledged: the turn's journal line is written by the records' writer thread;
the response's bytes after `file_turn` wait for it (a streamed response through `open_sse`'s
response, a whole body in `serve_turn`), so no client hears of a turn a crash could lose, and
the event loop never waits on the disk.

Hostile and ending streams: every streamed byte goes through `SseResponse.write`, which gives
up on a client that takes nothing for `--stall-timeout-s` (the connection is aborted, the
generation cancelled, `client_stalled` logged); a choice whose reader falls
`completions.MAX_BACKLOG` steps behind is stopped on the engine thread even sooner, so a
stalled reader never holds a batch slot while it waits out the timeout. When a shutdown drain
runs out (`app[STOPPING]`, api/server.py), `run_call` interrupts the generation: a stream ends
with its dialect's error event, a whole response is a 503 with Retry-After. Either way the turn
is not filed, as for any client that went away: only a turn whose response was complete is.

Owns nothing about any dialect's shapes: a dialect passes in `write` (its response from a
`Call`) and `replay` (a stored response sent again; `replay_kept` does it given the dialect's
body-as-events). Parsing is the dialect's job too. What every dialect shows the same way lives
here: `parallel_tool_calls: false` keeps a choice's first tool call (`Call.events`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Awaitable, Callable

from aiohttp import web

from rlproxy.api.edge import StreamEnded, disk_full_error, json_response
from rlproxy.appkeys import ENGINE, MODEL, SESSIONS, SETTINGS, STOPPING
from rlproxy.ops import metrics
from rlproxy.ops.health import served_names
from rlproxy.ops.logs import TURN_UID
from rlproxy.serving.completions import MAX_BACKLOG, ChoiceEvent, ChoiceRecord, EngineFailure, \
    Generation, Interrupted, Prompt, build_prompt, sampling_params
from rlproxy.api.tags import TurnTags
from rlproxy.protocol import APIError, ChatRequest
from rlproxy.records import WriteFailed
from rlproxy.serving.engine import SamplingParams
from rlproxy.sessions.store import Placement, Session, Turn

LOGPROB_DEFINITION = ("log_softmax(logits) at temperature 1, after logit_bias and penalties, "
                      "before temperature and top_p")
log = logging.getLogger("rlproxy.turns")
SHUTDOWN_RETRY_AFTER_S = 5  # a restarted server answers again within seconds
# A stream's send buffers, kernel and asyncio: Linux grows a socket's to 4 MB (~27k chunks)
# when the client does not read, which would hide a stall for minutes; 16 KiB still carries
# an SSE stream's ~30 KB/s at a 500 ms round trip.
SSE_SEND_BUFFER = 16 * 1024
# the future of the request's filed turn (Call.file_turn): response bytes after it wait for it
DURABLE = web.RequestKey("turn_durable", asyncio.Future)


@dataclass
class Call:
    """One request on its way through the engine: everything a dialect's writer needs."""

    request: web.Request
    req: ChatRequest
    tags: TurnTags
    api: str  # "chat" | "responses" | "messages": recorded on the turn
    prompt: Prompt
    params: list[SamplingParams]
    gen: Generation
    place: Placement | None  # session, thread, turn type; None when it opted out of recording
    headers: dict[str, str] = field(default_factory=dict)  # response headers (X-Session-Id ...)
    turn: Turn | None = None  # set by file_turn
    durable: asyncio.Future | None = None  # set by file_turn: done once the turn is on disk
    kept_body: dict | None = None  # the body file_turn was given, for a repeat (serve_turn)

    @property
    def session(self) -> Session | None:
        return self.place.session if self.place else None

    async def events(self):
        """The generation's events, as a writer shows them: with `parallel_tool_calls: false`
        a choice keeps its first tool call only (its record keeps every sampled token)."""
        async for ev in self.gen.events():
            if not self.req.parallel_tool_calls:
                first_tool_call_only(ev, self.gen.texts[ev.index].tool_calls,
                                     self.gen.records[ev.index])
            yield ev

    def file_turn(self, body: dict | None = None) -> asyncio.Future:
        """File the finished turn; a writer calls it before the response's last bytes, and may
        `await` what it returns (done once the turn is on disk; the response waits for it in
        any case). `body`: the response's body, kept for a repeat of its X-Request-Id should
        the response not reach its client after this."""
        self.kept_body = body
        if self.session is None:
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        req, gen, store = self.req, self.gen, self.request.app[SESSIONS]
        turn = Turn(
            uid=uuid.uuid4().hex, session_id=self.session.id,
            index=store.next_index(self.session), turn_type=self.place.turn_type,
            requested_model=req.model, messages=self.prompt.messages, tools=self.prompt.tools,
            prompt_ids=self.prompt.ids, choices=[asdict(r) for r in gen.records],
            sampling={"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                      "max_tokens": self.params[0].max_tokens,
                      "max_tokens_requested": req.max_tokens,
                      "max_tokens_clamped": (req.max_tokens or 0) > self.params[0].max_tokens,
                      "seeds": [p.seed for p in self.params], "logit_bias": req.logit_bias,
                      "presence_penalty": req.presence_penalty,
                      "frequency_penalty": req.frequency_penalty,
                      "logprobs_are": LOGPROB_DEFINITION},
            timings={"received": gen.started,
                     "first_token_s": round((gen.first_token_at or gen.started) - gen.started, 4),
                     "total_s": round(time.time() - gen.started, 4)},
            turn_id=self.tags.turn_id, step_index=self.tags.step_index,
            request_id=self.tags.request_id, api=self.api,
        )
        self.durable = asyncio.wrap_future(store.complete(self.place, turn,
                                                          self.tags.session_done))
        self.turn = turn
        self.request[DURABLE] = self.durable
        self.headers["X-Turn-Uid"] = turn.uid
        kept = asyncio.shield(self.durable)  # a writer cancelled while it waits: still filed
        # a writer need not await it (the response waits for `durable`, and a failure surfaces
        # there as a 507): no "Future exception was never retrieved"
        kept.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.durable.add_done_callback(lambda f: unacknowledged(f, turn))
        return kept

    def kept_after_failure(self) -> dict | None:
        """What a repeat of a response that failed after its turn was filed gets: the body
        file_turn was given, so the turn is not generated or recorded twice. None when no turn
        was filed, or it is not on disk (writing it failed)."""
        d = self.durable
        if self.turn is None or self.kept_body is None or d is None or not d.done() or (
                d.cancelled() or d.exception() is not None):
            return None
        return {"body": self.kept_body, "events": None}


def unacknowledged(durable: asyncio.Future, turn: Turn) -> None:
    """A turn whose line the disk refused was answered 507: the client will send it again, so
    should it be recorded later (its next state arrives), it must not train twice."""
    if not durable.cancelled() and durable.exception() is not None:
        turn.no_train = "write_failed"


def first_tool_call_only(ev: ChoiceEvent, parsed: list[dict], rec: ChoiceRecord) -> None:
    """Drop the tool calls after a choice's first from its event and, once it finished, from its
    record's `tool_calls` (what the reply and the turn show). `parsed`: every call the choice's
    text has given so far, this event's included."""
    before = len(parsed) - sum(kind == "tool_call" for kind, _ in ev.deltas)
    kept = []
    for kind, value in ev.deltas:
        if kind == "tool_call":
            before += 1
            if before > 1:
                continue
        kept.append((kind, value))
    ev.deltas = kept
    if rec.finish_reason is not None:
        rec.tool_calls = rec.tool_calls[:1]


# write(call) -> (the response, what to keep for an idempotent retry or None when it failed)
Write = Callable[[Call], Awaitable[tuple[web.StreamResponse, object | None]]]
# replay(request, req, kept) -> the kept response sent again, nothing generated or recorded
Replay = Callable[[web.Request, ChatRequest, object], Awaitable[web.StreamResponse]]


async def serve_turn(request: web.Request, req: ChatRequest, tags: TurnTags, api: str,
                     write: Write, replay: Replay,
                     thread_hint: str | None = None) -> web.StreamResponse:
    """Run one turn of any dialect. `thread_hint` names the thread a chained request
    (Responses' previous_response_id) continues, for the session store."""
    app = request.app
    settings, store = app[SETTINGS], app[SESSIONS]
    if settings.server.strict_model_names and req.model not in served_names(app):
        raise APIError(404, f"The model '{req.model}' does not exist", param="model",
                       code="model_not_found")
    # Keyed per API: a retry comes back through the door it first used, in that door's shape.
    replay_key = f"{api}:{tags.request_id}" if tags.request_id and not tags.opt_out else None
    if replay_key is None:
        call = await make_call(request, req, tags, api, thread_hint)
        return (await run_call(call, write))[0]
    while (kept := store.stored_response(replay_key)) is not None:
        if not isinstance(kept, asyncio.Future):
            return await replay(request, req, kept)
        # Another attempt is running: wait for it (a client that gives up leaves it running).
        # If it fails, the first waiter to wake claims the key and the others wait for that one.
        if (kept := await asyncio.shield(kept)) is not None:
            return await replay(request, req, kept)
    store.start_response(replay_key)  # no await since the check above: this attempt owns it
    call, kept = None, None
    try:
        call = await make_call(request, req, tags, api, thread_hint)
        resp, kept = await run_call(call, write)
        return resp
    finally:
        if kept is None and call is not None:  # filed, then its client went away?
            if call.durable is not None and not call.durable.done():
                try:  # a repeat acknowledges the turn: only once it is on disk
                    await asyncio.shield(call.durable)
                except BaseException:  # noqa: BLE001  (failed or cancelled: not kept, below)
                    pass
            kept = call.kept_after_failure()
        store.finish_response(replay_key, kept)


async def make_call(request: web.Request, req: ChatRequest, tags: TurnTags, api: str,
                    thread_hint: str | None) -> Call:
    """Template the prompt, check the token budget, resolve the session: a Call to run."""
    app = request.app
    settings, model, engine, store = app[SETTINGS], app[MODEL], app[ENGINE], app[SESSIONS]
    if engine.alive and engine.error is not None and engine.health().get("service_error"):
        raise APIError(503, f"refused at once: {engine.error}", type="server_error",
                       code="sampler_unavailable", headers={"Retry-After": "5"})  # comes back
    if engine.error is not None or not engine.alive:
        raise APIError(503, f"the engine is not running: {engine.error}", type="server_error")
    loop = asyncio.get_running_loop()
    # Templating a 15k-token agent prompt takes tens of ms: keep it off the event loop.
    prompt = await loop.run_in_executor(None, build_prompt, model.tokenizer, req)
    params = sampling_params(req, len(prompt.ids), model.context_length,
                             settings.engine.default_max_tokens, model.vocab_size,
                             settings.engine.strict_max_tokens)
    place = None
    if not tags.opt_out:
        place = store.resolve(tags, prompt.messages, prompt.tools, req.max_tokens, thread_hint)
    return Call(request, req, tags, api, prompt, params,
                Generation(engine, model.tokenizer, prompt, params, req,
                           reasoning=settings.engine.reasoning_parser == "auto"), place,
                {"X-Session-Id": place.session.id} if place else {})


async def run_call(call: Call, write: Write) -> tuple[web.StreamResponse, object | None]:
    """Generate and write one turn (the dialect files it): the response, and what to keep for
    a repeat (None when it failed)."""
    stopping = call.request.app.get(STOPPING)
    watch = None
    if stopping is not None:  # the shutdown drain ran out: end this request now
        watch = asyncio.ensure_future(stopping.wait())
        watch.add_done_callback(lambda f: f.cancelled() or call.gen.interrupt("shutdown"))
    stalled = False
    try:
        resp, kept = await write(call)
        if call.durable is not None:  # a whole body goes out after this: on disk first
            await asyncio.shield(call.durable)
        return resp, kept
    except ClientStalled:
        stalled = True
        raise
    finally:
        if watch is not None:
            watch.cancel()
        call.gen.cancel()  # no-op for finished choices; stops generation for a gone client
        if stalled or call.gen.stalled:
            metrics.STALLED.labels(call.api).inc()
            log.info("client_stalled: a %s stream was not read; generation stopped after %d "
                     "tokens, turn not recorded", call.api, call.gen.decoded)
        if call.turn is not None:
            TURN_UID.set(call.turn.uid)  # the request's later log lines name its turn
        metrics.observe_call(call)


async def drain(call: Call) -> list[ChoiceEvent]:
    """Run every choice to its end for a non-streamed response; all events, in order."""
    events = []
    try:
        async for ev in call.events():
            events.append(ev)
            transport = call.request.transport
            if transport is None or transport.is_closing():
                raise ConnectionResetError("client went away")
    except (EngineFailure, Interrupted) as e:
        raise generation_error(e) from None
    return events


def generation_error(e: EngineFailure | Interrupted) -> APIError:
    """What a generation that did not reach its end tells its client, in any dialect: the
    body of a whole response, or a stream's error event."""
    if isinstance(e, Interrupted) and e.reason == "shutdown":
        return APIError(503, "the server is shutting down; retry the request",
                        type="server_error", code="server_shutting_down",
                        headers={"Retry-After": str(SHUTDOWN_RETRY_AFTER_S)})
    if isinstance(e, Interrupted):
        return APIError(408, f"the stream was not read: generation stopped when "
                        f"{MAX_BACKLOG} tokens waited for the client", code="client_stalled")
    if isinstance(e, EngineFailure) and e.status == 503:  # --sampler tinker, service down
        return APIError(503, f"generation failed: {e}", type="server_error",
                        code="sampler_unavailable", headers={"Retry-After": "5"})
    if isinstance(e, EngineFailure) and e.status == 400:  # parameters it cannot apply
        return APIError(400, str(e), code="unsupported_parameter")
    return APIError(500, f"generation failed: {e}", type="server_error")


async def replay_kept(request: web.Request, req: ChatRequest, kept: dict,
                      body_as_events: Callable[[dict], list[bytes]]) -> web.StreamResponse:
    """A repeated X-Request-Id: the kept response again, nothing generated or recorded. `kept`
    is a writer's {"body", "events": the SSE payloads sent, or None when not streamed};
    `body_as_events` re-sends a non-streamed body to a streaming retry, in the dialect's shape.
    A dialect passes it in with functools.partial as its `Replay`."""
    headers = {"X-Idempotent-Replay": "true"}
    if not req.stream:
        return json_response(kept["body"], headers=headers)
    resp = await open_sse(request, headers)
    for payload in kept["events"] or body_as_events(kept["body"]):
        await resp.write(payload)
    await resp.write_eof()
    return resp


class ClientStalled(ConnectionResetError):
    """A streaming client took no bytes for --stall-timeout-s; its connection is aborted."""


class SseResponse(web.StreamResponse):
    """A text/event-stream response whose bytes written after its request's turn was filed
    wait until the turn is on disk: the finish events, `[DONE]` and the end of the stream
    never reach a client before a crash could no longer lose the turn. A write the client
    does not take within --stall-timeout-s aborts the connection (ClientStalled): aiohttp's
    write waits for the socket to drain, with no limit of its own."""

    def __init__(self, request: web.Request, headers: dict[str, str]):
        super().__init__(headers=headers)
        self.for_request = request
        self.stall_timeout_s = request.app[SETTINGS].server.stall_timeout_s
        # the dialect's error event for a turn the disk refused (507 insufficient_storage):
        # written instead of the stream's end, which would claim a turn that was not kept
        self.on_disk_full: Callable[[APIError], Awaitable[None]] | None = None
        self.disk_full: WriteFailed | None = None

    async def _send(self, send, data) -> None:
        try:
            async with asyncio.timeout(self.stall_timeout_s):
                await send(data)
                if self._payload_writer is not None:  # aiohttp drains every 64 KiB only
                    await self._payload_writer.drain()  # waits while over the high-water mark
        except TimeoutError:
            transport = self.for_request.transport
            if transport is not None:
                transport.abort()  # close() would wait for the unread bytes forever
            raise ClientStalled(f"the client read nothing for {self.stall_timeout_s:g} s") \
                from None

    async def _turn_on_disk(self) -> None:
        durable = self.for_request.get(DURABLE)
        if durable is None or self.disk_full is not None:
            return
        try:
            await asyncio.shield(durable)
        except WriteFailed as e:  # the turn was not kept: say so in the stream, then end it
            if self.on_disk_full is None:
                raise
            self.disk_full = e
            await self.on_disk_full(disk_full_error(e))
            await self._send(super().write_eof, b"")
            raise StreamEnded(self) from e

    async def write(self, data) -> None:
        await self._turn_on_disk()
        await self._send(super().write, data)

    async def write_eof(self, data: bytes = b"") -> None:
        await self._turn_on_disk()
        await self._send(super().write_eof, data)


async def open_sse(request: web.Request, headers: dict[str, str]) -> web.StreamResponse:
    """A prepared text/event-stream response (an `SseResponse`)."""
    resp = SseResponse(request, {"Content-Type": "text/event-stream",
                                 "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                 **headers})
    await resp.prepare(request)
    transport = request.transport
    if transport is not None:  # the client went away: the first write will say so
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SSE_SEND_BUFFER)
        transport.set_write_buffer_limits(high=SSE_SEND_BUFFER)
    return resp
