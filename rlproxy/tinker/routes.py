"""The Tinker API's HTTP side: /api/v1/* handlers on the proxy's own app and port.

Every training call answers {"request_id"} at once; its work runs on the Tinker worker thread
(models.py; runs.py binds a new client handle to its run, shared when create_model names one in
user_metadata) and its outcome is fetched through `retrieve_future` (futures.py). A handle's
requests run in `seq_id` order (the SDK sends one forward_backward's chunks in parallel): one that
arrives early is held until those before it have started, or until GAP_S passes (a seq_id the
client never sent). Bad input fails the request's future with category "user"; a name that
would become a path and is not a plain one (state.py's checked_name) is a 400 at once. Auth is
the app's own middleware (any key unless --api-key is set).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from pathlib import Path

from aiohttp import web

from rlproxy import paths
from rlproxy.api.edge import json_response
from rlproxy.appkeys import ENGINE, MODEL, RANKS, SAVED, SETTINGS, TINKER
from rlproxy.mlx_threads import Worker
from rlproxy.ops.health import served_names
from rlproxy.tinker import models, ranks, runs, wire
from rlproxy.tinker.archive import (
    delete_checkpoint, download_checkpoint, external_file, external_urls, list_checkpoints,
)
from rlproxy.tinker.sampling import Samplers, asample
from rlproxy.tinker.state import (
    TinkerState, checked_name, checkpoint_dir, parse_path, read_json, run_name, state,
)
from rlproxy.tinker.wire import UserError

GAP_S = 5.0
log = logging.getLogger(__name__)
PROTOBUF = "application/x-protobuf"


# ---- futures: start work, settle it on the loop ----

def start(st: TinkerState, fn, *args, then=None) -> tuple[str, asyncio.Future]:
    """A new request id whose result is fn(*args) on the worker (then `then(result)`, on the
    loop); also returns a starter for sequencing: call it to hand the work to the worker."""
    rid, fut = st.futures.new()
    loop = asyncio.get_running_loop()

    def go():
        cf = st.worker.run(fn, *args)

        def done(_):
            try:
                value = cf.result()
                st.futures.settle(rid, fut, then(value) if then else value)
            except Exception as e:
                st.futures.settle(rid, fut, error=e)
        cf.add_done_callback(lambda _: loop.call_soon_threadsafe(done, None))
    return rid, go


def user_error(e: UserError) -> web.Response:
    """A 400 in the Tinker API's error shape (the SDK raises it as a BadRequestError)."""
    return json_response({"error": str(e), "category": "user"}, status=400)


def rejected(st: TinkerState, body: dict, e: UserError) -> web.Response:
    """user_error for a request in a model's seq_id order: its place counts as taken, so the
    model's next request does not wait GAP_S for it."""
    tm, seq = st.models.get(body.get("model_id")), body.get("seq_id")
    if tm is not None and isinstance(seq, int) and seq >= tm.next_seq:
        tm.held[seq] = lambda: None
        release(tm)
    return user_error(e)


def new_model_id(body: dict) -> str:
    """"SESSION:train:SEQ" for a create_model or load_weights body; its run folder (state.py's
    run_name) comes from it, so the session id must be a plain name."""
    seq = body.get("model_seq_id", 0)
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise UserError(f"model_seq_id must be a non-negative integer, not {seq!r}")
    model_id = f"{checked_name('session_id', body.get('session_id'))}:train:{seq}"
    run_name(model_id)  # its folder's name must be a plain one too (not too long)
    return model_id


def fail(st: TinkerState, message: str) -> str:
    rid, fut = st.futures.new()
    st.futures.settle(rid, fut, error=UserError(message))
    return rid


def on_live_run(st: TinkerState, fn):
    """fn(tm, *args) on the worker once TM's run is in memory (runs.py may have evicted it),
    marking it used when the request ends too."""
    def run(tm, *args):
        runs.live(st, tm)
        try:
            return fn(tm, *args)
        finally:
            tm.run.last_used = time.monotonic()
    return run


def sequenced(st: TinkerState, model_id: str, seq_id, fn, *args, then=None) -> web.Response:
    """Run fn(tm, *args) on model MODEL_ID's turn in seq_id order. A request is a sign of
    life of its session, and marks its run used from now (a run with requests queued is not
    idle)."""
    tm = st.models.get(model_id)
    if tm is None:
        return json_response({"request_id": fail(st, f"unknown model id {model_id!r} (create it "
                                                 "with create_lora_training_client first)")})
    now = time.monotonic()
    st.seen[model_id.split(":")[0]] = now
    tm.run.last_used = now
    rid, go = start(st, on_live_run(st, fn), tm, *args, then=then)
    if not isinstance(seq_id, int) or seq_id < tm.next_seq:
        go()  # unsequenced or a retry of one already started
    else:
        tm.held[seq_id] = go
        release(tm)
        if tm.held:
            asyncio.get_running_loop().call_later(GAP_S, release, tm, True)
    return json_response({"request_id": rid, "model_id": model_id})


def release(tm: models.TinkerModel, skip_gap: bool = False) -> None:
    if skip_gap and tm.held and tm.next_seq not in tm.held:
        tm.next_seq = min(tm.held)
    while tm.next_seq in tm.held:
        tm.held.pop(tm.next_seq)()
        tm.next_seq += 1


# ---- session and service ----

async def empty(request):
    return json_response({})


async def create_session(request):
    sid = uuid.uuid4().hex[:12]
    state(request).seen[sid] = time.monotonic()
    return json_response({"type": "create_session", "session_id": sid})


async def heartbeat(request):
    """The SDK's heartbeat (every 10 s): the session is alive (runs.py expires silent ones)."""
    sid = (await read_json(request)).get("session_id")
    if isinstance(sid, str):
        state(request).seen[sid] = time.monotonic()
    return json_response({})


async def telemetry(request):
    return json_response({"status": "accepted"})


async def healthz(request):
    return json_response({"status": "ok"})


async def capabilities(request):
    loaded = state(request).loaded
    return json_response({"supported_models": [
        {"model_name": name, "max_context_length": loaded.context_length, "trainable": True,
         "sampleable": True} for name in served_names(request.app)]})


# ---- training ----

async def create_model(request):
    st, body = state(request), await read_json(request)
    if isinstance(body.get("session_id"), str):
        st.seen[body["session_id"]] = time.monotonic()
    base = body.get("base_model")
    if base not in served_names(request.app):
        return json_response({"request_id": fail(st, f"unknown base_model {base!r}; this server "
                                                 f"trains {', '.join(served_names(request.app))}")})
    try:
        model_id = new_model_id(body)
    except UserError as e:
        return user_error(e)
    lora = body.get("lora_config") or {}
    try:
        rank = int(lora.get("rank", 8))
        name = (body.get("user_metadata") or {}).get(runs.RUN_KEY)
        if name is not None:
            checked_name(f"user_metadata {runs.RUN_KEY}", name)
    except (TypeError, ValueError) as e:  # UserError is a ValueError
        return user_error(e if isinstance(e, UserError) else UserError(f"lora rank: {e}"))
    rid, go = start(st, runs.attach, st, model_id, name, base, rank, lora.get("seed"),
                    then=lambda _: {"model_id": model_id, "type": "create_model"})
    go()
    return json_response({"request_id": rid, "model_id": model_id})


async def get_info(request):
    st, body = state(request), await read_json(request)
    tm = st.models.get(body.get("model_id"))
    if tm is None:
        return json_response({"error": f"unknown model id {body.get('model_id')!r}",
                              "category": "user"}, status=404)
    name = served_names(request.app)[0]
    return json_response({"type": "get_info", "model_id": tm.model_id, "is_lora": True,
                          "lora_rank": tm.run.rank,
                          "model_name": name,
                          "model_data": {"model_name": name, "tokenizer_id": st.loaded.source,
                                         "arch": type(st.loaded.model).__module__}})


async def forward_backward(request):
    st = state(request)
    if request.headers.get("Content-Encoding", "identity") not in ("identity", ""):
        raise web.HTTPUnsupportedMediaType(text="compressed bodies are not accepted; this "
                                           "server's client config leaves compression off")
    raw = await request.read()
    try:
        if PROTOBUF not in request.content_type:
            raise UserError("send forward_backward as protobuf (application/x-protobuf), as "
                            "the tinker SDK does")
        req = wire.decode_forward_backward(raw)
    except UserError as e:
        return json_response({"request_id": fail(st, str(e))})
    loaded = st.loaded

    def run(tm, req):
        out, metrics = models.forward_backward(tm, req, loaded.vocab_size, loaded.context_length,
                                               st.compute)
        if not req["forward_only"]:
            st.forward_backward += 1
        return wire.encode_forward_backward(out, metrics)
    return sequenced(st, req["model_id"], req["seq_id"], run, req)


async def optim_step(request):
    st, body = state(request), await read_json(request)
    params = body.get("adam_params") or body.get("optim_params") or {}

    def step(tm, params):
        answer = models.optim_step(tm, params, st.compute)
        st.optim_steps += 1
        return answer
    return sequenced(st, body.get("model_id"), body.get("seq_id"), step, params)


async def save_weights(request):
    st, body = state(request), await read_json(request)
    tm = st.models.get(body.get("model_id"))
    try:
        path = checkpoint_dir(st, tm.run.name if tm else "-", "weights", body.get("path"))
    except UserError as e:
        return rejected(st, body, e)
    uri = f"tinker://{path.parent.parent.name}/weights/{path.name}"
    return sequenced(st, body.get("model_id"), body.get("seq_id"), models.save, path, True,
                     then=lambda _: {"path": uri, "type": "save_weights"})


async def save_for_sampler(request):
    st, body = state(request), await read_json(request)
    tm = st.models.get(body.get("model_id"))
    name = body.get("path")
    ephemeral = name is None
    if ephemeral:
        name = f"ephemeral-{body.get('sampling_session_seq_id', 0)}-{uuid.uuid4().hex[:6]}"
    try:
        path = checkpoint_dir(st, tm.run.name if tm else "-", "sampler_weights", name)
    except UserError as e:
        return rejected(st, body, e)
    uri = f"tinker://{path.parent.parent.name}/sampler_weights/{path.name}"

    def answer(_):
        if not ephemeral:
            return {"path": uri, "type": "save_weights_for_sampler"}
        sid = f"{body.get('model_id')}:sample:{body.get('sampling_session_seq_id', 0)}"
        st.samplers.open(sid, path, uri)
        return {"sampling_session_id": sid, "type": "save_weights_for_sampler"}
    return sequenced(st, body.get("model_id"), body.get("seq_id"), models.save, path, False,
                     then=answer)


async def save_weights_external(request):
    """The run's current adapter in rlproxy's own mlx-lm layout under external_weights/NAME,
    for a replica to download (archive.py's external_urls lists its files)."""
    st, body = state(request), await read_json(request)
    tm = st.models.get(body.get("model_id"))
    try:
        path = checkpoint_dir(st, tm.run.name if tm else "-", "external_weights",
                              body.get("path"))
    except UserError as e:
        return rejected(st, body, e)
    uri = f"tinker://{path.parent.parent.name}/external_weights/{path.name}"

    def answer(_):
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        return {"path": uri, "size_bytes": size, "type": "save_weights_external"}
    return sequenced(st, body.get("model_id"), body.get("seq_id"), models.save, path, False,
                     then=answer)


async def load_weights(request):
    st, body = state(request), await read_json(request)
    try:
        path = parse_path(st, body.get("path"))
        model_id = body.get("model_id") or new_model_id(body)  # or create-via-load
    except UserError as e:
        return rejected(st, body, e)
    try:
        rank = models.config_of(path)["lora_parameters"]["rank"]
    except (OSError, KeyError, ValueError):
        return json_response({"request_id": fail(st, f"no saved weights at {body.get('path')!r}")})
    with_opt = bool(body.get("optimizer"))
    answer = {"path": body.get("path"), "type": "load_weights"}
    if body.get("model_id"):
        return sequenced(st, model_id, body.get("seq_id"), models.load, path, with_opt,
                         then=lambda _: answer)
    rid, go = start(st, runs.attach_loaded, st, model_id, rank, path, with_opt,
                    then=lambda _: answer)
    go()
    return json_response({"request_id": rid, "model_id": model_id})


# ---- sampling ----

async def create_sampling_session(request):
    st, body = state(request), await read_json(request)
    sid = f"{body.get('session_id')}:sample:{body.get('sampling_session_seq_id', 0)}"
    if body.get("model_path"):
        try:
            path = parse_path(st, body["model_path"])
        except UserError as e:
            return user_error(e)
        st.samplers.open(sid, path, body["model_path"])
    elif body.get("base_model") in served_names(request.app):
        st.samplers.open(sid, None, None)  # the proxy's live adapter
    else:
        return json_response({"error": f"unknown base_model {body.get('base_model')!r}",
                              "category": "user"}, status=400)
    return json_response({"type": "create_sampling_session", "sampling_session_id": sid})


async def get_sampler(request):
    st, sid = state(request), request.match_info["sampler_id"]
    found = st.samplers.sessions.get(sid)
    if found is None:
        return json_response({"error": f"unknown sampler {sid!r}", "category": "user"}, status=404)
    return json_response({"sampler_id": sid, "base_model": served_names(request.app)[0],
                          "model_path": found["model_path"]})


async def sample(request):
    st, body = state(request), await read_json(request)
    rid, fut = st.futures.new()
    n = body.get("num_samples") or 1

    async def run():
        try:
            sequences, prompt_lps = await asample(st.samplers, body)
            st.futures.settle(rid, fut, wire.encode_sample(sequences, prompt_lps))
        except UserError as e:
            log.warning("asample %s (sampler %s) refused: %s", rid,
                        body.get("sampling_session_id"), e)
            st.futures.settle(rid, fut, error=e)
        except Exception as e:  # the client sees the message; the log keeps the traceback
            log.error("asample %s (sampler %s) failed: %s: %s", rid,
                      body.get("sampling_session_id"), type(e).__name__, e, exc_info=e)
            st.futures.settle(rid, fut, error=e)
    task = asyncio.create_task(run())
    st.tasks.add(task)
    task.add_done_callback(st.tasks.discard)
    ids = [f"{rid}:{i}" for i in range(n if isinstance(n, int) and n > 0 else 1)]
    return json_response({"request_id": rid, "sample_sequence_ids": ids})


# ---- results ----

async def retrieve_future(request):
    st, body = state(request), await read_json(request)
    rid = body.get("request_id")
    try:
        result = await st.futures.wait(rid)
    except KeyError:
        return json_response({"error": f"request {rid!r} is unknown or expired",
                              "category": "user"}, status=410)
    if result is None:
        return json_response({"type": "try_again", "request_id": rid, "queue_state": "active"})
    if isinstance(result, bytes):
        return web.Response(body=result, content_type=PROTOBUF)
    return json_response(result)


async def finish_session(request):
    """The client closed: drop its handles and sampling sessions (runs.py's detach: a named run
    stays; saved weights stay on disk)."""
    st, sid = state(request), request.match_info["session_id"]
    st.seen.pop(sid, None)
    await asyncio.wrap_future(st.worker.run(runs.detach, st, sid))
    for sampler in [s for s in st.samplers.sessions if s.startswith(f"{sid}:")]:
        del st.samplers.sessions[sampler]
    return json_response({})


# ---- wiring ----

async def tinker_context(app: web.Application):
    settings = app[SETTINGS]
    loaded, engine = app[MODEL], app[ENGINE]
    worker = Worker()
    samplers = Samplers(loaded, engine, worker, app[SAVED])
    app[TINKER] = TinkerState(loaded, Path(settings.records.data_dir) / paths.TINKER,
                              settings.server.tinker_max_models, worker, samplers)
    if RANKS in app:  # under mlx.launch: every rank computes a share of each batch
        app[TINKER].compute = functools.partial(ranks.value_grads, app[RANKS])
    yield
    await asyncio.get_running_loop().run_in_executor(None, worker.stop)


async def missing_sdk(request):
    return json_response({"error": "the Tinker API needs the tinker SDK's protobuf schema: pip "
                          "install 'rlproxy[tinker]'", "category": "server"}, status=501)


def add_tinker_routes(app: web.Application) -> None:
    """Register /api/v1/* (before the app's catch-all 404) and the worker's lifetime."""
    settings = app[SETTINGS]
    if settings.server.tinker_max_models <= 0 or settings.remote.sampler == "tinker":
        return  # off, or no local weights to train or sample (--sampler tinker)
    routes = [
        ("POST", "client/config", empty), ("POST", "client/dynamic_config", empty),
        ("POST", "create_session", create_session), ("POST", "session_heartbeat", heartbeat),
        ("POST", "telemetry", telemetry), ("GET", "get_server_capabilities", capabilities),
        ("GET", "healthz", healthz), ("POST", "sessions/{session_id}/finish", finish_session),
        ("POST", "create_model", create_model), ("POST", "get_info", get_info),
        ("POST", "forward_backward", forward_backward), ("POST", "optim_step", optim_step),
        ("POST", "save_weights", save_weights), ("POST", "load_weights", load_weights),
        ("POST", "save_weights_for_sampler", save_for_sampler),
        ("POST", "create_sampling_session", create_sampling_session),
        ("GET", "samplers/{sampler_id}", get_sampler), ("POST", "asample", sample),
        ("POST", "retrieve_future", retrieve_future),
        ("GET", "training_runs/{model_id}/checkpoints", list_checkpoints),
        ("GET", "training_runs/{run}/checkpoints/{kind}/{name}/archive", download_checkpoint),
        ("DELETE", "training_runs/{run}/checkpoints/{kind}/{name}", delete_checkpoint),
        ("POST", "save_weights_external", save_weights_external),
        ("GET", "training_runs/{run}/checkpoints/external_weights/{name}/external_weights_urls",
         external_urls),
        ("GET", "training_runs/{run}/checkpoints/external_weights/{name}/files/{file}",
         external_file),
    ]
    sdk = wire.schema() is not None
    for method, path, handler in routes:
        app.router.add_route(method, f"/api/v1/{path}", handler if sdk else missing_sdk)
    if sdk:
        app.cleanup_ctx.append(tinker_context)
