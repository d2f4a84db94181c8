"""Data-parallel training under `mlx.launch --backend ring -n 2` on this machine, with real
processes: offline and live training equal one process's (training/distributed.py). Failures
and the Tinker API: test_distributed_failure.py."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_map

from rlproxy.cli import main
from rlproxy.training.examples import shards
from conftest import read_records
from launched import LAUNCH, Served, launch

pytestmark = pytest.mark.skipif(LAUNCH is None, reason="mlx.launch is not installed")


def adapter(out: Path, step: int) -> dict:
    return mx.load(str(out / "checkpoints" / f"step_{step:06d}" / "adapters.safetensors"))


def relative_distances(a: dict, b: dict) -> dict[str, float]:
    assert a.keys() == b.keys() and a
    return {k: (mx.linalg.norm(a[k] - b[k]) / mx.maximum(mx.linalg.norm(a[k]), 1e-12)).item()
            for k in a}


def test_shards_are_balanced_by_tokens_and_keep_each_example_whole():
    examples = [{"ids": [0] * n, "name": i} for i, n in enumerate([100, 10, 60, 50, 30, 5])]
    size = lambda e: len(e["ids"])  # noqa: E731
    split = shards(examples, 2, size)
    assert sorted(e["name"] for s in split for e in s) == list(range(6))  # each once, whole
    loads = [sum(len(e["ids"]) for e in s) for s in split]
    assert loads == [130, 125]  # 100+30 | 60+50+10+5: longest first to the lighter shard
    assert [e["name"] for e in split[1]] == [1, 2, 3, 5]  # batch order kept within a shard
    assert shards(examples[:1], 3, size)[1:] == [[], []]  # fewer examples than ranks: empty


def test_a_resumed_learner_sends_its_state_in_the_order_a_fresh_one_reads_it(tmp_path):
    """The state rank 0 sends after a resume or rollback (adapter + AdamW moments) is read by a
    worker whose optimizer was never loaded: both must list it in one order, or the moments
    land on the wrong tensors (a loaded checkpoint's state comes back in another order)."""
    from rlproxy.serving.model import load_serving_model
    from rlproxy.settings import ModelSettings, load_settings
    from rlproxy.training.distributed import set_state, state_items
    from rlproxy.training.learner import LocalLearner, training_copy
    from rlproxy.training.rank_link import flat

    settings = load_settings({"model": "tiny", "data_dir": str(tmp_path)}, environ={})
    loaded = load_serving_model(ModelSettings(model="tiny"), lora_seed=0)

    def learner() -> LocalLearner:
        return LocalLearner(settings, training_copy(loaded), loaded.lora_config,
                            tmp_path / "checkpoints")

    trained, fresh = learner(), learner()
    trained.accumulate(tree_map(lambda p: p * 3 + 1, trained.model.trainable_parameters()))
    trained.optim_step(1e-3)  # moments that differ from tensor to tensor of one shape
    resumed = learner()
    resumed.load_state(trained.save_state(1, 1, {}))
    sent = state_items(resumed)
    assert [k for k, _ in sent] == [k for k, _ in state_items(fresh)]
    set_state(fresh, flat([v for _, v in sent]))  # what a worker does with it
    for (k, a), (_, b) in zip(state_items(trained), state_items(fresh)):
        assert mx.array_equal(a, b).item(), k


@pytest.mark.slow
def test_train_from_records_on_two_ranks_equals_one_process(recorded, tmp_path):
    """`rlproxy train --from … --train-seed 0` under mlx.launch on 2 ranks writes the adapter one
    process writes, within 1e-3 per LoRA tensor, and the same step losses; rank 1 trained half
    the tokens (its shard is in the step line), with no data dir of its own."""
    flags = ["--from", str(recorded), "--model", "tiny", "--batch-size", "4",
             "--learning-rate", "1e-3", "--train-seed", "0", "--log-level", "WARNING"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["train", *flags, "--data-dir", str(one)]) == 0
    p = launch(["train", *flags, "--data-dir", str(two)], stdout=subprocess.PIPE,
               stderr=subprocess.STDOUT, text=True)
    out, _ = p.communicate(timeout=300)
    assert "[WARN] Node with rank" not in out, out  # mlx.launch itself exits 0 whatever happens
    assert "8 turns, 2 steps" in out
    distances = relative_distances(adapter(one, 2), adapter(two, 2))
    assert max(distances.values()) <= 1e-3, distances
    lines_one, lines_two = read_records(one, "training.jsonl"), read_records(two, "training.jsonl")
    assert [s["loss"] for s in lines_one] == pytest.approx([s["loss"] for s in lines_two],
                                                           rel=1e-4, abs=1e-6)
    for line in lines_two:  # the batch was split: both ranks had tokens to train
        assert len(line["shard_tokens"]) == 2 and all(line["shard_tokens"]), line
    assert "shard_tokens" not in lines_one[0]
    # and training moved the adapter (lora_b starts at 0): the equality is not of two fresh ones
    assert any(mx.abs(v).max().item() > 0 for k, v in adapter(two, 2).items() if "lora_b" in k)


def probe(s: Served) -> list[float]:
    """The served adapter's log-probs of a greedy reply to a fixed prompt."""
    out = s.chat("tell me a story", seed=0, temperature=0, logprobs=True)
    return [t["logprob"] for t in out["choices"][0]["logprobs"]["content"]]


@pytest.mark.slow
def test_a_live_server_on_two_ranks_serves_what_one_process_trains(tmp_path):
    """Rank 0 serves and records, both ranks train: after two steps on the same turns the
    served log-probs equal a one-process server's within 1e-3 (the second step proves rank 1
    applied the first update as rank 0 did: only the first sends the state)."""
    served = {}
    for ranks in (1, 2):
        s = Served(tmp_path / f"r{ranks}", ranks)
        try:
            before = probe(s)
            s.turns(0)
            s.wait(lambda h: h["trainer"]["steps"] >= 1)
            s.turns(4)
            h = s.wait(lambda h: h["trainer"]["steps"] >= 2 and h["adapter_version"] >= 2)
            served[ranks] = probe(s)
            assert h["trainer"]["error"] is None
            assert h["trainer"].get("ranks") == (2 if ranks == 2 else None)
            assert h["ranks"] == {"size": ranks, "error": None}
        finally:  # every rank is sound: SIGTERM stops rank 0 (it stops the others)
            out = s.stop(signal.SIGTERM)
        assert "[WARN] Node with rank" not in out, out[-3000:]
        assert "not stopping" not in out
        assert max(abs(a - b) for a, b in zip(before, served[ranks])) > 1e-3  # it learned
        if ranks == 2:
            steps = read_records(tmp_path / "r2", "training.jsonl")
            assert [len(line["shard_tokens"]) for line in steps] == [2, 2]
            assert "rank 1 of 2: a gradient worker" in out
            assert not (tmp_path / "r2" / "rank0.log").exists()
    assert len(served[1]) == len(served[2]) > 0
    assert max(abs(a - b) for a, b in zip(served[1], served[2])) <= 1e-3, served
