"""The operator's actions: serve an older checkpoint (rollback), pause and resume training.

`POST /v1/adapters/{step}/serve`, `POST /v1/training/pause`, `POST /v1/training/resume`, all
behind the API key; the dashboard's buttons call the same handlers. With the trainer running, a
rollback is done by the trainer on its own thread (its arrays live there: `Trainer.rollback`),
which publishes the checkpoint as a new adapter version and trains on from it. With training
off (`--no-train`) the checkpoint's adapter goes to the engine directly. Either way the action
is a line in training.jsonl.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from aiohttp import web

from rlproxy.api.turns import json_response
from rlproxy.appkeys import ENGINE, SETTINGS, TRAINER
from rlproxy.checkpoints import complete_checkpoints
from rlproxy.protocol import APIError
from rlproxy.records import JsonlWriter

TRAINING = "training.jsonl"  # trainer.TRAINING
ROLLBACK_TIMEOUT_S = 300.0  # the trainer finishes the step in progress first


def checkpoint_dir(app: web.Application) -> Path:
    return app[SETTINGS].records.data_dir / "checkpoints"


def find_checkpoint(app: web.Application, raw: str) -> Path:
    try:
        step = int(raw)
    except ValueError:
        raise APIError(400, f"step must be an integer, not {raw!r}", param="step") from None
    for path in complete_checkpoints(checkpoint_dir(app)):
        if path.name == f"step_{step:06d}":
            return path
    have = [p.name for p in complete_checkpoints(checkpoint_dir(app))]
    raise APIError(404, f"no complete checkpoint for step {step} (kept: "
                   f"{', '.join(have) or 'none'}; --keep-checkpoints keeps more)", param="step",
                   code="checkpoint_not_found")


async def wait_served(engine, version: int, timeout_s: float = 30.0) -> None:
    """Until the engine has applied VERSION (it does so between two decode steps)."""
    deadline = time.monotonic() + timeout_s
    while engine.adapter_version < version and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


async def serve_adapter(request: web.Request) -> web.Response:
    app = request.app
    path = find_checkpoint(app, request.match_info["step"])
    engine, trainer = app[ENGINE], app.get(TRAINER)
    if trainer is not None:
        if not trainer.alive:
            raise APIError(503, f"the trainer is not running: {trainer.error}",
                           type="server_error")
        future = trainer.request_rollback(path)
        try:
            line = await asyncio.wait_for(asyncio.wrap_future(future), ROLLBACK_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise APIError(503, "the trainer did not take the rollback within "
                           f"{ROLLBACK_TIMEOUT_S:.0f} s; it will still apply it",
                           type="server_error") from None
        except Exception as e:  # e.g. a checkpoint of another LoRA layout: nothing changed
            raise unusable(path, e) from None
    else:
        try:
            line = publish_checkpoint(app, path)
        except Exception as e:
            raise unusable(path, e) from None
    await wait_served(engine, line["adapter_version"])
    return json_response({"object": "adapter.rollback", **line,
                          "served_version": int(engine.adapter_version)})


def unusable(path: Path, e: Exception) -> APIError:
    return APIError(409, f"checkpoint {path.name} cannot be served by this model: "
                    f"{type(e).__name__}: {e}", code="checkpoint_unusable")


def publish_checkpoint(app: web.Application, path: Path) -> dict:
    """Training is off: hand the checkpoint's adapter to the engine as a new version. Runs on
    the event loop's thread, where the models were loaded (a small adapter loads in ms)."""
    import json

    import mlx.core as mx

    engine = app[ENGINE]
    weights = mx.load(str(path / "adapters.safetensors"))
    mx.eval(weights)  # concrete before the engine thread sees it
    state = json.loads((path / "trainer_state.json").read_text())
    version = engine.adapter_version + 1  # the handler waits for it before answering
    engine.publish_adapter(weights, version)
    line = {"kind": "rollback", "step": state["step"], "adapter_version": version,
            "checkpoint": str(path), "checkpoint_step": state["step"],
            "checkpoint_adapter_version": state["adapter_version"], "training": False,
            "time": time.time()}
    writer = JsonlWriter(app[SETTINGS].records.data_dir / TRAINING,
                         fsync=app[SETTINGS].records.fsync)
    writer.write(line)
    writer.close()
    return line


def the_trainer(app: web.Application):
    trainer = app.get(TRAINER)
    if trainer is None:
        raise APIError(409, "training is off (--no-train): there is nothing to pause or resume",
                       code="training_off")
    return trainer


async def pause_training(request: web.Request) -> web.Response:
    trainer = the_trainer(request.app)
    trainer.pause()
    return json_response({"object": "training", "paused": True, "step": trainer.step})


async def resume_training(request: web.Request) -> web.Response:
    trainer = the_trainer(request.app)
    trainer.unpause()
    return json_response({"object": "training", "paused": False, "step": trainer.step})
