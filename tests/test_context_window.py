"""The context window a model is served with: what /v1/models, /healthz and the Tinker API say,
`--context-length` (YaRN RoPE scaling past the trained window, a lower limit below it, a startup
error where the architecture cannot scale), and the 400 a longer prompt gets in each dialect.

The tiny model's tests run on the generated model; SmolLM2's (real weights, its GGUF converted)
are marked real_model.
"""

from __future__ import annotations

import json
import logging
import shutil

import anthropic
import mlx.core as mx
import openai
import pytest
import requests
from mlx_lm.models.rope_utils import YarnRoPE

from conftest import ServerThread, make_settings, server_with
from rlproxy.serving.embedded_model import embedded_model_path
from rlproxy.serving.model import context_window, load_serving_model
from rlproxy.settings import ModelSettings

HERMES_MINIMUM = 64_000  # Hermes Agent 0.19 refuses to start below this (agent/model_metadata.py)
SMOLLM2 = "smollm2-135m-instruct"


def windows(server) -> dict:
    """Every place the window is said: each /v1/models card's two fields, /healthz, Tinker."""
    cards = requests.get(server.base_url + "/models", timeout=30).json()["data"]
    caps = requests.get(server.url + "/api/v1/get_server_capabilities", timeout=30).json()
    return {"context_length": {c["context_length"] for c in cards},
            "max_input_tokens": {c["max_input_tokens"] for c in cards},
            "healthz": {requests.get(server.url + "/healthz", timeout=30).json()[
                "context_length"]},
            "tinker": {m["max_context_length"] for m in caps["supported_models"]}}


def words(n: int) -> str:
    return "word " * n  # two tokens a word for tiny's tokenizer, one for SmolLM2's


# ---- the generated model ----

def test_tiny_advertises_a_window_agents_accept(server):
    said = windows(server)
    assert said == {k: {131072} for k in said}
    card = server.client().models.retrieve("rlproxy-embedded-tiny")  # the openai SDK keeps it
    assert card.context_length == 131072 and card.context_length >= HERMES_MINIMUM


@pytest.mark.slow  # ~30 s of prefill on 2 busy cores
def test_a_20k_token_prompt_is_served_on_tiny(server):
    r = server.client().chat.completions.create(
        model="m", max_tokens=2, messages=[{"role": "user", "content": words(10000)}])
    assert r.usage.prompt_tokens > 20000 and r.choices[0].finish_reason in ("length", "stop")


def test_context_length_below_the_window_only_lowers_the_limit():
    loaded = load_serving_model(ModelSettings(model="tiny", context_length=4096))
    assert loaded.context_length == 4096 and loaded.config_overrides == {}
    assert not any(isinstance(m, YarnRoPE) for m in loaded.model.modules())
    assert loaded.kv_identity == loaded.model_id  # the same KV as the full window


def test_a_scaled_model_serves_from_the_engine_thread(tmp_path):
    """YaRN's frequency table is built at load: evaluated there, not first on the engine thread
    (where MLX has no stream for a graph built on the main thread)."""
    loaded = load_serving_model(ModelSettings(model="tiny", context_length=262144))
    with ServerThread(make_settings(tmp_path, context_length=262144), loaded) as s:
        assert windows(s)["context_length"] == {262144}
        r = s.client().chat.completions.create(model="m", max_tokens=3,
                                               messages=[{"role": "user", "content": "hi"}])
        assert r.usage.completion_tokens >= 1


def test_context_window_rules():
    assert context_window({"max_position_embeddings": 8192}, None) == (8192, {})
    assert context_window({"max_position_embeddings": 8192}, 8192) == (8192, {})
    assert context_window({}, None) == (None, {})  # the tokenizer's model_max_length then
    window, overrides = context_window({"max_position_embeddings": 8192}, 65536)
    assert window == 65536 and overrides == {"max_position_embeddings": 65536, "rope_scaling": {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192}}
    with pytest.raises(ValueError, match="already scales its RoPE .llama3"):
        context_window({"max_position_embeddings": 131072,
                        "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 262144)
    with pytest.raises(ValueError, match="no max_position_embeddings"):
        context_window({}, 65536)


def model_dir(path, config: dict, model_cls):
    """A model directory of `config`'s architecture with random weights and tiny's tokenizer."""
    from mlx_lm.utils import save_config, save_model

    path.mkdir()
    src = embedded_model_path("tiny")
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            shutil.copy(f, path / f.name)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    config = {**config, "vocab_size": vocab, "max_position_embeddings": 2048}
    model = model_cls.Model(model_cls.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    save_model(path, model)
    save_config(config, path / "config.json")
    return path


def test_architectures_that_cannot_scale_are_a_startup_error(tmp_path):
    from mlx_lm.models import gpt2, starcoder2

    learned = model_dir(tmp_path / "gpt2", {
        "model_type": "gpt2", "n_ctx": 2048, "n_embd": 64, "n_head": 2, "n_layer": 1,
        "n_positions": 2048, "layer_norm_epsilon": 1e-5}, gpt2)
    with pytest.raises(ValueError, match=r"--context-length 8192: the gpt2 architecture does "
                                         r"not use RoPE.*--context-length 2048 or less"):
        load_serving_model(ModelSettings(model=str(learned), context_length=8192))
    plain = model_dir(tmp_path / "sc2", {
        "model_type": "starcoder2", "hidden_size": 64, "num_hidden_layers": 1,
        "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1},
        starcoder2)
    with pytest.raises(ValueError, match="starcoder2 architecture builds its RoPE without"):
        load_serving_model(ModelSettings(model=str(plain), context_length=8192))
    assert load_serving_model(ModelSettings(model=str(plain))).context_length == 2048


# ---- SmolLM2: real weights, from its GGUF ----

@pytest.fixture(scope="module")
def scaled():
    return load_serving_model(ModelSettings(model=SMOLLM2, context_length=65536))


scaled_server = server_with("scaled", model=SMOLLM2, context_length=65536)
smollm2_server = server_with("real", model=SMOLLM2)


@pytest.mark.real_model
def test_smollm2_says_its_configured_window(smollm2_server):
    said = windows(smollm2_server)
    assert said == {k: {8192} for k in said}


@pytest.mark.real_model
def test_context_length_scales_smollm2_with_yarn(scaled, scaled_server, real):
    said = windows(scaled_server)
    assert said == {k: {65536} for k in said}
    assert scaled.config_overrides["rope_scaling"] == {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192}
    ropes = [m for m in scaled.model.modules() if isinstance(m, YarnRoPE)]
    assert len(ropes) == len(scaled.model.layers)  # every attention layer's RoPE
    # a KV cache computed without the scaling is never reused with it
    assert scaled.kv_identity != real.kv_identity and scaled.model_id == real.model_id
    # the training copy builds the same positions: its logits are the serving model's
    from rlproxy.training.learner import training_copy

    ids = mx.array([scaled.tokenizer.encode("The capital of France is")])
    copy = training_copy(scaled)
    assert mx.allclose(copy(ids), scaled.model(ids), atol=1e-4).item()
    assert not mx.allclose(real.model(ids), scaled.model(ids), atol=1e-4).item()


@pytest.mark.real_model
def test_scaling_warns_once_at_load(caplog):
    with caplog.at_level(logging.WARNING, logger="rlproxy.model"):
        load_serving_model(ModelSettings(model=SMOLLM2, context_length=16384))
    said = [r.getMessage() for r in caplog.records if r.name == "rlproxy.model"]
    assert len(said) == 1 and "trained on 8192 tokens" in said[0] and "16384" in said[0]


@pytest.mark.real_model
def test_no_tokenizer_length_warning_inside_the_served_window(scaled):
    """transformers warned "Token indices sequence length is longer than the specified maximum
    sequence length for this model (15168 > 8192) ... indexing errors" on a Hermes prompt
    although the window was 65,536: SmolLM2's tokenizer is told the served window."""
    from rlproxy.serving.chat_template import render_prompt

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    hf = logging.getLogger("transformers")  # the library's root: its loggers do not propagate
    hf.addHandler(handler)
    try:
        ids = render_prompt(scaled.tokenizer, [{"role": "user", "content": words(15000)}], None)
    finally:
        hf.removeHandler(handler)
    assert 8192 < len(ids) < 65536 and scaled.tokenizer.model_max_length == 65536
    assert not [m for m in said if "longer than the specified maximum" in m], said


def test_a_prompt_past_the_trained_window_is_served_when_scaled(tmp_path):
    """A llama (SmolLM2's architecture; small and random, so that a prompt past its 2,048
    trained tokens prefills in seconds rather than SmolLM2's minutes on a CPU) served with
    --context-length 8192: YaRN-scaled, and a 3,000-token prompt answered."""
    from mlx_lm.models import llama

    path = model_dir(tmp_path / "llama", {
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True}, llama)
    loaded = load_serving_model(ModelSettings(model=str(path), context_length=8192))
    assert any(isinstance(m, YarnRoPE) for m in loaded.model.modules())
    with ServerThread(make_settings(tmp_path / "data", context_length=8192), loaded) as s:
        assert windows(s)["context_length"] == {8192}
        r = s.client().chat.completions.create(model="m", max_tokens=4, temperature=0,
                                               messages=[{"role": "user", "content": words(3000)}])
        assert r.usage.prompt_tokens > 2048 and r.usage.completion_tokens >= 1


@pytest.mark.real_model
def test_a_prompt_past_the_window_is_a_400_in_each_dialect(smollm2_server):
    s, long = smollm2_server, [{"role": "user", "content": words(10000)}]
    size = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0).messages.count_tokens(
        model=SMOLLM2, messages=long).input_tokens
    assert size > 8192
    with pytest.raises(openai.BadRequestError) as e:
        s.client().chat.completions.create(model=SMOLLM2, max_tokens=4, messages=long)
    err = e.value.body  # the openai SDK hands over the body's "error" object
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    for said in ("8192", str(size), "--context-length"):
        assert said in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        s.client().responses.create(model=SMOLLM2, input=long[0]["content"], max_output_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    assert "8192" in e.value.body["message"] and "--context-length" in e.value.body["message"]
    r = requests.post(s.url + "/v1/messages", timeout=60, json={
        "model": SMOLLM2, "max_tokens": 4, "messages": long})
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith(f"prompt is too long: {size} tokens > 8192 maximum")
    assert "--context-length" in body["error"]["message"]
