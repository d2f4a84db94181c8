"""The operator's actions: serve an older checkpoint (rollback), pause and resume training,
and hand out a checkpoint as a .zip (mlx-lm's layout, or PEFT's).

`POST /v1/adapters/{step}/serve`, `POST /v1/training/pause`, `POST /v1/training/resume`, all
behind the API key, and the same handlers under /ui/api/ for the dashboard's buttons (sent with
its cookie), beside `GET /ui/api/adapters/{step}.zip` and `{step}.peft.zip`: `add_routes` mounts
them all. With the trainer running, a rollback is done by the trainer on its own thread (its
arrays live there: `Trainer.rollback`), which publishes the checkpoint as a new adapter version
and trains on from it. With training off (`--no-train`) the checkpoint's adapter goes to the
engine directly. Either way the action is a line in training.jsonl.

Sent with `X-RL-Adapter: NAME`, each action acts on that personal adapter (pipeline.py
`Adapters`): its trainer, its checkpoints in <data_dir>/adapters/NAME/, its version in the engine
(`Target`). Serving a checkpoint with training off is the default adapter's only: a personal
adapter's kept checkpoint is served read-only as `MODEL:NAME@STEP`.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from rlproxy import paths
from rlproxy.api.edge import json_response
from rlproxy.api.tags import adapter_header
from rlproxy.appkeys import ADAPTERS, ADAPTERS_OFF, ENGINE, MODEL, SETTINGS, STARTED, TRAINER
from rlproxy.paths import complete_checkpoints, kept_checkpoint
from rlproxy.protocol import APIError, shown
from rlproxy.records import JsonlWriter, read_jsonl

ROLLBACK_TIMEOUT_S = 300.0  # the trainer finishes the step in progress first


@dataclass
class Target:
    """What an action acts on: the default adapter, or the personal adapter X-RL-Adapter
    names."""
    data_dir: Path
    engine: object  # the engine, or the personal adapter's place in it (serving/personal.py)
    trainer: object | None
    personal: str | None = None


async def target_of(request: web.Request) -> Target:
    app, name = request.app, adapter_header(request.headers)
    if name is None:
        return Target(app[SETTINGS].records.data_dir, app[ENGINE], app.get(TRAINER))
    adapters = app.get(ADAPTERS)
    if adapters is None:
        raise APIError(400, f"X-RL-Adapter names '{name}', and this server has no personal "
                       f"adapters ({app.get(ADAPTERS_OFF)})", param="X-RL-Adapter",
                       code="adapters_off")
    personal = adapters.find(name, "X-RL-Adapter")
    if personal is None and adapters.on_disk_only(name):  # brought back from disk
        personal = await adapters.get(name, "X-RL-Adapter")
    if personal is None:
        raise APIError(404, f"no adapter named '{name}'", param="X-RL-Adapter",
                       code="adapter_not_found")
    personal.used = time.monotonic()  # an action counts as use: not let go of meanwhile
    return Target(personal.data_dir, personal.served, personal.pipeline.trainer, name)


def checkpoint_dir(target: Target) -> Path:
    return target.data_dir / paths.CHECKPOINTS


def step_of(raw: str) -> int:
    if not re.fullmatch(r"[0-9]{1,9}", raw):  # not int(): it takes "²", " 1", "1_0"
        raise APIError(400, f"step must be an integer, not {shown(raw)}", param="step")
    return int(raw)


def find_checkpoint(target: Target, raw: str) -> Path:
    step = step_of(raw)
    path = kept_checkpoint(checkpoint_dir(target), step)
    if path is None:
        raise not_kept(target, step)
    return path


def not_kept(target: Target, step: int) -> APIError:
    have = [p.name for p in complete_checkpoints(checkpoint_dir(target))]
    return APIError(404, f"no complete checkpoint for step {step} (kept: "
                    f"{', '.join(have) or 'none'}; --keep-checkpoints keeps more)", param="step",
                    code="checkpoint_not_found")


async def wait_served(engine, version: int, timeout_s: float = 30.0) -> None:
    """Until the engine has applied VERSION (it does so between two decode steps)."""
    deadline = time.monotonic() + timeout_s
    while engine.adapter_version < version and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


async def serve_adapter(request: web.Request) -> web.Response:
    app, target = request.app, await target_of(request)
    path = find_checkpoint(target, request.match_info["step"])  # 400 or 404 first, as ever
    engine, trainer = target.engine, target.trainer
    if trainer is not None:
        if not trainer.alive:
            raise APIError(503, f"the trainer is not running: {trainer.error}",
                           type="server_error")
        # loaded where training is on
        from rlproxy.training.control import CheckpointGone, RollbackSuperseded
        from rlproxy.training.learner import LearnerUnavailable

        step = step_of(request.match_info["step"])
        try:  # the trainer finds and pins it again: no save prunes it before the load
            line = await trainer_rollback(trainer, step)
        except CheckpointGone:
            raise not_kept(target, step) from None
        except RollbackSuperseded as e:  # a later request won: nothing to report here
            raise APIError(409, f"{e}; this request was not applied",
                           code="rollback_superseded") from None
        except APIError:
            raise
        except LearnerUnavailable as e:  # --trainer tinker: the learner is away, not the file
            raise APIError(503, f"the rollback needs the learner, which did not answer: {e}; "
                           "nothing changed, try again", type="server_error",
                           code="learner_unavailable", headers={"Retry-After": "5"}) from None
        except Exception as e:  # e.g. a checkpoint of another LoRA layout: nothing changed
            raise unusable(path, e) from None
    elif target.personal is not None:
        raise APIError(409, f"training is off (--no-train): adapter {target.personal}'s "
                       f"checkpoints are served read-only, as MODEL:{target.personal}@STEP",
                       code="training_off")
    else:
        no_local_model(app)
        try:
            line = publish_checkpoint(app, target, path)
        except Exception as e:
            raise unusable(path, e) from None
    await wait_served(engine, line["adapter_version"])
    return json_response({"object": "adapter.rollback", **line,
                          "served_version": int(engine.adapter_version)})


async def trainer_rollback(trainer, step: int) -> dict:
    """The trainer's rollback line. Past the timeout a request the trainer has not taken is
    withdrawn (503: nothing changed); one it is applying is awaited (that takes moments)."""
    future = trainer.request_rollback(step)
    wrapped = asyncio.wrap_future(future)
    try:  # shield: a timeout must not cancel a rollback the trainer may be applying
        return await asyncio.wait_for(asyncio.shield(wrapped), ROLLBACK_TIMEOUT_S)
    except asyncio.TimeoutError:
        if future.cancel():  # only while not taken: the trainer then drops it
            raise APIError(503, "the trainer did not take the rollback within "
                           f"{ROLLBACK_TIMEOUT_S:.0f} s (a long step in progress); it was "
                           "withdrawn and nothing changed: try again",
                           type="server_error") from None
    return await wrapped


def no_local_model(app: web.Application) -> None:
    """409 where the action needs local weights and --sampler tinker has none."""
    if app[MODEL].model is None:
        raise APIError(409, "this server holds no local weights (--sampler tinker): roll the run "
                       "back with --trainer tinker, or download from the learner",
                       code="no_local_model")


def unusable(path: Path, e: Exception) -> APIError:
    return APIError(409, f"checkpoint {path.name} cannot be served by this model: "
                    f"{type(e).__name__}: {e}", code="checkpoint_unusable")


def publish_checkpoint(app: web.Application, target: Target, path: Path) -> dict:
    """Training is off: hand the checkpoint's adapter to the engine as a new version. Runs on
    the event loop's thread, where the models were loaded (a small adapter loads in ms)."""
    import mlx.core as mx

    from rlproxy.serving.model import lora_weights
    from rlproxy.training.checkpoints import layout_mismatch

    engine = app[ENGINE]
    weights = mx.load(str(path / "adapters.safetensors"))
    problem = layout_mismatch(lora_weights(engine.model), weights)  # shapes only: no compute
    if problem:
        raise ValueError(f"another model or LoRA layout than this one ({problem})")
    mx.eval(weights)  # concrete before the engine thread sees it
    state = json.loads((path / paths.TRAINER_STATE).read_text())
    # the handler waits for it before answering; above every version recorded, so a restarted
    # server (its engine back at 0) never reuses one that turns and steps already carry
    version = max(engine.adapter_version, recorded_version(target)) + 1
    engine.publish_adapter(weights, version)
    line = {"kind": "rollback", "step": state["step"], "adapter_version": version,
            "checkpoint": str(path), "checkpoint_step": state["step"],
            "checkpoint_adapter_version": state["adapter_version"], "training": False,
            "time": time.time()}
    writer = JsonlWriter(app[SETTINGS].records.data_dir / paths.TRAINING,
                         fsync=app[SETTINGS].records.fsync)
    writer.write(line)
    writer.close()
    return line


def recorded_version(target: Target) -> int:
    """The highest adapter version training.jsonl and the checkpoints name (0: none)."""
    versions = [ln.get("adapter_version") for ln in read_jsonl(target.data_dir / paths.TRAINING)]
    for path in complete_checkpoints(checkpoint_dir(target)):
        try:
            versions.append(json.loads((path / paths.TRAINER_STATE).read_text())[
                "adapter_version"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a damaged checkpoint names nothing
    return max((v for v in versions if isinstance(v, int)), default=0)


async def save_checkpoint(request: web.Request) -> web.Response:
    """A checkpoint of the adapter served now, written on demand (`rlproxy export` against a
    running server, the dashboard's button): the save interval does not decide when a user
    can take their adapter. With training off, the checkpoint already served is named."""
    app, target = request.app, await target_of(request)
    engine, trainer = target.engine, target.trainer
    if trainer is None and target.personal is not None:
        raise APIError(409, "training is off (--no-train): a personal adapter serves its newest "
                       "checkpoint as it is (or the base), nothing new to save",
                       code="nothing_trained")
    if trainer is None:
        path = served_checkpoint(app)
        if path is None:
            raise APIError(409, "this server serves the base model, no adapter (--no-train with "
                           "no checkpoint in its data dir, or --adapter base): nothing to save",
                           code="nothing_trained")
        state = read_state(path)
        return json_response({"object": "checkpoint", "step": state.get("step"),
                              "adapter_version": int(engine.adapter_version), "path": str(path),
                              "served_version": int(engine.adapter_version)})
    if trainer.step == 0:
        raise APIError(409, "no optimizer step yet: the served adapter is still the base "
                       "model's (the dashboard and `rlproxy status` say how many turns the "
                       "first step waits for)", code="nothing_trained")
    if not trainer.alive:
        raise APIError(503, f"the trainer is not running: {trainer.error}", type="server_error")
    future = trainer.request_save()
    try:  # the step in progress finishes first
        line = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)),
                                      ROLLBACK_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise APIError(503, f"the trainer did not save within {ROLLBACK_TIMEOUT_S:.0f} s (a long "
                       "step in progress); try again", type="server_error") from None
    except Exception as e:  # a full disk, a learner elsewhere that is away
        raise APIError(503, f"the checkpoint could not be saved: {type(e).__name__}: {e}",
                       type="server_error") from None
    return json_response({"object": "checkpoint", **line,
                          "served_version": int(engine.adapter_version)})


def served_checkpoint(app: web.Application) -> Path | None:
    """With training off: the checkpoint the engine serves, the last one an operator served
    (training.jsonl's last `rollback` line with training off), else --adapter's; None: the base."""
    lines = [ln for ln in read_jsonl(app[SETTINGS].records.data_dir / paths.TRAINING)
             if ln.get("kind") == "rollback" and ln.get("training") is False
             and ln.get("time", 0) >= app[STARTED]]
    if lines and Path(lines[-1]["checkpoint"]).is_dir():
        return Path(lines[-1]["checkpoint"])
    adapter = app[SETTINGS].model.adapter
    return Path(adapter) if adapter else None


def read_state(path: Path) -> dict:
    try:
        state = json.loads((path / paths.TRAINER_STATE).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


async def the_trainer(request: web.Request):
    trainer = (await target_of(request)).trainer
    if trainer is None:
        raise APIError(409, "training is off (--no-train): there is nothing to pause or resume",
                       code="training_off")
    return trainer


async def pause_training(request: web.Request) -> web.Response:
    trainer = await the_trainer(request)
    await asyncio.to_thread(trainer.pause)  # its line is fsynced: not on the event loop
    return json_response({"object": "training", "paused": True, "step": trainer.step})


async def resume_training(request: web.Request) -> web.Response:
    trainer = await the_trainer(request)
    await asyncio.to_thread(trainer.unpause)
    return json_response({"object": "training", "paused": False, "step": trainer.step})


async def download(request: web.Request) -> web.Response:
    """A checkpoint as a .zip: the adapter in mlx-lm's format plus the trainer's state."""
    path = find_checkpoint(await target_of(request), request.match_info["step"])

    def pack() -> bytes:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
            for name in ("adapters.safetensors", paths.ADAPTER_CONFIG, paths.TRAINER_STATE):
                z.write(path / name, f"{path.name}/{name}")
        return buf.getvalue()

    try:
        body = await asyncio.get_running_loop().run_in_executor(None, pack)
    except FileNotFoundError:  # pruned by --keep-checkpoints between the lookup and the read
        raise APIError(404, f"checkpoint {path.name} was removed meanwhile", param="step",
                       code="checkpoint_not_found") from None
    return web.Response(body=body, content_type="application/zip", headers={
        "Content-Disposition": f'attachment; filename="rlproxy-adapter-{path.name}.zip"'})


async def download_peft(request: web.Request) -> web.Response:
    """A checkpoint's adapter in Hugging Face PEFT's layout (vLLM, peft), as a .zip. Converted
    and evaluated on the event loop's thread, where the models live (MLX arrays are made and
    evaluated where a stream is; a LoRA adapter converts in ms); written and zipped on a pool
    thread, as download's .zip."""
    no_local_model(request.app)
    import mlx.core as mx

    from rlproxy.serving import peft
    from rlproxy.serving.model import lora_weights
    from rlproxy.training.checkpoints import layout_mismatch
    from rlproxy.training.export import ExportError, base_name, check_peft_names

    app = request.app
    path = find_checkpoint(await target_of(request), request.match_info["step"])
    loaded = app[MODEL]
    try:
        weights, lora_config = peft.read_adapter(path)
    except peft.PeftError as e:
        if not path.exists():  # pruned by --keep-checkpoints after the lookup
            raise APIError(404, f"checkpoint {path.name} was removed meanwhile", param="step",
                           code="checkpoint_not_found") from None
        raise APIError(409, f"checkpoint {path.name} cannot be read: {e}",
                       code="checkpoint_unreadable") from None
    problem = layout_mismatch(lora_weights(loaded.model), weights)
    if problem:
        raise unusable(path, ValueError(f"another model or LoRA layout ({problem})"))
    try:
        check_peft_names(loaded.model.model_type)
    except ExportError as e:
        raise APIError(409, str(e), code="peft_unsupported") from None
    converted, config = peft.to_peft(weights, lora_config, base_name(
        app[SETTINGS].model.model, loaded.source), len(loaded.model.layers))
    mx.eval(converted)

    def pack() -> bytes:
        with tempfile.TemporaryDirectory(prefix="rlproxy-peft-") as tmp:
            folder = peft.write_peft(Path(tmp) / path.name, converted, config)
            buf = io.BytesIO()
            with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
                for name in (peft.PEFT_WEIGHTS, paths.ADAPTER_CONFIG):
                    z.write(folder / name, f"{path.name}-peft/{name}")
            return buf.getvalue()

    body = await asyncio.get_running_loop().run_in_executor(None, pack)
    return web.Response(body=body, content_type="application/zip", headers={
        "Content-Disposition": f'attachment; filename="rlproxy-adapter-{path.name}-peft.zip"'})


def add_routes(app: web.Application) -> None:
    for prefix in ("/v1", "/ui/api"):  # the API key, or the dashboard's cookie
        app.router.add_post(prefix + "/adapters/{step}/serve", serve_adapter)
        app.router.add_post(prefix + "/training/pause", pause_training)
        app.router.add_post(prefix + "/training/resume", resume_training)
        app.router.add_post(prefix + "/checkpoints", save_checkpoint)
    # before the .zip route, whose {step} would take "3.peft" (and answer 400)
    app.router.add_get("/ui/api/adapters/{step}.peft.zip", download_peft)
    app.router.add_get("/ui/api/adapters/{step}.zip", download)
