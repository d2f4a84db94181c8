"""`rlproxy export` and `serve --adapter` in PEFT's layout, on real parts: the tiny model, the real
app on a port, the CLI in-process and as a process, and fixtures that the real `peft` library
wrote (tests/data/peft/make_fixture.py says how): its key names, shapes and adapter_config.json,
and the log-probs torch + peft computed with a LoRA on the tiny model."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from conftest import HELLO_PROMPT, TOOL_PROMPT, TOOLS, ServerThread, make_settings
from mlx_lm.models import llama
from mlx_lm.tuner.utils import linear_to_lora_layers

from rlproxy.cli import main
from rlproxy.serving import peft
from rlproxy.serving.model import (AdapterError, load_serving_model, lora_config_from,
                                   lora_weights, resolve_source)
from rlproxy.settings import ModelSettings
from rlproxy.training.checkpoints import save_checkpoint

DATA = Path(__file__).parent / "data" / "peft"
# SmolLM2-135M's config, as rlproxy converts its GGUF file (serving/gguf.py)
SMOLLM2 = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30,
           "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
           "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "vocab_size": 49152,
           "tie_word_embeddings": True}


def sequence_logprobs(model, tokens: list[int]) -> list[float]:
    logits = model(mx.array(tokens)[None, :-1])[0].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return mx.take_along_axis(logp, mx.array(tokens[1:])[:, None], axis=1)[:, 0].tolist()


def export(*args: str) -> int:
    return main(["export", *args])


@pytest.fixture(scope="module")
def data_dir(taught_adapter, tmp_path_factory):
    """A data dir with checkpoints 1 and 2 written by the trainer's own save (step 2: the
    taught adapter, trained on the tiny model)."""
    root = tmp_path_factory.mktemp("data")
    weights = mx.load(str(taught_adapter / "adapters.safetensors"))
    config = json.loads((taught_adapter / "adapter_config.json").read_text())
    settings = {"model": {"model": "tiny"}}
    for step in (1, 2):
        save_checkpoint(root / "checkpoints", step, step, weights, {}, config, settings)
    return root


def smollm2_with_lora(layers: int):
    """mlx-lm's llama as rlproxy serves SmolLM2, built lazily (no weights), with its LoRA."""
    model = llama.Model(llama.ModelArgs.from_dict(SMOLLM2))
    lora = lora_config_from(ModelSettings(lora_layers=layers), len(model.layers))
    linear_to_lora_layers(model, lora["num_layers"], lora["lora_parameters"])
    model.freeze()
    model.unfreeze(keys=["lora_a", "lora_b"], strict=False)
    return model, lora


def test_peft_layout_equals_what_peft_writes_for_smollm2(tmp_path):
    """mlx-lm's llama, as rlproxy serves SmolLM2 (lazily built: no weights), with LoRA on the
    last 4 blocks: its PEFT conversion has peft's own key names, shapes and config."""
    fixture = DATA / "llama-smollm2"
    model, lora = smollm2_with_lora(4)
    weights, config = peft.to_peft(lora_weights(model), lora,
                                   "HuggingFaceTB/SmolLM2-135M-Instruct", len(model.layers))
    assert {k: list(v.shape) for k, v in weights.items()} == json.loads(
        (fixture / "layout.json").read_text())
    theirs = json.loads((fixture / "adapter_config.json").read_text())
    for key in ("peft_type", "task_type", "r", "lora_alpha", "layers_to_transform", "bias",
                "fan_in_fan_out", "base_model_name_or_path", "use_dora", "use_rslora"):
        assert config[key] == theirs[key], key
    assert sorted(config["target_modules"]) == sorted(theirs["target_modules"])
    # every block adapted: no layers_to_transform, as peft writes it then
    full, lora = smollm2_with_lora(-1)
    assert peft.to_peft(lora_weights(full), lora, "x", 30)[1]["layers_to_transform"] is None


def test_a_peft_adapter_serves_the_logprobs_peft_computes():
    """The adapter peft saved for the tiny model, loaded by `serve --adapter`'s loader, gives
    the log-probs torch + peft gave (and the base model alone does not)."""
    expected = json.loads((DATA / "qwen3-tiny" / "expected_logprobs.json").read_text())
    tokens = expected["tokens"]
    served = load_serving_model(ModelSettings(model="tiny", adapter=str(DATA / "qwen3-tiny")))
    got = sequence_logprobs(served.model, tokens)
    assert max(abs(a - b) for a, b in zip(got, expected["logprobs"])) < 1e-4
    base = sequence_logprobs(load_serving_model(ModelSettings(model="tiny")).model, tokens)
    assert max(abs(a - b) for a, b in zip(base, expected["logprobs"])) > 0.1
    assert served.lora_config["lora_parameters"]["scale"] == 10 / 4  # lora_alpha / r


def chat(server, messages, tools=None):
    r = server.client().chat.completions.create(
        model="m", messages=messages, tools=tools, max_tokens=12, temperature=0, logprobs=True,
        extra_headers={"X-Turn-Type": "side"})
    return r.choices[0].message, [t.logprob for t in r.choices[0].logprobs.content]


def test_a_checkpoint_exported_to_peft_serves_the_same_logprobs(data_dir, taught_server,
                                                                 tmp_path):
    out = tmp_path / "peft"
    assert export("--data-dir", str(data_dir), "--format", "peft", "--out", str(out)) == 0
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json",
                                                     "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["lora_alpha"] / config["r"] == 20.0
    with ServerThread(make_settings(tmp_path / "d", adapter=str(out))) as s:
        for messages, tools in ((HELLO_PROMPT, None), (TOOL_PROMPT, TOOLS)):
            (mine, lp), (theirs, lp0) = chat(s, messages, tools), chat(taught_server, messages,
                                                                       tools)
            assert mine.content == theirs.content and len(lp) == len(lp0) > 0
            assert max(abs(a - b) for a, b in zip(lp, lp0)) < 1e-4


def test_mlx_export_round_trips_through_peft(data_dir, taught_adapter, tmp_path):
    assert export("--data-dir", str(data_dir), "--step", "1", "--format", "peft",
                  "--out", str(tmp_path / "peft")) == 0
    assert export("--adapter", str(tmp_path / "peft"), "--format", "mlx", "--model", "tiny",
                  "--out", str(tmp_path / "mlx")) == 0
    back = mx.load(str(tmp_path / "mlx" / "adapters.safetensors"))
    original = mx.load(str(taught_adapter / "adapters.safetensors"))
    assert back.keys() == original.keys()
    assert all(mx.array_equal(back[k], original[k]).item() for k in original)
    config = json.loads((tmp_path / "mlx" / "adapter_config.json").read_text())
    assert config["lora_parameters"]["rank"] == 8 and config["lora_parameters"]["scale"] == 20
    # what mlx-lm itself opens
    model, _ = mlx_lm.load(resolve_source("tiny").path, adapter_path=str(tmp_path / "mlx"))
    assert model.layers[0].self_attn.q_proj.lora_b.shape == (8, 128)


def test_fused_export_gives_the_adapters_logprobs(data_dir, taught_adapter, tmp_path):
    assert export("--data-dir", str(data_dir), "--format", "fused", "--out",
                  str(tmp_path / "fused")) == 0
    fused, tok = mlx_lm.load(str(tmp_path / "fused"))
    tokens = tok.encode("Say hello. Hello from Paris")
    adapted = load_serving_model(ModelSettings(model="tiny", adapter=str(taught_adapter)))
    a, b = sequence_logprobs(fused, tokens), sequence_logprobs(adapted.model, tokens)
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


def one_line_error(capsys, *args: str) -> str:
    assert export(*args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rlproxy: "), err
    return err


def test_bad_exports_are_one_line_and_status_2(data_dir, tmp_path, capsys):
    out = str(tmp_path / "out")
    err = one_line_error(capsys, "--data-dir", str(data_dir), "--step", "7", "--format", "peft",
                         "--out", out)
    assert "no complete checkpoint for step 7" in err and "step_000002" in err
    err = one_line_error(capsys, "--data-dir", str(tmp_path), "--format", "peft", "--out", out)
    assert "no checkpoint in" in err
    (tmp_path / "empty").mkdir()
    err = one_line_error(capsys, "--adapter", str(tmp_path / "empty"), "--format", "mlx",
                         "--model", "tiny", "--out", out)
    assert "not an adapter folder" in err
    err = one_line_error(capsys, "--data-dir", str(data_dir), "--format", "gguf", "--out", out)
    assert "llama, qwen2, qwen3" in err and "'qwen3' model" in err
    assert not Path(out).exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    err = one_line_error(capsys, "--data-dir", str(data_dir), "--format", "mlx",
                         "--out", str(tmp_path / "full"))
    assert "not an empty folder" in err


def smollm2_peft(folder: Path) -> Path:
    """peft's SmolLM2 adapter layout (fixture names and shapes), zero weights."""
    fixture = DATA / "llama-smollm2"
    shapes = json.loads((fixture / "layout.json").read_text())
    weights = {k: mx.zeros(shape) for k, shape in shapes.items()}
    return peft.write_peft(folder, weights, json.loads((fixture / "adapter_config.json")
                                                       .read_text()))


def narrowed_peft(folder: Path) -> Path:
    """The tiny model's peft adapter with lora_A cut to 64 inputs: a model of another width."""
    weights, config = peft.read_adapter(DATA / "qwen3-tiny")
    weights = {k: w[:, :64] if ".lora_A." in k else w for k, w in weights.items()}
    return peft.write_peft(folder, weights, config)


def test_a_peft_adapter_for_another_model_is_refused(tmp_path, capsys):
    other = smollm2_peft(tmp_path / "smollm2")
    err = one_line_error(capsys, "--adapter", str(other), "--format", "mlx", "--model", "tiny",
                         "--out", str(tmp_path / "o"))
    assert re.search(r"layers\.2\d\..*: block 2\d, but the base model has 2 blocks", err)
    narrow = narrowed_peft(tmp_path / "narrow")
    with pytest.raises(AdapterError, match="does not fit this model: .*lora_a.*does not match"):
        load_serving_model(ModelSettings(model="tiny", adapter=str(narrow)))


def test_serve_with_a_misfit_peft_adapter_exits_2_with_one_line(tmp_path):
    narrow = narrowed_peft(tmp_path / "narrow")
    r = subprocess.run([sys.executable, "-m", "rlproxy.cli", "serve", "--model", "tiny",
                        "--adapter", str(narrow), "--data-dir", str(tmp_path / "d"),
                        "--port", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("rlproxy: --adapter") and "does not fit this model" in last


@pytest.mark.real_model
@pytest.mark.slow
def test_gguf_export_of_smollm2_loads_back_with_the_same_logprobs(tmp_path):
    """SmolLM2 (llama, from its GGUF file) + a LoRA on 2 blocks -> one float16 GGUF that
    `--model file.gguf` serves. Measured: max |d logprob| 1.0e-2 over 15 tokens (every weight
    rounded to float16 once, against the exact float32 base; 1.8e-3 while the served base was
    itself float16-rounded); the bound is 2e-2, the adapter itself moves them by 0.5."""
    from mlx.utils import tree_unflatten

    from rlproxy.serving.model import save_adapter

    m = load_serving_model(ModelSettings(model="smollm2-135m-instruct", lora_layers=2))
    mx.random.seed(3)
    m.model.update(tree_unflatten([(k, mx.random.normal(v.shape) * 0.02 if k.endswith(
        "lora_b") else v) for k, v in lora_weights(m.model).items()]))
    save_adapter(m.model, m.lora_config, tmp_path / "adapter")
    assert export("--adapter", str(tmp_path / "adapter"), "--format", "gguf", "--model",
                  "smollm2-135m-instruct", "--out", str(tmp_path / "gguf")) == 0
    (written,) = (tmp_path / "gguf").glob("*.gguf")
    back = load_serving_model(ModelSettings(model=str(written)))
    tokens = m.tokenizer.encode("The capital of France is Paris, and of Italy, Rome.")
    assert back.tokenizer.encode("The capital of France is Paris, and of Italy, Rome.") == tokens
    a, b = sequence_logprobs(m.model, tokens), sequence_logprobs(back.model, tokens)
    assert max(abs(x - y) for x, y in zip(a, b)) < 2e-2


def test_a_hub_id_that_cannot_be_fetched_is_one_line(tmp_path, capsys):
    """No network here: the hub fetch fails, and says so in one line (no traceback)."""
    err = one_line_error(capsys, "--adapter", str(DATA / "qwen3-tiny"), "--model",
                         "nobody/no-such-model", "--format", "peft", "--out", str(tmp_path / "o"))
    assert "--model nobody/no-such-model: not a folder here" in err and "hub" in err


def test_a_sharded_fused_model_is_read_whole(data_dir, tmp_path, monkeypatch):
    """mlx-lm's save shards past 5 GB (whole GB only): made to cut three shards here, as it
    does for a big model (its own file names and index)."""
    import mlx_lm.utils

    from rlproxy.training.export import model_weights

    monkeypatch.setattr(mlx_lm.utils, "make_shards",
                        lambda w: [dict(list(w.items())[i::3]) for i in range(3)])
    assert export("--data-dir", str(data_dir), "--format", "fused", "--out",
                  str(tmp_path / "f")) == 0
    shards = sorted((tmp_path / "f").glob("model-*.safetensors"))
    index = json.loads((tmp_path / "f" / "model.safetensors.index.json").read_text())
    assert len(shards) > 1 and model_weights(tmp_path / "f").keys() == index["weight_map"].keys()


def test_an_adapter_trained_on_a_scaled_window_keeps_its_scaling(taught_adapter, tmp_path,
                                                                 capsys):
    """A checkpoint trained under --context-length past tiny's 131,072: the fused model carries
    the YaRN scaling, a PEFT export says the base needs it; --context-length on export too."""
    from mlx_lm.models.rope_utils import YarnRoPE

    weights = mx.load(str(taught_adapter / "adapters.safetensors"))
    config = json.loads((taught_adapter / "adapter_config.json").read_text())
    save_checkpoint(tmp_path / "d" / "checkpoints", 1, 1, weights, {}, config,
                    {"model": {"model": "tiny", "context_length": 262144}})
    assert export("--data-dir", str(tmp_path / "d"), "--format", "fused", "--out",
                  str(tmp_path / "f")) == 0
    fused = json.loads((tmp_path / "f" / "config.json").read_text())
    assert fused["max_position_embeddings"] == 262144
    assert fused["rope_scaling"]["rope_type"] == "yarn" and fused["rope_scaling"]["factor"] == 2
    model, _ = mlx_lm.load(str(tmp_path / "f"))
    assert any(isinstance(m, YarnRoPE) for m in model.modules())
    capsys.readouterr()
    assert export("--adapter", str(taught_adapter), "--model", "tiny", "--context-length",
                  "262144", "--format", "peft", "--out", str(tmp_path / "p")) == 0
    err = capsys.readouterr().err
    assert "262,144-token window" in err and "--context-length 262144" in err


def test_a_peft_adapter_saved_as_bin_says_how_to_save_it(tmp_path, capsys):
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "adapter_config.json").write_text((DATA / "qwen3-tiny" / "adapter_config.json")
                                                .read_text())
    (folder / "adapter_model.bin").write_bytes(b"torch pickle")
    with pytest.raises(AdapterError, match=r"adapter_model\.bin.*safe_serialization=True"):
        load_serving_model(ModelSettings(model="tiny", adapter=str(folder)))
    err = one_line_error(capsys, "--adapter", str(folder), "--format", "mlx", "--model", "tiny",
                         "--out", str(tmp_path / "o"))
    assert "safe_serialization=True" in err


def test_the_dashboards_peft_download(tiny, taught_adapter, tmp_path):
    """GET /ui/api/adapters/{step}.peft.zip: a zip peft's layout reads back to the checkpoint's
    weights; a missing step is a 404; a checkpoint of another layout, or unreadable, a 409."""
    import io
    import zipfile

    import requests

    adapter = mx.load(str(taught_adapter / "adapters.safetensors"))
    root = tmp_path / "data" / "checkpoints"
    save_checkpoint(root, 1, 1, adapter, {}, tiny.lora_config, {})
    narrow = {k: v[:4] if k.endswith("lora_a") else v for k, v in adapter.items()}
    save_checkpoint(root, 2, 2, narrow, {}, tiny.lora_config, {})
    save_checkpoint(root, 3, 3, adapter, {}, tiny.lora_config, {})
    (root / "step_000003" / "adapters.safetensors").write_bytes(b"not safetensors")
    with ServerThread(make_settings(tmp_path / "data"), tiny) as s:
        get = lambda step: requests.get(f"{s.url}/ui/api/adapters/{step}.peft.zip")  # noqa: E731
        got, missing, misfit, broken = get(1), get(9), get(2), get(3)
    assert got.status_code == 200 and got.headers["Content-Type"] == "application/zip"
    with zipfile.ZipFile(io.BytesIO(got.content)) as z:
        z.extractall(tmp_path / "zip")
    (folder,) = (tmp_path / "zip").iterdir()
    weights, _ = peft.from_peft(*peft.read_adapter(folder), len(tiny.model.layers))
    assert weights.keys() == adapter.keys()
    assert all(mx.array_equal(weights[k], adapter[k]).item() for k in adapter)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "checkpoint_not_found"
    assert misfit.status_code == 409 and "another model or LoRA layout" in misfit.text
    assert broken.status_code == 409
    assert broken.json()["error"]["code"] == "checkpoint_unreadable", broken.text
