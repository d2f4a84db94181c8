"""Staleness: how many adapter versions a trained turn's sampler is behind the version it trains.
Each step line carries it per turn, /metrics has its histogram, and `--max-staleness N` skips a
turn further behind, with a `skipped` line. On the real trainer and the tiny model."""

from __future__ import annotations

import pytest

from conftest import make_settings, read_records, tiny_copy
from rlproxy.ops import metrics
from rlproxy.training.examples import pack, staleness, turn_example
from rlproxy.training.learner import training_copy
from rlproxy.training.loop import Trainer


@pytest.fixture(scope="module")
def own():
    return tiny_copy()  # trained here: a private copy, shared by this module's tests


def scored(own, uid: str, versions: list[int]) -> dict:
    """A scored turn whose completion tokens were sampled by adapter VERSIONS."""
    prompt = own.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                               add_generation_prompt=True)
    completion = [5, 6, 7][:len(versions)]
    turn = {"uid": uid, "prompt_ids": prompt,
            "choices": [{"completion_ids": completion, "logprobs": [-1.0] * len(completion),
                         "adapter_versions": versions}]}
    return {"turn": turn, "reward": 1.0, "advantages": [1.0] * len(completion)}


def test_staleness_counts_from_the_oldest_sampling_version():
    assert staleness({"adapter_versions": [3, 4, 4]}, 6) == 3  # a swap mid-reply: the oldest
    assert staleness({"adapter_versions": [6]}, 6) == 0
    assert staleness({"adapter_versions": [7]}, 6) == 0  # never negative
    assert staleness({"adapter_versions": [2]}, None) is None
    assert staleness({}, 6) is None  # recorded without versions: unknown


def test_packed_examples_keep_each_turns_staleness():
    first = {"uid": "a", "prompt_ids": [1, 2, 3],
             "choices": [{"completion_ids": [4, 5], "logprobs": [-1.0, -1.0],
                          "adapter_versions": [1, 1]}]}
    second = {"uid": "b", "prompt_ids": [1, 2, 3, 4, 5, 9],
              "choices": [{"completion_ids": [6], "logprobs": [-1.0], "adapter_versions": [3]}]}
    examples = [turn_example(t, [1.0] * len(t["choices"][0]["completion_ids"]), 1.0, version=4)
                for t in (first, second)]
    [packed] = pack(examples)  # the first turn's ids open the second's: one pass
    assert dict(zip(packed["uids"], packed["staleness"])) == {"a": 3, "b": 1}


def test_steps_record_staleness_and_max_staleness_skips_the_late(own, tmp_path):
    before = metrics.STALENESS.collect()[0]
    count = next(s.value for s in before.samples if s.name.endswith("_count"))
    trainer = Trainer(make_settings(tmp_path, train=True, batch_size=2, baseline="none",
                                    max_staleness=3, save_interval=1000),
                      training_copy(own), own.lora_config, data_dir=tmp_path,
                      vocab_size=own.vocab_size)
    try:
        trainer.version = 5  # as after five published steps
        trainer.train_journaled([scored(own, "fresh", [5, 5, 5]), scored(own, "late", [1, 2, 2]),
                                 scored(own, "near", [2, 3, 3])])
    finally:
        trainer.stop()
    lines = read_records(tmp_path, "training.jsonl")
    skipped = [ln for ln in lines if ln["kind"] == "skipped"]
    assert [(ln["uid"], ln["reason"]) for ln in skipped] == [
        ("late", "sampled 4 adapter versions before v5 > max_staleness 3")]
    [step] = [ln for ln in lines if ln["kind"] == "step"]
    assert dict(zip(step["uids"], step["staleness"])) == {"fresh": 0, "near": 3}
    after = metrics.STALENESS.collect()[0]
    assert next(s.value for s in after.samples if s.name.endswith("_count")) == count + 2


def test_several_epochs_clip_against_the_weights_before_the_first(own, tmp_path):
    """Decoupled with --train-epochs 2: the proximal log-probs are the model's before the
    first epoch, fixed for both (each epoch's own forward would make the clip never bind)."""
    import mlx.core as mx

    from rlproxy.training.chunked_grad import chunked_logprobs

    trainer = Trainer(make_settings(tmp_path, train=True, batch_size=2, train_epochs=2,
                                    baseline="none", save_interval=1000, learning_rate=1e-2),
                      training_copy(own), own.lora_config, data_dir=tmp_path)
    seen = []
    real = trainer.learner.forward_backward

    def forward_backward(examples, between):
        seen.append([list(e["prox"]) for e in examples])
        return real(examples, between)
    trainer.learner.forward_backward = forward_backward
    batch = [scored(own, "a", [0, 0, 0]), scored(own, "b", [0, 0])]
    examples = [trainer.runner.example(s) for s in batch]
    before = [chunked_logprobs(trainer.learner.model, mx.array(e["ids"][:-1])[None],
                               mx.array(e["ids"][1:])[None], e["mask"], 128)[0].tolist()
              for e in examples]
    lines = trainer.train_batch(batch)
    assert [ln["epoch"] for ln in lines] == [0, 1]
    assert {ln["off_policy"] for ln in lines} == {"decoupled"}
    assert seen[0] == seen[1]  # the same anchor in both epochs
    for got, want in zip(seen[0], before):
        assert got == pytest.approx(want, abs=1e-5)
    trainer.stop()
