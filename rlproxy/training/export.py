"""`rlproxy export`: a learned adapter written for other tools.

The source is the adapter a running server serves now (a checkpoint it writes on demand:
`POST /v1/checkpoints`; the server on `--data-dir` is found by its lock, or named by `--url`),
else a data dir's newest checkpoint (or `--step N`), or an adapter folder in mlx-lm's or
PEFT's layout (`--adapter`); the base model is `--model`, else the one the checkpoint was
trained on. Four formats:
- peft: `adapter_model.safetensors` + `adapter_config.json` as Hugging Face PEFT writes them, for
  vLLM's `--lora-modules` and `PeftModel.from_pretrained` (serving/peft.py converts);
- mlx: mlx-lm's layout, for `mlx_lm.load(..., adapter_path=)`, `mlx_lm.fuse`, `serve --adapter`;
- fused: the adapter merged into the base weights (checkpoints.fuse), a plain mlx-lm model;
- gguf: the fused model as one float16 GGUF file (llama.cpp, Ollama, `serve --model x.gguf`).
Every format first checks that the adapter fits the base model (the same check `serve
--adapter` makes), so a mismatch is one line and exit status 2, not a file that fails elsewhere.
An adapter trained under `--context-length` past the base's window learned on YaRN-scaled
positions: the window comes from the checkpoint's settings (or `--context-length`), the fused
and GGUF models carry the scaling, and a peft/mlx export says the base must be served with it.

This module writes files only; it serves and trains nothing.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from argparse import Namespace
from pathlib import Path

import mlx.core as mx

from rlproxy.paths import (CHECKPOINTS, TRAINER_STATE, complete_checkpoints, kept_checkpoint,
                           serving_url)
from rlproxy.serving import peft
from rlproxy.settings import load_settings

# The Hugging Face repository of each named model, for PEFT's base_model_name_or_path.
HF_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
# What mlx-lm's own GGUF writer (mlx_lm.gguf, SentencePiece vocabularies) supports.
MLX_GGUF_TYPES = ("llama", "mistral", "mixtral")


class ExportError(ValueError):
    """The export cannot be done; the message says what to change (the CLI prints one line)."""


def export_cmd(args: Namespace) -> int:
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out} exists and is not an empty folder: name a new one")
    folder, trained = adapter_source(args)
    model = args.model or trained.get("model") or load_settings({}).model.model
    written = export(folder, model, args.format, out,
                     context_length=args.context_length or trained.get("context_length"))
    print(f"{args.format} export of {folder} (base {model}) written to {written}")
    return 0


def adapter_source(args: Namespace) -> tuple[Path, dict]:
    """(the adapter folder, the model settings it was trained with when a checkpoint says so:
    `model`, `context_length`; else {})."""
    if args.adapter:
        if args.step is not None:
            raise ExportError("--step picks a checkpoint of a --data-dir; with --adapter, "
                              "name the folder itself")
        folder = Path(args.adapter)
        if not folder.is_dir():
            raise ExportError(f"--adapter {folder}: no such folder")
        return folder, {}
    data_dir = load_settings({"data_dir": args.data_dir, "model": args.model}).records.data_dir
    root = data_dir / CHECKPOINTS
    url = args.url or serving_url(data_dir)
    if args.step is None and url:  # a server is running: the adapter it serves now
        folder = Path(checkpoint_now(url, args.api_key or os.environ.get("RLPROXY_API_KEY")))
        return folder, trained_settings(folder)
    kept = complete_checkpoints(root)
    if args.step is not None:
        folder = kept_checkpoint(root, args.step)
        if folder is None:
            raise ExportError(f"no complete checkpoint for step {args.step} in {root} (kept: "
                              f"{', '.join(p.name for p in kept) or 'none'})")
    elif kept:
        folder = kept[-1]
    else:
        raise ExportError(f"no checkpoint in {root}, and no server running on it: nothing has "
                          "been trained there yet (with the server running, export asks it "
                          "for the adapter it serves; or name a folder with --adapter)")
    return folder, trained_settings(folder)


def trained_settings(folder: Path) -> dict:
    """The model settings a checkpoint was trained with (`model`, `context_length`), or {}."""
    try:
        trained = json.loads((folder / TRAINER_STATE).read_text())["settings"]["model"]
    except (OSError, ValueError, KeyError, TypeError):
        trained = {}
    return trained if isinstance(trained, dict) else {}


def checkpoint_now(url: str, api_key: str | None) -> str:
    """Ask the server at URL to checkpoint the adapter it serves now (`POST /v1/checkpoints`);
    the folder it wrote. ExportError, one line, when it cannot."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url.rstrip("/") + "/v1/checkpoints", data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {api_key}"}
                                             if api_key else {})})
    try:
        with urllib.request.urlopen(req, timeout=330) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = f"HTTP {e.code}"
        raise ExportError(f"the server at {url} did not write a checkpoint: {message}") from None
    except (OSError, ValueError) as e:
        raise ExportError(f"the server at {url} did not answer ({e}); stop it and export "
                          "its newest checkpoint, or try again") from None
    print(f"the server at {url} wrote checkpoint {body['path']} (step {body['step']}, adapter "
          f"version {body['adapter_version']}; it serves version {body['served_version']})",
          file=sys.stderr)
    return body["path"]


def export(folder: Path, model: str, fmt: str, out: Path, dequantize: str = "auto",
           context_length: int | None = None) -> Path:
    from rlproxy.serving.model import context_window, read_config, resolve_source

    source = resolve_source(model, dequantize)
    base = local_folder(source.path)
    config = read_config(str(base))
    context, overrides = context_window(config, context_length)
    weights, lora_config = mlx_adapter(folder, config["num_hidden_layers"])
    check_fits(base, weights, lora_config, overrides)
    if overrides and fmt in ("mlx", "peft"):
        print(f"warning: this adapter was trained on a {context:,}-token window, YaRN-scaled "
              f"from the base's {config['max_position_embeddings']:,}: serve the base with the "
              f"same RoPE scaling (`rlproxy serve --context-length {context}`; elsewhere "
              f"rope_scaling {json.dumps(overrides['rope_scaling'])})", file=sys.stderr)
    if fmt == "mlx":
        return peft.write_mlx(out, weights, lora_config)
    if fmt == "peft":
        check_peft_names(config["model_type"])
        return peft.write_peft(out, *peft.to_peft(weights, lora_config, base_name(
            model, source.path), config["num_hidden_layers"]))
    with tempfile.TemporaryDirectory(prefix="rlproxy-export-") as tmp:
        adapter_dir = peft.write_mlx(Path(tmp) / "adapter", weights, lora_config)
        if fmt == "fused":
            return fused(base, adapter_dir, out, overrides)
        gguf_file = source_gguf(model)
        if gguf_file is None and config["model_type"] not in MLX_GGUF_TYPES:
            raise ExportError(
                f"GGUF export supports bases loaded from a GGUF file (e.g. the default "
                f"smollm2-135m-instruct, or --model file.gguf; architectures llama, qwen2, "
                f"qwen3) and, through mlx-lm's converter, {', '.join(MLX_GGUF_TYPES)} models; "
                f"this base is a {config['model_type']!r} model from {source.origin}")
        model_dir = fused(base, adapter_dir, Path(tmp) / "fused", overrides, dequantize=True)
        out.mkdir(parents=True, exist_ok=True)
        target = out / f"{Path(source.model_id).name}-rlproxy-f16.gguf"
        if gguf_file is not None:
            write_gguf_like(gguf_file, model_dir, target)
        else:
            from mlx_lm.gguf import convert_to_gguf

            convert_to_gguf(model_dir, model_weights(model_dir), read_config(str(model_dir)),
                            str(target))
        if overrides:
            scale_gguf(target, overrides)
            print("note: llama.cpp reads the YaRN scaling from the file; rlproxy's own GGUF "
                  "loader refuses scaled files (serve the fused export instead)", file=sys.stderr)
        return target


def local_folder(path_or_id: str) -> Path:
    """The base model's folder on disk; a hub id is fetched once (the files mlx-lm loads), so the
    config, the fit check and the fuse all read the same files."""
    if Path(path_or_id).is_dir():
        if not (Path(path_or_id) / "config.json").is_file():
            raise ExportError(f"--model {path_or_id}: no config.json there (not an mlx-lm or "
                              "Hugging Face model folder)")
        return Path(path_or_id)
    from huggingface_hub import snapshot_download
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        return Path(snapshot_download(path_or_id, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except (OSError, ValueError) as e:  # offline, no such repo, a malformed id: all end here
        why = " ".join(str(e).split())
        raise ExportError(f"--model {path_or_id}: not a folder here, and the Hugging Face hub "
                          f"did not give it ({why[:300]}); check the network and the id, or name "
                          "a local mlx-lm model folder") from None


def model_weights(model_dir: Path) -> dict[str, mx.array]:
    """Every weight of an mlx-lm model folder: mlx-lm's save shards big models into
    model-0000N-of-0000M.safetensors."""
    weights = {}
    for file in sorted(model_dir.glob("model*.safetensors")):
        weights.update(mx.load(str(file)))
    return weights


def check_peft_names(model_type: str) -> None:
    if model_type not in peft.SAME_NAMES:
        raise ExportError(f"PEFT export writes Hugging Face module names, checked equal to "
                          f"mlx-lm's for {', '.join(peft.SAME_NAMES)}; this base model is "
                          f"{model_type!r}")


def base_name(model: str, path: str) -> str:
    """PEFT's base_model_name_or_path: the Hugging Face id where known, else the local folder."""
    return HF_IDS.get(model) or (str(Path(path).resolve()) if Path(path).exists() else model)


def mlx_adapter(folder: Path, num_blocks: int) -> tuple[dict[str, mx.array], dict]:
    """FOLDER's adapter in mlx-lm's form, whichever layout it is stored in."""
    weights, config = peft.read_adapter(folder)
    if peft.is_peft_dir(folder):
        return peft.from_peft(weights, config, num_blocks)
    return weights, config


def check_fits(model_dir: Path, weights: dict[str, mx.array], lora_config: dict,
               overrides: dict | None = None) -> None:
    """The adapter loads onto the base model (built with OVERRIDES, its RoPE scaling), by `serve
    --adapter`'s own loader (on a lazily loaded model: only shapes are read, no weights)."""
    from mlx_lm.utils import load_model

    from rlproxy.serving.model import load_adapter

    model, _ = load_model(Path(model_dir), lazy=True, model_config=overrides or {})
    with tempfile.TemporaryDirectory(prefix="rlproxy-export-") as tmp:
        load_adapter(model, str(peft.write_mlx(Path(tmp), weights, lora_config)))


def fused(model_dir: Path, adapter_dir: Path, out: Path, overrides: dict,
          dequantize: bool = False) -> Path:
    """The fused model, its config.json carrying OVERRIDES (the RoPE scaling the adapter was
    trained under; it changes no weight, so the merge itself does not need it)."""
    from rlproxy.training.checkpoints import fuse

    fuse(str(model_dir), adapter_dir, out, dequantize=dequantize)
    if overrides:
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, **overrides}, indent=4))
    return out


def scale_gguf(target: Path, overrides: dict) -> None:
    """The YaRN scaling in TARGET's metadata, under llama.cpp's keys (`<arch>.rope.scaling.*`)."""
    weights, meta = mx.load(str(target), return_metadata=True)
    arch = str(meta["general.architecture"])
    scaling = overrides["rope_scaling"]
    meta.update({
        f"{arch}.context_length": mx.array(overrides["max_position_embeddings"], dtype=mx.uint32),
        f"{arch}.rope.scaling.type": "yarn",
        f"{arch}.rope.scaling.factor": mx.array(scaling["factor"], dtype=mx.float32),
        f"{arch}.rope.scaling.original_context_length": mx.array(
            scaling["original_max_position_embeddings"], dtype=mx.uint32)})
    mx.save_gguf(str(target), weights, meta)


def source_gguf(model: str) -> Path | None:
    """The GGUF file the base model was converted from, if it was."""
    from rlproxy.serving.model_fetch import NAMED_MODELS, named_model_file

    if model in NAMED_MODELS:
        return named_model_file(model)
    if model.lower().endswith(".gguf"):
        return Path(model)
    return None


def write_gguf_like(original: Path, model_dir: Path, target: Path) -> Path:
    """MODEL_DIR's weights (a fused, dequantized model of ORIGINAL's architecture) in a GGUF file
    that keeps ORIGINAL's metadata (vocabulary, merges, chat template, sizes): the inverse of
    serving/gguf.py's conversion. Matrices float16, norms float32, as llama.cpp's converter."""
    from rlproxy.serving import gguf

    _, meta = mx.load(str(original), return_metadata=True)
    config = json.loads((model_dir / "config.json").read_text())
    weights = model_weights(model_dir)
    if config["model_type"] == "llama":  # llama.cpp's row order of Q and K, as in the file
        permute_qk(weights, config)
    block = {v: k for k, v in gguf.BLOCK_NAMES.items()}
    top = {v: k for k, v in gguf.TOP_NAMES.items()}
    out = {}
    for name, w in weights.items():
        module, suffix = name.rsplit(".", 1)
        parts = module.split(".", 3)
        if module in top:
            key = f"{top[module]}.{suffix}"
        elif parts[:2] == ["model", "layers"] and parts[3] in block:
            key = f"blk.{parts[2]}.{block[parts[3]]}.{suffix}"
        else:
            raise ExportError(f"{name}: no GGUF name for this tensor")
        out[key] = w.astype(mx.float16 if w.ndim == 2 else mx.float32)
    meta = {k: v for k, v in meta.items() if k != "general.file_type"}
    meta["general.file_type"] = mx.array(1, dtype=mx.uint32)  # llama.cpp: MOSTLY_F16
    mx.save_gguf(str(target), out, meta)
    return target


def permute_qk(weights: dict, config: dict) -> None:
    """The inverse of serving/gguf.py's `unpermute_qk`: per head, the two RoPE halves of Q's and
    K's rows interleaved again, as llama.cpp's llama files hold them."""
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for name in list(weights):
        match = re.fullmatch(r"model\.layers\.\d+\.self_attn\.([qk]_proj)\.weight", name)
        if match:
            w, n = weights[name], heads[match.group(1)]
            weights[name] = (w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:])
                             .swapaxes(1, 2).reshape(w.shape))
