"""`rlproxy export`: a learned adapter written for other tools.

The source is a data dir's newest checkpoint (or `--step N`) or an adapter folder in mlx-lm's or
PEFT's layout (`--adapter`); the base model is `--model`, else the one the checkpoint was
trained on. Four formats:
- peft: `adapter_model.safetensors` + `adapter_config.json` as Hugging Face PEFT writes them, for
  vLLM's `--lora-modules` and `PeftModel.from_pretrained` (serving/peft.py converts);
- mlx: mlx-lm's layout, for `mlx_lm.load(..., adapter_path=)`, `mlx_lm.fuse`, `serve --adapter`;
- fused: the adapter merged into the base weights (checkpoints.fuse), a plain mlx-lm model;
- gguf: the fused model as one float16 GGUF file (llama.cpp, Ollama, `serve --model x.gguf`).
Every format first checks that the adapter fits the base model (the same check `serve
--adapter` makes), so a mismatch is one line and exit status 2, not a file that fails elsewhere.

This module writes files only; it serves and trains nothing.
"""

from __future__ import annotations

import json
import re
import tempfile
from argparse import Namespace
from pathlib import Path

import mlx.core as mx

from rlproxy.paths import CHECKPOINTS, TRAINER_STATE, complete_checkpoints, kept_checkpoint
from rlproxy.serving import peft
from rlproxy.settings import load_settings

# The Hugging Face repository of each named model, for PEFT's base_model_name_or_path.
HF_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
# What mlx-lm's own GGUF writer (mlx_lm.gguf, SentencePiece vocabularies) supports.
MLX_GGUF_TYPES = ("llama", "mistral", "mixtral")


class ExportError(ValueError):
    """The export cannot be done; the message says what to change (the CLI prints one line)."""


def export_cmd(args: Namespace) -> int:
    folder, trained_on = adapter_source(args)
    model = args.model or trained_on or load_settings({}).model.model
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out} exists and is not an empty folder: name a new one")
    written = export(folder, model, args.format, out)
    print(f"{args.format} export of {folder} (base {model}) written to {written}")
    return 0


def adapter_source(args: Namespace) -> tuple[Path, str | None]:
    """(the adapter folder, the model it was trained on when a checkpoint says so)."""
    if args.adapter:
        if args.step is not None:
            raise ExportError("--step picks a checkpoint of a --data-dir; with --adapter, "
                              "name the folder itself")
        folder = Path(args.adapter)
        if not folder.is_dir():
            raise ExportError(f"--adapter {folder}: no such folder")
        return folder, None
    data_dir = load_settings({"data_dir": args.data_dir}).records.data_dir
    root = data_dir / CHECKPOINTS
    kept = complete_checkpoints(root)
    if args.step is not None:
        folder = kept_checkpoint(root, args.step)
        if folder is None:
            raise ExportError(f"no complete checkpoint for step {args.step} in {root} (kept: "
                              f"{', '.join(p.name for p in kept) or 'none'})")
    elif kept:
        folder = kept[-1]
    else:
        raise ExportError(f"no checkpoint in {root}: train first, or name an adapter folder "
                          "with --adapter")
    try:
        trained_on = json.loads((folder / TRAINER_STATE).read_text())["settings"]["model"]["model"]
    except (OSError, ValueError, KeyError, TypeError):
        trained_on = None
    return folder, trained_on


def export(folder: Path, model: str, fmt: str, out: Path, dequantize: str = "auto") -> Path:
    from mlx_lm.utils import load_config

    from rlproxy.serving.model import resolve_source

    source = resolve_source(model, dequantize)
    config = load_config(Path(source.path))
    weights, lora_config = mlx_adapter(folder, config["num_hidden_layers"])
    check_fits(source.path, weights, lora_config)
    if fmt == "mlx":
        return peft.write_mlx(out, weights, lora_config)
    if fmt == "peft":
        check_peft_names(config["model_type"])
        return peft.write_peft(out, *peft.to_peft(weights, lora_config, base_name(
            model, source.path), config["num_hidden_layers"]))
    with tempfile.TemporaryDirectory(prefix="rlproxy-export-") as tmp:
        adapter_dir = peft.write_mlx(Path(tmp) / "adapter", weights, lora_config)
        if fmt == "fused":
            return fused(source.path, adapter_dir, out)
        gguf_file = source_gguf(model)
        if gguf_file is None and config["model_type"] not in MLX_GGUF_TYPES:
            raise ExportError(
                f"GGUF export supports bases loaded from a GGUF file (e.g. the default "
                f"smollm2-135m-instruct, or --model file.gguf; architectures llama, qwen2, "
                f"qwen3) and, through mlx-lm's converter, {', '.join(MLX_GGUF_TYPES)} models; "
                f"this base is a {config['model_type']!r} model from {source.origin}")
        model_dir = fused(source.path, adapter_dir, Path(tmp) / "fused", dequantize=True)
        out.mkdir(parents=True, exist_ok=True)
        target = out / f"{Path(source.model_id).name}-rlproxy-f16.gguf"
        if gguf_file is not None:
            write_gguf_like(gguf_file, model_dir, target)
        else:
            from mlx_lm.gguf import convert_to_gguf

            convert_to_gguf(model_dir, dict(mx.load(str(model_dir / "model.safetensors"))),
                            load_config(model_dir), str(target))
        return target


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


def check_fits(model_path: str, weights: dict[str, mx.array], lora_config: dict) -> None:
    """The adapter loads onto the base model, by `serve --adapter`'s own loader (on a lazily
    loaded model: only shapes are read, no weights)."""
    from mlx_lm.utils import load_model

    from rlproxy.serving.model import load_adapter

    model, _ = load_model(Path(model_path), lazy=True)
    with tempfile.TemporaryDirectory(prefix="rlproxy-export-") as tmp:
        load_adapter(model, str(peft.write_mlx(Path(tmp), weights, lora_config)))


def fused(model_path: str, adapter_dir: Path, out: Path, dequantize: bool = False) -> Path:
    from rlproxy.training.checkpoints import fuse

    return fuse(model_path, adapter_dir, out, dequantize=dequantize)


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
    weights = dict(mx.load(str(model_dir / "model.safetensors")))
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
