"""GGUF files as mlx-lm model directories: converted once, keyed by the file's hash, reused after.

`mx.load` reads a GGUF file natively: its tensors (Q4_0, Q4_1 and Q8_0 blocks arrive already in
MLX's affine quantized layout, group size 32) and its metadata (architecture, sizes, vocabulary,
merges, chat template). This module turns both into an ordinary directory (`config.json`,
`model.safetensors`, `tokenizer.json` + `tokenizer_config.json`, `generation_config.json`) that
`mlx_lm.load` opens, so a GGUF model is served, trained and fused by the same code as any other.
The weights written are the file's own values, equal to llama.cpp's `gguf.quants.dequantize`:
tensors that mx.load gives inexactly are read from the file's blocks instead.

It owns the conversion only: finding a file by model name is `rlproxy.model_fetch`, loading is
`rlproxy.model`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path

from rlproxy.serving.model_fetch import build_once

log = logging.getLogger(__name__)

# Bump when the conversion changes what is written: old directories are then left unused.
CONVERTER_VERSION = 2  # 2: weights exactly as in the file (v1 rounded through float16)
ARCHITECTURES = ("llama", "qwen2", "qwen3")
# GGUF's quantized blocks that mx.load reads hold 32 weights each (Q4_0, Q4_1, Q8_0).
GGUF_GROUP_SIZE = 32

# The pre-tokenizer regexes llama.cpp uses for these `tokenizer.ggml.pre` values.
GPT2_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
QWEN2_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
               r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
LLAMA3_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
                r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
PRE_TOKENIZERS = ("smollm", "gpt-2", "default", "qwen2", "llama-bpe")

# GGUF tensor names -> mlx-lm (Hugging Face) names, per block and for the rest.
BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
             "output": "lm_head"}
SUFFIXES = ("weight", "bias", "scales", "biases")


class GGUFError(ValueError):
    """A GGUF file rlproxy cannot serve; the message says what is supported."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def use_dequantized(choice: str) -> bool:
    """--dequantize auto: float weights on the CPU backend, where MLX's quantized kernels were
    measured several times slower; quantized on Metal, where they are the fast path."""
    if choice == "auto":
        import mlx.core as mx

        return not mx.metal.is_available()
    return choice == "yes"


def converted_dir(gguf: Path, dequantize: bool, cache_dir: Path) -> Path:
    """The mlx-lm directory for this GGUF file, converting it on first use."""
    gguf = Path(gguf)
    if not gguf.is_file():
        raise GGUFError(f"no GGUF file at {gguf}")
    kind = "f32" if dequantize else "q"
    path = Path(cache_dir) / f"gguf-{file_sha256(gguf)[:20]}-{kind}-v{CONVERTER_VERSION}"

    def write(tmp: Path) -> None:
        log.info("converting %s into %s (once)", gguf, path)
        convert(gguf, tmp, dequantize)

    return build_once(path, write)


# What mx.load reads: these stay quantized (MLX's affine layout) or are plain floats ...
MX_READS = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")
# ... and these K-quants it dequantizes to float16 while loading.
MX_READS_AS_F16 = ("Q2_K", "Q4_K", "Q6_K")
# Types whose values mx.load does not give as they are in the file, so they are read from the
# file's blocks: BF16 arrives as float16 (1e5 becomes inf, 1e-7 loses bits), the K-quants rounded
# to float16, and Q4_K unlike llama.cpp's decoding besides (measured on random blocks with mlx
# 0.32: every second 32-weight sub-block off, by up to 18).
FROM_BLOCKS = ("BF16",) + MX_READS_AS_F16


def read_gguf(gguf: Path) -> tuple[dict, dict]:
    import mlx.core as mx

    try:
        return mx.load(str(gguf), return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise GGUFError(f"cannot read {gguf.name} ({e}): {unreadable_types(gguf)} "
                        f"mx.load reads tensors of type {', '.join(MX_READS)}, and "
                        f"{', '.join(MX_READS_AS_F16)} as float16; use a file of the model "
                        "quantized as Q4_0, Q8_0 or F16") from e


def unreadable_types(gguf: Path) -> str:
    """Which tensor types in the file mx.load cannot read, read with llama.cpp's own `gguf`
    package (only when mx.load has failed)."""
    from gguf import GGUFReader

    try:
        tensors = GGUFReader(str(gguf)).tensors
    except Exception as e:  # not even its header parses
        return f"it is not a readable GGUF file ({e})."
    found: dict[str, str] = {}
    for t in tensors:
        kind = t.tensor_type.name
        if kind not in MX_READS + MX_READS_AS_F16:
            found.setdefault(kind, t.name)
    if not found:
        return "its tensors are of supported types, but it did not load."
    return "it holds tensors of type " + ", ".join(
        f"{kind} (e.g. {name})" for kind, name in found.items()) + ", which are not supported."


def convert(gguf: Path, out: Path, dequantize: bool) -> None:
    import mlx.core as mx

    weights, meta = read_gguf(gguf)
    read_inexact_from_blocks(gguf, weights, dequantize)
    arch = scalar(meta, "general.architecture")
    if arch is None:
        raise GGUFError(f"{gguf.name} has no general.architecture: it is not a model file")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{gguf.name}: architecture {arch!r} is not supported; rlproxy converts "
                        f"GGUF models of architecture {', '.join(ARCHITECTURES)}")
    config = model_config(meta, arch, weights)
    weights = {mlx_name(k): v for k, v in weights.items()}
    if arch == "llama":
        unpermute_qk(weights, config)
    quantized = sorted(k[:-len(".scales")] for k in weights if k.endswith(".scales"))
    if dequantize:
        dequantize_all(weights, quantized)
        weights = {k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v
                   for k, v in weights.items()}  # float16 K-quants and F16 tensors too
    elif quantized:
        config["quantization"] = quantization_config(weights, quantized)
    save_model_dir(out, weights, config)
    write_tokenizer(out, meta, config)


def read_inexact_from_blocks(gguf: Path, weights: dict, dequantize: bool) -> None:
    """Replace in WEIGHTS (GGUF names, from mx.load) each tensor that mx.load did not give exactly
    with the values of the file's blocks, dequantized by llama.cpp's own `gguf.quants` (float32).

    Q4_0, Q4_1 and Q8_0 stay as mx.load gives them: MLX's layout holds their blocks exactly (the
    file's float16 scale, and as bias Q4_1's float16 minimum, or -8 or -128 times the scale,
    exact in float16), unless that bias overflows float16 (a Q8_0 scale over 511.75): such a
    tensor is read from the file too. Kept quantized (`dequantize` false), a tensor read here is
    what the file holds where a dtype can: BF16 as bfloat16, an overflowing Q4_0/Q8_0 as float32,
    and a K-quant as float16 (as mx.load gives it, but rounded once from its exact value): MLX's
    affine layout cannot hold K-quants (sub-block scales d * scale are not float16 numbers, and
    Q2_K/Q6_K groups hold 16 weights)."""
    import mlx.core as mx
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize as dequantize_blocks

    for t in GGUFReader(str(gguf)).tensors:
        kind, layer = t.tensor_type.name, t.name.removesuffix(".weight")
        biases = weights.get(f"{layer}.biases")
        overflowed = biases is not None and not mx.isfinite(biases).all().item()
        if kind not in FROM_BLOCKS and not overflowed:
            continue
        if kind == "BF16" and not dequantize:
            value = mx.array(t.data.view(np.uint16)).view(mx.bfloat16)  # the file's bits
        else:
            value = mx.array(dequantize_blocks(t.data, t.tensor_type))  # float32
            if kind in MX_READS_AS_F16 and not dequantize:
                value = value.astype(mx.float16)
        weights.pop(f"{layer}.scales", None)
        weights.pop(f"{layer}.biases", None)
        weights[t.name] = value


def scalar(meta: dict, key: str, default=None):
    value = meta.get(key, default)
    if hasattr(value, "item"):
        return value.item()
    return value


def model_config(meta: dict, arch: str, weights: dict) -> dict:
    def get(field, default=None):
        value = scalar(meta, f"{arch}.{field}", default)
        if value is None:
            raise GGUFError(f"the GGUF metadata has no {arch}.{field}")
        return value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(scalar(meta, f"{arch}.attention.key_length", 0) or hidden // heads)
    scaling = scalar(meta, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise GGUFError(f"RoPE scaling {scaling!r} in the GGUF metadata is not supported")
    tokens = meta["tokenizer.ggml.tokens"]
    config = {
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length")),
        "vocab_size": int(scalar(meta, f"{arch}.vocab_size", 0) or len(tokens)),
        "tie_word_embeddings": "output.weight" not in weights,
        "bos_token_id": scalar(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": scalar(meta, "tokenizer.ggml.eos_token_id"),
        "rlproxy_gguf": {"name": scalar(meta, "general.name"),
                         "converter_version": CONVERTER_VERSION},
    }
    if arch == "llama":
        config.update(attention_bias="blk.0.attn_q.bias" in weights, mlp_bias=False)
    return config


def mlx_name(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in BLOCK_NAMES and parts[3] in SUFFIXES:
        return f"model.layers.{parts[1]}.{BLOCK_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in TOP_NAMES and parts[1] in SUFFIXES:
        return f"{TOP_NAMES[parts[0]]}.{parts[1]}"
    raise GGUFError(f"unexpected tensor {name!r} in the GGUF file")


def unpermute_qk(weights: dict, config: dict) -> None:
    """llama.cpp's converter permutes the rows of Q and K (per head: the two RoPE halves
    interleaved) for its RoPE; undo it so that mlx-lm's default RoPE gives the right logits and
    the directory matches the Hugging Face layout. Rows of quantized scales/biases move too."""
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for name in list(weights):
        match = re.fullmatch(r"model\.layers\.\d+\.self_attn\.([qk]_proj)\.\w+", name)
        if match:
            w, n = weights[name], heads[match.group(1)]
            weights[name] = (w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:])
                             .swapaxes(1, 2).reshape(w.shape))


def layer_bits(weights: dict, layer: str) -> int:
    w, scales = weights[f"{layer}.weight"], weights[f"{layer}.scales"]
    in_features = scales.shape[-1] * GGUF_GROUP_SIZE
    return w.shape[-1] * 32 // in_features  # uint32 words hold 32 // bits weights each


def dequantize_all(weights: dict, layers: list[str]) -> None:
    """Float32: dequantizing is for the CPU backend, where float32 matmuls are the fast ones
    (float16 measured 2-5x slower), so mlx-lm's own tools get the fast path from this directory
    too. Scales and biases go to float32 first: mx.dequantize computes in their dtype, and
    scale * q + bias is exact in float32 for these blocks but not in float16."""
    import mlx.core as mx

    for layer in layers:
        bits = layer_bits(weights, layer)
        scales = weights.pop(f"{layer}.scales").astype(mx.float32)
        biases = weights.pop(f"{layer}.biases").astype(mx.float32)
        weights[f"{layer}.weight"] = mx.dequantize(
            weights[f"{layer}.weight"], scales, biases, group_size=GGUF_GROUP_SIZE, bits=bits)


def quantization_config(weights: dict, layers: list[str]) -> dict:
    """mlx-lm's `quantization` entry, with every quantized layer's bits said per layer (the
    token embedding is Q8_0 in files whose other layers are Q4)."""
    bits = [layer_bits(weights, layer) for layer in layers]
    common = max(set(bits), key=bits.count)
    config = {"group_size": GGUF_GROUP_SIZE, "bits": common, "mode": "affine"}
    for layer, b in zip(layers, bits):
        config[layer] = {"group_size": GGUF_GROUP_SIZE, "bits": b, "mode": "affine"}
    return config


def save_model_dir(out: Path, weights: dict, config: dict) -> None:
    import mlx.core as mx

    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))


def build_pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    if pre == "smollm":  # digits one by one, then GPT-2's byte-level split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    if pre in ("gpt-2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    regex = {"qwen2": QWEN2_REGEX, "llama-bpe": LLAMA3_REGEX}[pre]
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def write_tokenizer(out: Path, meta: dict, config: dict) -> None:
    """A `tokenizers` BPE from the GGUF vocabulary and merges; control tokens are special."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    kind, pre = scalar(meta, "tokenizer.ggml.model"), scalar(meta, "tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise GGUFError(f"tokenizer model {kind!r} is not supported; rlproxy builds byte-level "
                        "BPE (tokenizer.ggml.model = gpt2) tokenizers from GGUF metadata")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"pre-tokenizer {pre!r} is not supported; known: "
                        f"{', '.join(PRE_TOKENIZERS)}")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = meta["tokenizer.ggml.token_type"].tolist()
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = build_pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # token_type 3: control (special, never split, hidden from text); 4: user-defined (whole,
    # but decoded as text, e.g. Qwen's <tool_call>).
    tok.add_tokens([AddedToken(t, special=(ty == 3), normalized=False)
                    for t, ty in zip(tokens, types) if ty in (3, 4)])

    def token(key):
        i = scalar(meta, key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos = token("tokenizer.ggml.bos_token_id")
    add_bos = bool(scalar(meta, "tokenizer.ggml.add_bos_token", False))
    if add_bos and bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=token("tokenizer.ggml.eos_token_id"),
        pad_token=token("tokenizer.ggml.padding_token_id"),
        unk_token=token("tokenizer.ggml.unknown_token_id"),
        chat_template=scalar(meta, "tokenizer.chat_template"),
        model_max_length=config["max_position_embeddings"], add_bos_token=add_bos,
        clean_up_tokenization_spaces=False)
    fast.save_pretrained(str(out))
    # Stop on the end-of-turn token and on end-of-text, whichever the model emits.
    eos = [config["eos_token_id"]] + [
        tokens.index(t) for t in ("<|endoftext|>", "<|im_end|>", "<|eot_id|>")
        if t in tokens and tokens.index(t) != config["eos_token_id"]]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}, indent=2))
