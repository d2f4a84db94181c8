"""GET handlers for a Tinker run's saved checkpoints: the listing, one checkpoint's directory as
a .tar.gz download, and an external_weights checkpoint's files one by one (the URLs that
`RestClient.get_external_weights_urls` answers, and the route each URL names). Saving and
loading are routes.py's (through the worker).

The file URLs are absolute, built from the request's scheme and host (X-Forwarded-Proto and
X-Forwarded-Host when a proxy such as nginx sets them), and sit behind the app's auth middleware
like every other route: a client fetching them sends its key, as the SDK does. They are not
signed and do not expire; `expires` is only there because the SDK's response type requires it.
"""

from __future__ import annotations

import asyncio
import io
import shutil
import tarfile
import uuid
from datetime import datetime, timedelta, timezone

from aiohttp import web

from rlproxy.api.edge import json_response
from rlproxy.tinker.state import KINDS, checked_name, checkpoint_dir, run_name, state
from rlproxy.tinker.wire import UserError


async def list_checkpoints(request):
    """GET training_runs/{model_id}/checkpoints: what this run saved, newest last."""
    st, model_id = state(request), request.match_info["model_id"]
    tm = st.models.get(model_id)
    try:
        run = tm.run.name if tm else model_id if model_id in st.runs else run_name(model_id)
    except UserError as e:
        return json_response({"error": str(e), "category": "user"}, status=400)
    out = []
    for kind in KINDS:
        for p in sorted((st.root / run / kind).glob("*"), key=lambda p: p.stat().st_mtime):
            if (p / "adapters.safetensors").exists():
                out.append({"checkpoint_id": f"{kind}/{p.name}", "checkpoint_type":
                            {"weights": "training", "sampler_weights": "sampler"}.get(
                                kind, "external"),
                            "tinker_path": f"tinker://{run}/{kind}/{p.name}",
                            "size_bytes": sum(f.stat().st_size for f in p.iterdir())})
    return json_response({"checkpoints": out})


def saved_folder(request, kind: str | None = None):
    """(the checkpoint folder the route names, None), or (None, its 400 or 404 answer)."""
    run, kind = request.match_info["run"], kind or request.match_info["kind"]
    try:
        path = checkpoint_dir(state(request), run, kind, request.match_info["name"])
    except UserError as e:
        return None, json_response({"error": str(e), "category": "user"}, status=400)
    if not path.is_dir():
        return None, json_response({"error": f"no {kind} {path.name!r} in run {run!r}",
                                    "category": "user"}, status=404)
    return path, None


async def delete_checkpoint(request):
    """DELETE training_runs/{run}/checkpoints/{kind}/{name}: the saved folder, gone (RestClient.
    delete_checkpoint). 404 when there is none."""
    path, error = saved_folder(request)
    if error is not None:
        return error
    trash = path.with_name(f".deleted-{path.name}-{uuid.uuid4().hex[:8]}")
    path.rename(trash)  # out of every listing at once; the bytes go in the executor
    await asyncio.get_running_loop().run_in_executor(None, shutil.rmtree, trash, True)
    return json_response({})


async def download_checkpoint(request):
    """GET training_runs/{run}/checkpoints/{kind}/{name}/archive: the directory as a .tar.gz."""
    path, error = saved_folder(request)
    if error is not None:
        return error

    def pack() -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            tar.add(path, arcname=path.name)
        return buf.getvalue()
    data = await asyncio.get_running_loop().run_in_executor(None, pack)
    return web.Response(body=data, content_type="application/gzip", headers={
        "Content-Disposition": f'attachment; filename="{path.name}.tar.gz"'})


URLS_VALID = timedelta(hours=1)  # what `expires` says; nothing enforces it


def external_folder(request):
    """(the checkpoint's folder, None) or (None, an error answer)."""
    return saved_folder(request, "external_weights")


def origin(request) -> str:
    """scheme://host as the client reached us, through a proxy's forwarded headers if any."""
    scheme = request.headers.get("X-Forwarded-Proto", request.scheme).split(",")[0].strip()
    host = request.headers.get("X-Forwarded-Host", request.host).split(",")[0].strip()
    return f"{scheme}://{host}"


async def external_urls(request):
    """GET training_runs/{run}/checkpoints/external_weights/{name}/external_weights_urls:
    {"urls": {file: absolute URL}, "expires": ISO time}."""
    path, error = external_folder(request)
    if error is not None:
        return error
    base = (f"{origin(request)}/api/v1/training_runs/{request.match_info['run']}/checkpoints/"
            f"external_weights/{path.name}/files")
    files = sorted(f.name for f in path.iterdir() if f.is_file())
    expires = datetime.now(timezone.utc) + URLS_VALID
    return json_response({"urls": {f: f"{base}/{f}" for f in files},
                          "expires": expires.isoformat()})


async def external_file(request):
    """GET .../external_weights/{name}/files/{file}: one file's bytes."""
    path, error = external_folder(request)
    if error is not None:
        return error
    try:
        name = checked_name("file", request.match_info["file"])
    except UserError as e:
        return json_response({"error": str(e), "category": "user"}, status=400)
    if not (path / name).is_file():
        return json_response({"error": f"no file {name!r} in {path.name!r}",
                              "category": "user"}, status=404)
    return web.FileResponse(path / name, headers={"Content-Type": "application/octet-stream"})
