"""A training run's weights, brought back from the Tinker service and fitted to the local model.

The SDK's public way out is `save_weights_external(name)` then `RestClient.
get_external_weights_urls(path)`: one URL per file. An rlproxy learner answers with its own
mlx-lm layout (adapters.safetensors); the hosted service with Hugging Face PEFT's
(adapter_model.safetensors), converted by serving/peft.py. Either way the adapter must have the
local serving model's LoRA layout (the same modules and ranks); its scale is carried over by
rescaling lora_b, and a module the run does not train gets lora_b = 0 (it adds nothing).
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import mlx.core as mx

from rlproxy.remote.service import LearnerRefused, LearnerUnavailable, call, resolve
from rlproxy.serving.peft import PeftError, from_peft, is_peft_dir, read_adapter
from rlproxy.training.checkpoints import layout_mismatch


class WeightsMisfit(LearnerRefused):
    """The run's adapter does not fit the local model (another model, rank or modules)."""


@dataclass
class Fetched:
    weights: dict[str, mx.array]  # by the local LoRA parameter names, evaluated
    path: str  # the tinker:// path they were saved under
    nbytes: int  # bytes downloaded
    seconds: float


def download(urls: dict[str, str], folder: Path, key: str, base_url: str | None,
             timeout: float) -> int:
    """Each file of URLS into FOLDER; the bytes. The API key goes only to the service's own
    host (an rlproxy learner), never to a storage host's signed URL."""
    import httpx
    own = urlsplit(base_url).netloc if base_url else None
    total = 0
    with httpx.Client(timeout=timeout, follow_redirects=True) as client:
        for rel, url in urls.items():
            target = (folder / rel).resolve()
            if not target.is_relative_to(folder.resolve()):
                raise WeightsMisfit(f"the service named a file outside its checkpoint: {rel!r}")
            headers = {"X-API-Key": key} if own and urlsplit(url).netloc == own else {}
            r = client.get(url, headers=headers)
            if r.status_code in (401, 403):
                raise LearnerRefused(f"downloading {rel}: the service refused the key "
                                     f"({r.status_code})")
            r.raise_for_status()
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(r.content)
            total += len(r.content)
    return total


def fit(weights: dict[str, mx.array], config: dict, current: dict[str, mx.array],
        scale: float, num_blocks: int) -> dict[str, mx.array]:
    """WEIGHTS (either layout's, as read with CONFIG) as the local adapter: CURRENT's names and
    shapes, at the local SCALE. WeightsMisfit when they cannot be."""
    try:
        if "peft_type" in config:
            weights, config = from_peft(weights, config, num_blocks)
    except PeftError as e:
        raise WeightsMisfit(f"the run's adapter does not load: {e}") from None
    theirs = float(config.get("lora_parameters", {}).get("scale", scale))
    extra = sorted(set(weights) - set(current))
    if extra:
        raise WeightsMisfit(f"the run trains {extra[0]}, which the local model has no LoRA "
                            "layer for (match --lora-layers / --lora-keys to the run's)")
    out = {}
    for name, now in current.items():
        w = weights.get(name)
        if w is None:  # not trained by the run: lora_b = 0 adds nothing
            w = mx.zeros_like(now) if name.endswith("lora_b") else now
        elif name.endswith("lora_b") and theirs != scale:
            w = w * (theirs / scale)
        out[name] = w.astype(now.dtype)
    problem = layout_mismatch(current, out)
    if problem:
        raise WeightsMisfit(f"the run's adapter does not fit the local model: {problem} "
                            "(another base model, or another --lora-rank)")
    mx.eval(out)
    return out


def fetch(training_client, rest_client, name: str, key: str, base_url: str | None,
          timeout: float, current: dict[str, mx.array], scale: float,
          num_blocks: int) -> Fetched:
    """Save the run's weights as NAME on the service, download and fit them."""
    tic = time.perf_counter()
    saved = resolve(training_client.save_weights_external(name), timeout, "save weights")
    urls = resolve(rest_client.get_external_weights_urls(saved.path), timeout,
                   "weights URLs").urls
    with tempfile.TemporaryDirectory(prefix="rlproxy-sync-") as tmp:
        folder = Path(tmp)
        try:
            nbytes = call(lambda: download(urls, folder, key, base_url, timeout), timeout,
                          "download weights")
        except LearnerUnavailable:
            raise
        if not (is_peft_dir(folder) or (folder / "adapters.safetensors").is_file()):
            raise WeightsMisfit(f"the service's files ({', '.join(sorted(urls))}) hold no "
                                "adapter in mlx-lm's or PEFT's layout")
        try:
            weights, config = read_adapter(folder)
        except PeftError as e:
            raise WeightsMisfit(str(e)) from None
        weights = fit(weights, config, current, scale, num_blocks)
    return Fetched(weights, saved.path, nbytes, time.perf_counter() - tic)


def adapter_config_of(folder: Path) -> dict:
    return json.loads((Path(folder) / "adapter_config.json").read_text())
