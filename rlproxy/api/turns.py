"""The one path every API dialect takes: from an internal chat request to a filed turn.

A dialect's handler reads its request into a `ChatRequest` and enters `serve_turn`, which gives
it either a `Kept` response (a repeated X-Request-Id: the dialect sends it again) or a `Call`.
The dialect iterates `Call.events()` -- the generation's `ChoiceEvent`s (text, reasoning and
tool-call deltas, logprobs, each choice's finish), or a `Failed` that ends them early -- and
writes them in its own wire format; when the generation is complete it builds its body and
awaits `Call.file(body)`: the turn is filed, and on disk, before the reply's last bytes. A disk
that refused it raises `WriteFailed` there (a whole body: the 507; a stream: the dialect's own
error event). Nothing here calls into a dialect or knows its shapes.

Order of work in `serve_turn`: claim the X-Request-Id (before any await, so a concurrent repeat
waits for this attempt instead of running its own) or hand back the response kept for it ->
template the prompt -> token budget -> resolve the session (which links the session's previous
turn to its next state) -> generate (the dialect writes, files) -> cancel what a gone client
left running -> keep the response for a repeat, or, when the attempt failed, let exactly one
waiting repeat run anew. A request that opted out (X-RL-Opt-Out) is served and never filed.

Durable before acknowledged: the turn's journal line is written by the records' writer thread;
the future `Call.file` returns is done once it is on disk, so no client hears of a turn a crash
could lose, and the event loop never waits on the disk.

Hostile and ending streams: a stream's writes are bounded by --stall-timeout-s (streams.py,
`ClientStalled`, counted and logged here as `client_stalled`); a choice whose reader falls
`completions.MAX_BACKLOG` steps behind is stopped on the engine thread even sooner, so a stalled
reader never holds a batch slot while it waits out the timeout. When a shutdown drain runs out
(`app[STOPPING]`, api/server.py), the generation is interrupted: a stream ends with its
dialect's error event (`Failed`), a whole response is a 503 with Retry-After. Either way the
turn is not filed, as for any client that went away: only a turn whose response was complete is.

What every dialect shows the same way lives here: `parallel_tool_calls: false` keeps a choice's
first tool call (`Call.events`), and `generation_error` words a generation that did not end.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import AsyncIterator

from aiohttp import web

from rlproxy.api.streams import ClientStalled
from rlproxy.api.tags import TurnTags
from rlproxy import paths
from rlproxy.appkeys import ADAPTERS, ADAPTERS_OFF, ENGINE, MODEL, SAVED, SESSIONS, SETTINGS, \
    STOPPING
from rlproxy.ops import metrics
from rlproxy.ops.health import served_names
from rlproxy.ops.logs import TURN_UID
from rlproxy.paths import complete_checkpoints, kept_checkpoint
from rlproxy.protocol import APIError, ChatRequest
from rlproxy.serving.completions import MAX_BACKLOG, ChoiceEvent, ChoiceRecord, EngineFailure, \
    Generation, Interrupted, Prompt, build_prompt, sampling_params
from rlproxy.serving.engine import SamplingParams
from rlproxy.settings import adapter_name
from rlproxy.sessions.store import Placement, Session, SessionStore, Turn

LOGPROB_DEFINITION = ("log_softmax(logits) at temperature 1, after logit_bias and penalties, "
                      "before temperature and top_p")
log = logging.getLogger("rlproxy.turns")
SHUTDOWN_RETRY_AFTER_S = 5  # a restarted server answers again within seconds


@dataclass
class Failed:
    """The generation ended before its end (engine error, stalled reader, shutdown): the last
    of `Call.events()`. `error` is what the client hears, as a stream's error event."""

    error: APIError


@dataclass
class Kept:
    """The response an earlier attempt with this X-Request-Id got: sent again by the dialect,
    nothing generated or recorded."""

    body: dict
    events: list[bytes] | None  # the SSE payloads it sent; None when it was not streamed


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
    store: SessionStore  # the default adapter's, or the personal adapter's it names
    headers: dict[str, str] = field(default_factory=dict)  # response headers (X-Session-Id ...)
    turn: Turn | None = None  # set by file
    durable: asyncio.Future | None = None  # set by file: done once the turn is on disk
    kept: dict | None = None  # set by file: {"body", "events"} for a repeat of its request id

    @property
    def session(self) -> Session | None:
        return self.place.session if self.place else None

    async def events(self) -> AsyncIterator[ChoiceEvent | Failed]:
        """The generation's events, as a writer shows them: with `parallel_tool_calls: false`
        a choice keeps its first tool call only (its record keeps every sampled token). A
        generation that does not reach its end ends them with one `Failed`."""
        try:
            async for ev in self.gen.events():
                if not self.req.parallel_tool_calls:
                    first_tool_call_only(ev, self.gen.texts[ev.index].tool_calls,
                                         self.gen.records[ev.index])
                yield ev
        except (EngineFailure, Interrupted) as e:
            yield Failed(generation_error(e))

    def file(self, body: dict, events: list[bytes] | None = None) -> asyncio.Future:
        """File the finished turn; the writer awaits what this returns before the reply's last
        bytes: done once the turn is on disk, or raising WriteFailed when the disk refused it.
        `body` (and a stream's `events`: the list its writer goes on appending to until the
        stream ends) is what a repeat of this X-Request-Id gets."""
        self.kept = {"body": body, "events": events}
        if self.session is None:
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        req, gen, store = self.req, self.gen, self.store
        turn = Turn(
            uid=uuid.uuid4().hex, session_id=self.session.id,
            index=store.next_index(self.session), turn_type=self.place.turn_type,
            requested_model=req.model, messages=self.prompt.messages, tools=self.prompt.tools,
            prompt_ids=self.prompt.ids, choices=[asdict(r) for r in gen.records],
            sampling={"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                      "max_tokens": self.params[0].max_tokens,
                      "max_tokens_requested": req.max_tokens,
                      "max_tokens_clamped": (req.max_tokens or 0) > self.params[0].max_tokens,
                      "max_tokens_clamped_by": clamped_by(
                          req.max_tokens, self.params[0].max_tokens,
                          self.request.app[SETTINGS].engine.max_completion_tokens),
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
        self.headers["X-Turn-Uid"] = turn.uid
        kept = asyncio.shield(self.durable)  # a writer cancelled while it waits: still filed
        # a writer gone before it awaited: no "Future exception was never retrieved"
        kept.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.durable.add_done_callback(lambda f: unacknowledged(f, turn))
        return kept

    def kept_after_failure(self) -> dict | None:
        """What a repeat of a response that failed after its turn was filed gets: the body
        `file` was given, so the turn is not generated or recorded twice. None when no turn
        was filed, or it is not on disk (writing it failed)."""
        d = self.durable
        if self.turn is None or self.kept is None or d is None or not d.done() or (
                d.cancelled() or d.exception() is not None):
            return None
        return {"body": self.kept["body"], "events": None}


def clamped_by(requested: int | None, used: int, cap: int | None) -> str | None:
    """Which limit cut a request's own budget: "max_completion_tokens" (the operator's cap),
    "context" (what the window had left), or None (it got what it asked for, or asked for
    nothing: --default-max-tokens applied)."""
    if requested is None or requested <= used:
        return None
    return "max_completion_tokens" if cap is not None and used == cap else "context"


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


@asynccontextmanager
async def serve_turn(request: web.Request, req: ChatRequest, tags: TurnTags, api: str,
                     thread_hint: str | None = None) -> AsyncIterator[Call | Kept]:
    """One turn of any dialect: `async with serve_turn(...) as call`, then the dialect writes
    its reply from `call` (or sends a `Kept` one again). `thread_hint` names the thread a
    chained request (Responses' previous_response_id) continues, for the session store."""
    app = request.app
    settings = app[SETTINGS]
    name = model_name(req.model, served_names(app))
    if settings.server.strict_model_names and name.base not in served_names(app):
        raise APIError(404, f"The model '{req.model}' does not exist", param="model",
                       code="model_not_found")
    personal = await personal_adapter(app, name, tags)
    if personal is None:
        async with one_turn(request, req, tags, api, thread_hint, name, None) as call:
            yield call
        return
    personal.requests += 1  # its adapter is not let go of while it runs (pipeline.py)
    personal.used = time.monotonic()
    try:
        async with one_turn(request, req, tags, api, thread_hint, name, personal) as call:
            yield call
    finally:
        personal.requests -= 1
        personal.used = time.monotonic()


@asynccontextmanager
async def one_turn(request: web.Request, req: ChatRequest, tags: TurnTags, api: str,
                   thread_hint: str | None, name: ModelName, personal
                   ) -> AsyncIterator[Call | Kept]:
    """`serve_turn` once its adapter is known: a repeated X-Request-Id, or a new Call."""
    store = personal.pipeline.store if personal is not None else request.app[SESSIONS]
    # Keyed per API: a retry comes back through the door it first used, in that door's shape.
    replay_key = f"{api}:{tags.request_id}" if tags.request_id and not tags.opt_out else None
    if replay_key is None:
        async with running(await make_call(request, req, tags, api, thread_hint, name,
                                           personal)) as call:
            yield call
        return
    while (kept := store.stored_response(replay_key)) is not None:
        if not isinstance(kept, asyncio.Future):
            yield Kept(**kept)
            return
        # Another attempt is running: wait for it (a client that gives up leaves it running).
        # If it fails, the first waiter to wake claims the key and the others wait for that one.
        if (kept := await asyncio.shield(kept)) is not None:
            yield Kept(**kept)
            return
    store.start_response(replay_key)  # no await since the check above: this attempt owns it
    call, kept = None, None
    try:
        call = await make_call(request, req, tags, api, thread_hint, name, personal)
        async with running(call):
            yield call
        kept = call.kept
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
                    thread_hint: str | None, name: ModelName, personal=None) -> Call:
    """Template the prompt, check the token budget, resolve the session: a Call to run.
    PERSONAL: the personal adapter the request names (pipeline.py `Personal`), or None."""
    app = request.app
    settings, model, engine = app[SETTINGS], app[MODEL], app[ENGINE]
    store = personal.pipeline.store if personal is not None else app[SESSIONS]
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
                             settings.engine.strict_max_tokens,
                             settings.engine.max_completion_tokens)
    data_dir = personal.data_dir if personal is not None else settings.records.data_dir
    saved = await saved_checkpoint(app, req.model, name.step, data_dir)
    if saved is not None:
        tags.opt_out = True  # a checkpoint is served read-only: never filed, never trained
    adapter = saved or ((personal.served.name, None) if personal is not None else None)
    place = None
    if not tags.opt_out:
        place = store.resolve(tags, prompt.messages, prompt.tools, req.max_tokens, thread_hint)
    headers = {"X-Session-Id": place.session.id} if place else {}
    if personal is not None:
        headers["X-RL-Adapter"] = personal.name
    return Call(request, req, tags, api, prompt, params,
                Generation(engine, model.tokenizer, prompt, params, req,
                           reasoning=settings.engine.reasoning_parser == "auto",
                           adapter=adapter),
                place, store, headers)


STEP_SUFFIX = re.compile(r"(.*)@([0-9]{1,9})")


@dataclass
class ModelName:
    """A request's `model`, read: `BASE`, `BASE:ADAPTER` (a personal adapter, when BASE is a
    name this server answers to), either with `@STEP` (a kept checkpoint, read-only)."""
    base: str | None
    adapter: str | None = None
    step: int | None = None


def model_name(model: str | None, served: list[str]) -> ModelName:
    m = STEP_SUFFIX.fullmatch(model or "")
    rest, step = (m[1], int(m[2])) if m else (model, None)
    if rest and ":" in rest:
        base, suffix = rest.rsplit(":", 1)
        if base in served:  # `llama3:8b` sent to a server that is not llama3 stays a name
            if suffix.strip().lower() == "default":
                return ModelName(base, None, step)
            try:
                return ModelName(base, adapter_name(suffix), step)
            except ValueError as e:
                raise APIError(400, f"model '{model}': {e}", param="model") from None
    return ModelName(rest, None, step)


async def personal_adapter(app: web.Application, name: ModelName, tags: TurnTags):
    """The personal adapter a request names (`MODEL:NAME` or X-RL-Adapter), made on its first
    request (pipeline.py `Adapters`); None for the default adapter. `MODEL:NAME@STEP` only
    reads a checkpoint: it makes no new adapter (one resting on disk is made again)."""
    if name.adapter and tags.adapter and name.adapter != tags.adapter:
        raise APIError(400, f"the model names adapter '{name.adapter}' and X-RL-Adapter "
                       f"'{tags.adapter}'", param="model")
    wanted = name.adapter or tags.adapter
    if wanted is None:
        return None
    param = "model" if name.adapter else "X-RL-Adapter"
    if ADAPTERS not in app:
        raise APIError(400, f"adapter '{wanted}' was asked for, and this server has no "
                       f"personal adapters ({app.get(ADAPTERS_OFF)})", param=param,
                       code="adapters_off")
    adapters = app[ADAPTERS]
    if name.step is not None and adapters.find(wanted, param) is None and \
            not adapters.on_disk_only(wanted):
        raise APIError(404, f"The model '{wanted}@{name.step}' does not exist: no adapter "
                       f"named '{wanted}'", param=param, code="model_not_found")
    return await adapters.get(wanted, param)


async def saved_checkpoint(app: web.Application, model: str | None, step: int | None,
                           data_dir: Path) -> tuple[str, object] | None:
    """`MODEL@STEP`: the adapter of the kept checkpoint of training step STEP (of DATA_DIR's
    adapter: the default's, or a personal one's), served by name beside the live one
    (serving/saved.py), as (its name, its model object); None for a name without `@STEP`. 404
    where no complete checkpoint of that step is kept."""
    if step is None:
        return None
    if SAVED not in app:  # --sampler tinker: no local weights to serve a checkpoint with
        raise APIError(409, f"'{model}' names a checkpoint, and this server holds no local "
                       "weights (--sampler tinker)", param="model", code="no_local_model")
    path = kept_checkpoint(data_dir / paths.CHECKPOINTS, step)
    if path is not None:
        try:
            return await app[SAVED].model_for(path)
        except FileNotFoundError:  # pruned since it was listed
            pass
        except Exception as e:  # noqa: BLE001  (another model's or layout's adapter)
            raise APIError(409, f"checkpoint {path.name} cannot be served by this model: "
                           f"{type(e).__name__}: {e}", param="model",
                           code="checkpoint_unusable") from None
    have = [p.name for p in complete_checkpoints(data_dir / paths.CHECKPOINTS)]
    raise APIError(404, f"The model '{model}' does not exist: no complete checkpoint of step "
                   f"{step} is kept (kept: {', '.join(have) or 'none'})", param="model",
                   code="model_not_found")


@asynccontextmanager
async def running(call: Call) -> AsyncIterator[Call]:
    """While the dialect writes: a shutdown whose drain ran out interrupts the generation;
    after it, whatever a gone client left running is cancelled, and the call is counted."""
    stopping = call.request.app.get(STOPPING)
    watch = None
    if stopping is not None:  # the shutdown drain ran out: end this request now
        watch = asyncio.ensure_future(stopping.wait())
        watch.add_done_callback(lambda f: f.cancelled() or call.gen.interrupt("shutdown"))
    stalled = False
    try:
        yield call
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
    """Run every choice to its end for a non-streamed response; all events, in order (a
    generation that did not end raises its APIError)."""
    events = []
    async for ev in call.events():
        if isinstance(ev, Failed):
            raise ev.error
        events.append(ev)
        transport = call.request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("client went away")
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
