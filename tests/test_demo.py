"""`rlproxy demo`: its reward on hand-made token ids, and a short real run end to end (real app,
real HTTP, real scorer and PPO trainer on the tiny model) checked through the files it leaves;
one short run on SmolLM2, the default model, whose tokenizer the reward must then read."""

from __future__ import annotations

import argparse
import json
import re
import xml.etree.ElementTree as ET

import rlproxy  # noqa: F401  (preloads OpenBLAS before mlx)
import pytest
from transformers import AutoTokenizer

from rlproxy.demo import run as demo
from rlproxy.paths import PENDING
from rlproxy.records import load_pending
from rlproxy.serving.embedded_model import embedded_model_path
from conftest import read_records


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(embedded_model_path("tiny")))


def turn_with(*completions: list[int], chosen: int = 0) -> dict:
    return {"choices": [{"completion_ids": ids} for ids in completions], "chosen_choice": chosen}


def test_number_tokens():
    assert demo.is_number_token(b"7") and demo.is_number_token(b" 2024")
    assert not demo.is_number_token(b" ")
    assert not demo.is_number_token(b"7a")
    assert not demo.is_number_token("\u0663".encode())  # ARABIC-INDIC DIGIT THREE: not ASCII
    assert demo.share_reward([]) == -1.0
    assert demo.share_reward([True, False, False, False]) == -0.5


def test_number_token_ids_match_decoded_text(tok):
    ids = demo.number_token_ids(embedded_model_path("tiny"))
    singles = {tok.convert_tokens_to_ids(str(d)) for d in range(10)}
    assert singles <= ids
    decoded = {i: tok.decode([i]) for i in tok.get_vocab().values()}
    # a second, independent path (the tokenizer's own decode) finds the same set
    assert ids == {i for i, text in decoded.items() if text.strip().isdigit()
                   and text.strip().isascii()}


def test_digit_reward_on_hand_made_ids(tok):
    seven, forty_two = tok.convert_tokens_to_ids("7"), tok.convert_tokens_to_ids("Ġ42")
    word = tok.convert_tokens_to_ids("Ġthe")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = demo.number_token_ids(embedded_model_path("tiny"))  # outside a demo: tiny's
    assert word not in ids and {seven, forty_two} <= ids
    assert demo.digit_reward(turn_with([seven, forty_two, word, word, end]), None) == 0.0
    assert demo.digit_reward(turn_with([seven, word, word, word]), None) == -0.5
    assert demo.digit_reward(turn_with([seven, forty_two, end]), None) == 1.0  # end not counted
    assert demo.digit_reward(turn_with([word, word]), None) == -1.0
    assert demo.digit_reward(turn_with([end]), None) == -1.0  # an empty reply earns nothing
    # the choice the conversation continued from is the one scored
    assert demo.digit_reward(turn_with([word], [seven], chosen=1), [{"role": "user"}]) == 1.0


def test_svg_chart_is_valid_and_draws_each_series():
    svg = demo.svg_chart([("a & <b>", "#111", [(0, -1.0), (5, 0.5)]), ("c", "#222", [(1, 0.0)])],
                         "t -> u")
    root = ET.fromstring(svg)  # well-formed, labels escaped
    assert "a & <b>" in [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    lines = root.findall("{http://www.w3.org/2000/svg}polyline")
    assert [ln.get("stroke") for ln in lines] == ["#111", "#222"]
    # reward -1 sits at the bottom of the plot area and +0.5 above the middle
    (x0, y0), (x1, y1) = [tuple(map(float, p.split(","))) for p in
                          lines[0].get("points").split()]
    assert x1 > x0 and y0 > y1


STEPS = 4


def test_demo_runs_trains_and_writes_the_curve(tmp_path, capsys):
    args = argparse.Namespace(steps=STEPS, out=str(tmp_path), model="tiny",
                              log_level="WARNING", guard=False)
    assert demo.run_demo(args) == 0
    printed = capsys.readouterr().out
    assert "rlproxy demo: serving rlproxy-embedded-tiny (generated tiny model" in printed
    assert f"learning rate {demo.LEARNING_RATE:g};" in printed
    assert re.search(rf"reward -?\d\.\d\d -> -?\d\.\d\d over {STEPS} PPO steps "
                     rf"\(adapter v{STEPS}\)", printed), printed
    checkpoint = tmp_path / "data" / "checkpoints" / f"step_{STEPS:06d}"
    assert f"adapter: {checkpoint}" in printed
    assert (checkpoint / "adapters.safetensors").exists()

    result = json.loads((tmp_path / "curve.json").read_text())
    curve = result["curve"]
    assert curve[0]["adapter_version"] == 0 and curve[-1]["adapter_version"] == STEPS
    assert all(p["n"] == demo.EVAL_SAMPLES == len(p["rewards"]) for p in curve)
    assert all(-1 <= r <= 1 for p in curve for r in p["rewards"])
    assert all(isinstance(p["example"], str) for p in curve)
    svg = ET.fromstring((tmp_path / "curve.svg").read_text())
    assert len(svg.findall("{http://www.w3.org/2000/svg}polyline")) == 2

    data = tmp_path / "data"
    steps = [s for s in read_records(data, "training.jsonl") if s.get("kind") == "step"]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert all(s["turns"] == demo.BATCH_SIZE for s in steps)
    turns = {t["uid"]: t for t in read_records(data)}
    # only the agent's turns were recorded: the opted-out measurements left no trace, not even
    # as a turn still waiting for its next state
    assert len(turns) == result["turns"] == STEPS * demo.BATCH_SIZE
    assert load_pending(data / PENDING) == []
    journaled = {t["uid"] for t in read_records(data, PENDING) if t.get("kind") == "turn"}
    assert journaled and journaled <= set(turns)  # (a session's last turn is recorded at once)
    trained = [u for s in steps for u in s["uids"]]
    assert sorted(trained) == sorted(turns)  # each recorded turn trained exactly once
    scores = {s["uid"]: s for s in read_records(data, "prm_scores.jsonl")
              if s.get("kind") == "score"}
    for uid, t in turns.items():
        assert t["session_id"].startswith("demo-") and t["tools"][0]["function"]["name"] == \
            "get_weather"
        assert any(m["role"] == "tool" for m in t["messages"])
        assert any(m.get("tool_calls") for m in t["messages"] if m["role"] == "assistant")
        # on-policy: round k (AGENTS sessions) is sampled entirely by adapter version k
        session = int(t["session_id"].removeprefix("demo-"))
        assert set(t["choices"][0]["adapter_versions"]) == {session // demo.AGENTS}
        if t["index"] == 0:  # the follow-up question is the first turn's next state
            assert [m["role"] for m in t["next_state"]] == ["user"]
        else:
            assert t["index"] == 1 and t["end"] == "session_done"
        assert scores[uid]["reward"] == scores[uid]["function_reward"] == \
            demo.digit_reward(t, t["next_state"])
        assert scores[uid]["votes"] == []  # no judge ran


def test_the_guarded_demo_rolls_back_a_learning_rate_set_too_high_and_marks_it(tmp_path, capsys):
    """`rlproxy demo --guard`: at the guard's rate (too high on purpose) each candidate jumps
    about 1 nat per token from the served adapter; the gate refuses three in a row, halving the
    rate each time, then pauses training. The served adapter never changes; the printed curve,
    curve.json and the chart mark each rollback."""
    from rlproxy.demo import guard as demo_guard

    args = argparse.Namespace(steps=12, out=str(tmp_path), model="tiny",
                              log_level="WARNING", guard=True)
    assert demo.run_demo(args) == 0
    printed = capsys.readouterr().out
    assert len(re.findall(r"step +\d+  ROLLBACK to step 0 \(adapter v0\): [^\n]*KL to the "
                          r"served \d\.\d+ >= max_kl 0.6", printed)) == 3, printed
    assert "learning rate now x0.125 = 0.0025" in printed, printed
    assert "training paused: 3 rollbacks in a row by the eval gate" in printed, printed
    # which step numbers the rollbacks take depends on how many batches the agents filled
    # before the pause (timing): the figures that matter are 0 published and 3 rolled back
    summary = re.search(r"eval gate: (\d+) evaluations, 0 published, 3 rolled back \(at "
                        r"steps \d+, \d+, \d+\)", printed)
    assert summary and int(summary.group(1)) >= 3, printed

    result = json.loads((tmp_path / "curve.json").read_text())
    assert result["learning_rate"] == demo_guard.GUARD_LEARNING_RATE and result["guard"]
    assert result["paused"].startswith("training paused")
    steps = [r["step"] for r in result["gate"]["rollbacks"]]
    assert len(steps) == 3 and steps == sorted(set(steps)), result["gate"]
    assert [r["lr_scale"] for r in result["gate"]["rollbacks"]] == [0.5, 0.25, 0.125]
    assert {p["adapter_version"] for p in result["curve"]} == {0}  # nothing was published
    assert len({tuple(p["rewards"]) for p in result["curve"]}) == 1  # so nothing changed
    svg = ET.fromstring((tmp_path / "curve.svg").read_text())
    marks = [ln for ln in svg.iter("{http://www.w3.org/2000/svg}line")
             if ln.get("class") == "rollback"]
    assert len(marks) == 3 and all(m.get("stroke") == "#d62728" for m in marks)
    assert "rollback" in [t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")]
    lines = read_records(tmp_path / "data", "training.jsonl")
    assert [ln["kind"] for ln in lines if ln["kind"] != "step"] == [
        "eval", "rollback", "eval", "rollback", "eval", "rollback", "pause"]


@pytest.mark.real_model
@pytest.mark.slow
def test_the_demo_on_smollm2_scores_with_its_tokenizer(tmp_path, capsys, monkeypatch):
    """One PPO step on SmolLM2 (2 fresh samples per measurement, not 16, to stay short): the
    demo says what it serves, trains at the real model's rate, and every turn is scored with
    SmolLM2's token ids (its digits are single tokens), not the tiny model's."""
    from rlproxy.serving.model import resolve_source

    smol = AutoTokenizer.from_pretrained(resolve_source("smollm2-135m-instruct").path)
    monkeypatch.setattr(demo, "EVAL_SAMPLES", 2)
    args = argparse.Namespace(steps=1, out=str(tmp_path), model="smollm2-135m-instruct",
                              log_level="WARNING", guard=False)
    assert demo.run_demo(args) == 0
    printed = capsys.readouterr().out
    assert "rlproxy demo: serving smollm2-135m-instruct (SmolLM2-135M-Instruct" in printed
    assert f"learning rate {demo.REAL.learning_rate:g};" in printed
    assert re.search(r"reward -?\d\.\d\d -> -?\d\.\d\d over 1 PPO steps", printed), printed

    # a second, independent path: SmolLM2's own decode of each recorded reply
    def by_decode(ids: list[int]) -> float:
        ends = {smol.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
        ids = [i for i in ids if i not in ends]
        return demo.share_reward([smol.decode([i]).strip().isdigit()
                                  and smol.decode([i]).isascii() for i in ids])

    scores = {s["uid"]: s["reward"] for s in read_records(tmp_path / "data", "prm_scores.jsonl")
              if s.get("kind") == "score"}
    turns = {t["uid"]: t for t in read_records(tmp_path / "data")}
    assert len(turns) == demo.BATCH_SIZE
    for uid, t in turns.items():
        assert scores[uid] == by_decode(t["choices"][0]["completion_ids"])

    spaced = smol.encode("2024 18 42")  # '2' '0' '2' '4' ' ' '1' '8' ' ' '4' '2'
    digits = [i for i in spaced if smol.decode([i]).strip()]
    with demo.scoring_tokens(resolve_source("smollm2-135m-instruct").path):
        assert demo.digit_reward(turn_with(digits), None) == 1.0
        assert demo.digit_reward(turn_with(smol.encode("warm and windy")), None) == -1.0
        # 8 digits of 10 tokens (a space is a token of its own); the end token is not counted
        assert demo.digit_reward(turn_with(spaced + [smol.eos_token_id]), None) == \
            pytest.approx(0.6)
    # outside a demo the reward reads tiny's ids, among which SmolLM2's digits are letters
    assert demo.digit_reward(turn_with(digits), None) == -1.0
