"""GET handlers for a Tinker run's saved checkpoints: the listing, and one checkpoint's
directory as a .tar.gz download. Saving and loading are routes.py's (through the worker).
"""

from __future__ import annotations

import asyncio
import io
import tarfile

from aiohttp import web

from rlproxy.api.edge import json_response
from rlproxy.tinker.state import KINDS, checkpoint_dir, run_name, state
from rlproxy.tinker.wire import UserError


async def list_checkpoints(request):
    """GET training_runs/{model_id}/checkpoints: what this run saved, newest last."""
    st, model_id = state(request), request.match_info["model_id"]
    tm = st.models.get(model_id)
    try:
        run = tm.run if tm else run_name(model_id)
    except UserError as e:
        return json_response({"error": str(e), "category": "user"}, status=400)
    out = []
    for kind in KINDS:
        for p in sorted((st.root / run / kind).glob("*"), key=lambda p: p.stat().st_mtime):
            if (p / "adapters.safetensors").exists():
                out.append({"checkpoint_id": f"{kind}/{p.name}", "checkpoint_type":
                            "training" if kind == "weights" else "sampler",
                            "tinker_path": f"tinker://{run}/{kind}/{p.name}",
                            "size_bytes": sum(f.stat().st_size for f in p.iterdir())})
    return json_response({"checkpoints": out})


async def download_checkpoint(request):
    """GET training_runs/{run}/checkpoints/{kind}/{name}/archive: the directory as a .tar.gz."""
    st = state(request)
    try:
        path = checkpoint_dir(st, request.match_info["run"], request.match_info["kind"],
                              request.match_info["name"])
    except UserError as e:
        return json_response({"error": str(e), "category": "user"}, status=400)
    if not path.is_dir():
        return json_response({"error": "no such checkpoint", "category": "user"}, status=404)

    def pack() -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            tar.add(path, arcname=path.name)
        return buf.getvalue()
    data = await asyncio.get_running_loop().run_in_executor(None, pack)
    return web.Response(body=data, content_type="application/gzip", headers={
        "Content-Disposition": f'attachment; filename="{path.name}.tar.gz"'})
