"""LoRA adapters in Hugging Face PEFT's layout, to and from mlx-lm's: pure functions over weights.

PEFT (what `peft`'s `save_pretrained` writes and vLLM's LoRA loading reads) keeps
`adapter_model.safetensors` with keys `base_model.model.<HF module>.lora_A.weight` of shape
(r, in) and `lora_B.weight` (out, r), and `adapter_config.json` with `r`, `lora_alpha`,
`target_modules`, `layers_to_transform` ... mlx-lm keeps `adapters.safetensors` with
`<module>.lora_a` (in, r) and `lora_b` (r, out), and `adapter_config.json` with `num_layers` (the
last N blocks) and `lora_parameters` {rank, scale, keys}. Both compute base(x) + s * B(A(x)), with
s = scale in mlx-lm and lora_alpha / r in PEFT, so a conversion transposes and sets
lora_alpha = scale * r. Module paths are the same in both for the architectures in SAME_NAMES
(mlx-lm loads their Hugging Face weights by name; checked against peft's own output in
tests/data/peft/).

Knows nothing of models or serving: `serving/model.py` loads a converted adapter, `training/
export.py` and the dashboard's download (api/admin.py) write one.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import mlx.core as mx

from rlproxy.paths import ADAPTER_CONFIG

PEFT_WEIGHTS = "adapter_model.safetensors"
MLX_WEIGHTS = "adapters.safetensors"
PREFIX = "base_model.model."  # PeftModel wraps the *ForCausalLM model: its keys start so
# model_type values whose mlx-lm module paths equal Hugging Face's (model.layers.N.self_attn...)
SAME_NAMES = ("llama", "mistral", "qwen2", "qwen3")
MLX_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)\.lora_([ab])")
PEFT_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight")
# Settings that change what the weights mean and mlx-lm's LoRALinear cannot do.
UNSUPPORTED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save (full-weight copies)",
               "rank_pattern": "a rank_pattern (ranks per module)",
               "alpha_pattern": "an alpha_pattern (alphas per module)",
               "lora_bias": "lora_bias", "layer_replication": "layer_replication",
               "trainable_token_indices": "trainable_token_indices"}


class PeftError(ValueError):
    """An adapter that cannot be converted; the message says why, in one line."""


def to_peft(weights: dict[str, mx.array], lora_config: dict, base_model: str,
            num_blocks: int) -> tuple[dict[str, mx.array], dict]:
    """mlx-lm adapter weights + config -> PEFT's (weights, adapter_config). NUM_BLOCKS is the
    base model's block count: `layers_to_transform` is written only when fewer are adapted."""
    if lora_config.get("fine_tune_type", "lora") != "lora":
        raise PeftError(f"only LoRA adapters convert to PEFT, not "
                        f"{lora_config['fine_tune_type']!r}")
    params = lora_config["lora_parameters"]
    out, modules, layers = {}, set(), set()
    for name, w in weights.items():
        m = MLX_KEY.fullmatch(name)
        if not m:
            raise PeftError(f"{name}: not a LoRA weight of a transformer block "
                            "(model.layers.N.<module>.lora_a|lora_b)")
        layers.add(int(m[1]))
        modules.add(m[2].rsplit(".", 1)[-1])  # peft's own form: the module's last name
        out[f"{PREFIX}model.layers.{m[1]}.{m[2]}.lora_{m[3].upper()}.weight"] = w.T
    rank = int(params["rank"])
    alpha = float(params["scale"]) * rank  # peft scales by lora_alpha / r
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": int(alpha) if alpha.is_integer() else alpha,
        "lora_dropout": float(params.get("dropout", 0.0)), "target_modules": sorted(modules),
        "layers_to_transform": (None if layers == set(range(num_blocks)) else sorted(layers)),
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "inference_mode": True,
    }
    return out, config


def from_peft(weights: dict[str, mx.array], config: dict,
              num_blocks: int) -> tuple[dict[str, mx.array], dict]:
    """PEFT's (weights, adapter_config) -> mlx-lm's (weights, adapter_config) for a base model
    of NUM_BLOCKS blocks. Whether the shapes fit that model is checked where it is loaded."""
    if config.get("peft_type") != "LORA":
        raise PeftError(f"peft_type {config.get('peft_type')!r}: only LORA adapters load")
    for key, what in UNSUPPORTED.items():
        if config.get(key):
            raise PeftError(f"this PEFT adapter uses {what}, which mlx-lm's LoRA cannot apply")
    if config.get("bias", "none") != "none":
        raise PeftError(f"bias {config['bias']!r}: only bias 'none' adapters load")
    if config.get("fan_in_fan_out"):
        raise PeftError("fan_in_fan_out adapters (GPT-2 style Conv1D bases) do not load")
    rank = int(config["r"])
    # rsLoRA scales by alpha / sqrt(r): the same product, another divisor
    scale = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
    out, modules, layers = {}, set(), set()
    for name, w in weights.items():
        m = PEFT_KEY.fullmatch(name.removeprefix(PREFIX))
        if not m:
            raise PeftError(f"{name}: not a LoRA weight of a transformer block "
                            f"({PREFIX}model.layers.N.<module>.lora_A|lora_B.weight)")
        block = int(m[1])
        if block >= num_blocks:
            raise PeftError(f"{name}: block {block}, but the base model has {num_blocks} blocks "
                            "(an adapter for another model)")
        if w.ndim != 2 or w.shape[0 if m[3] == "A" else 1] != rank:
            raise PeftError(f"{name}: shape {tuple(w.shape)} does not have rank r={rank}")
        layers.add(block)
        modules.add(m[2])
        out[f"model.layers.{m[1]}.{m[2]}.lora_{m[3].lower()}"] = w.T
    if not out:
        raise PeftError("the adapter holds no LoRA weights")
    # mlx-lm adapts the last num_layers blocks: from the first adapted one on. Modules and
    # blocks PEFT left out get lora_b = 0 there, which adds nothing, as in PEFT.
    lora_config = {"fine_tune_type": "lora", "num_layers": num_blocks - min(layers),
                   "lora_parameters": {"rank": rank, "scale": scale,
                                       "dropout": float(config.get("lora_dropout") or 0.0),
                                       "keys": sorted(modules)}}
    return out, lora_config


def is_peft_dir(folder: Path) -> bool:
    """A folder in PEFT's layout: its adapter_config.json has a peft_type (mlx-lm's has none),
    whichever weights file is beside it."""
    folder = Path(folder)
    if not (folder / ADAPTER_CONFIG).is_file():
        return False
    try:
        return "peft_type" in json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError):
        return False


def read_adapter(folder: Path) -> tuple[dict[str, mx.array], dict]:
    """(weights, adapter_config) of a folder in either layout, as stored."""
    folder = Path(folder)
    is_peft = is_peft_dir(folder)
    weights = folder / (PEFT_WEIGHTS if is_peft else MLX_WEIGHTS)
    if is_peft and not weights.is_file():
        found = ", ".join(sorted(p.name for p in folder.glob("adapter_model*"))) or "none"
        raise PeftError(f"{folder}: a PEFT adapter without {PEFT_WEIGHTS} (weights files: "
                        f"{found}); only safetensors load: save it with "
                        "save_pretrained(..., safe_serialization=True)")
    if not weights.is_file() or not (folder / ADAPTER_CONFIG).is_file():
        raise PeftError(f"{folder}: not an adapter folder (no {MLX_WEIGHTS} or {PEFT_WEIGHTS} "
                        f"beside an {ADAPTER_CONFIG})")
    try:
        return mx.load(str(weights)), json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError, RuntimeError) as e:
        raise PeftError(f"{folder}: unreadable adapter: {e}") from None


def write_peft(folder: Path, weights: dict[str, mx.array], config: dict) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # "format": "pt" as peft writes it: transformers' loaders look for it
    mx.save_safetensors(str(folder / PEFT_WEIGHTS), weights, metadata={"format": "pt"})
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return folder


def write_mlx(folder: Path, weights: dict[str, mx.array], lora_config: dict) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / MLX_WEIGHTS), weights)
    (folder / ADAPTER_CONFIG).write_text(json.dumps(lora_config, indent=2))
    return folder
