"""Data-parallel training under `mlx.launch --backend ring -n 2` on this machine, with real
processes: offline and live training equal one process's, and a rank that dies or hangs pauses
training while serving goes on (training/distributed.py)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
import requests

from rlproxy.cli import main
from rlproxy.training.distributed import split
from conftest import read_records

TESTS = Path(__file__).resolve().parent
LAUNCH = shutil.which("mlx.launch")
pytestmark = pytest.mark.skipif(LAUNCH is None, reason="mlx.launch is not installed")


def free_ports(n: int) -> int:
    """A port P with P .. P+N-1 free (the ring backend listens on one per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no run of free ports")


def launch(args: list[str], ranks: int = 2, **popen) -> subprocess.Popen:
    """`mlx.launch --backend ring -n RANKS -- python -m rlproxy.cli ARGS`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get(
        "PYTHONPATH", "")])}
    return subprocess.Popen(
        [LAUNCH, "--backend", "ring", "-n", str(ranks), "--starting-port",
         str(free_ports(ranks)), "--", sys.executable, "-m", "rlproxy.cli", *args],
        env=env, **popen)


def adapter(out: Path, step: int) -> dict:
    return mx.load(str(out / "checkpoints" / f"step_{step:06d}" / "adapters.safetensors"))


def relative_distances(a: dict, b: dict) -> dict[str, float]:
    assert a.keys() == b.keys() and a
    return {k: (mx.linalg.norm(a[k] - b[k]) / mx.maximum(mx.linalg.norm(a[k]), 1e-12)).item()
            for k in a}


def test_shards_are_balanced_by_tokens_and_keep_each_example_whole():
    examples = [{"ids": [0] * n, "name": i} for i, n in enumerate([100, 10, 60, 50, 30, 5])]
    shards = split(examples, 2)
    assert sorted(e["name"] for s in shards for e in s) == list(range(6))  # each once, whole
    loads = [sum(len(e["ids"]) for e in s) for s in shards]
    assert loads == [130, 125]  # 100+30 | 60+50+10+5: longest first to the lighter shard
    assert [e["name"] for e in shards[1]] == [1, 2, 3, 5]  # batch order kept within a shard
    assert split(examples[:1], 3)[1:] == [[], []]  # fewer examples than ranks: empty shards


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
