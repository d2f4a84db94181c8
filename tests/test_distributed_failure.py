"""Under `mlx.launch --backend ring -n 2`: a worker rank that dies or hangs pauses training while
serving goes on, and an rlproxy learner's Tinker API trains on two ranks as on one
(training/distributed.py, tinker/ranks.py)."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import requests

from conftest import read_records
from launched import LAUNCH, Served

pytestmark = pytest.mark.skipif(LAUNCH is None, reason="mlx.launch is not installed")


def training_paused(s: Served, timeout: float) -> dict:
    """/healthz once the trainer says it waits for the learner (here: the other ranks)."""
    return s.wait(lambda h: (h["trainer"]["error"] or "").startswith(
        "training waits for the learner"), timeout=timeout)


def assert_failed_uncharged(data_dir) -> None:
    """A step failed for the ranks' sake, and the poison-turn journal blamed no turn for it."""
    failed = [line for line in read_records(data_dir, "train_journal.jsonl")
              if line["kind"] == "step_end" and not line["ok"]]
    assert failed and not any(line["charged"] for line in failed), failed


@pytest.mark.slow
def test_a_killed_worker_rank_pauses_training_and_serving_goes_on(tmp_path):
    """SIGKILL rank 1: mlx.launch then sends rank 0 SIGTERM, and rank 0 finds the ring broken,
    so it serves on (its output moves to rank0.log). /healthz says a rank failed; the next
    batch waits for the learner with no turn charged; SIGINT still stops rank 0."""
    s = Served(tmp_path / "d", 2, "--distributed-timeout-s", "30")
    try:
        s.turns(0)
        s.wait(lambda h: h["trainer"]["steps"] >= 1)
        os.kill(s.rank(1), signal.SIGKILL)
        h = s.wait(lambda h: h["trainer"]["ranks_error"] is not None, timeout=60)
        assert "rank 1 exited" in h["trainer"]["ranks_error"], h
        assert h["ranks"] == {"size": 2, "error": h["trainer"]["ranks_error"]}
        s.chat("still there?", seed=1)  # serving goes on
        s.turns(4)
        h = training_paused(s, timeout=60)
        assert "rank 1 exited" in h["trainer"]["error"], h
        assert "training waits until the launch is restarted" in h["trainer"]["error"]
        assert h["trainer"]["steps"] == 1 and h["trainer"]["quarantined"] == 0
        assert h["status"] == "ok" and s.proc.poll() is None
    finally:
        out = s.stop()
    log = (tmp_path / "d" / "rank0.log").read_text()
    assert "serves on with training paused" in out
    assert "SIGTERM: not stopping" in log
    assert_failed_uncharged(tmp_path / "d")


@pytest.mark.slow
def test_a_hung_worker_rank_fails_the_step_within_the_timeout(tmp_path):
    """SIGSTOP rank 1 (a Mac asleep, a stalled link: mlx.launch sees nothing): the next step
    fails after --distributed-timeout-s with a clear error on /healthz, no turn is charged, and
    serving goes on."""
    s = Served(tmp_path / "h", 2, "--distributed-timeout-s", "5")
    worker = s.rank(1)
    try:
        os.kill(worker, signal.SIGSTOP)
        s.turns(0)
        h = training_paused(s, timeout=120)
        assert "did not answer within 5 s" in h["trainer"]["error"], h
        assert "did not answer within 5 s" in h["trainer"]["ranks_error"]
        assert h["trainer"]["steps"] == 0 and h["trainer"]["quarantined"] == 0
        s.chat("still there?", seed=1)
    finally:
        os.kill(worker, signal.SIGKILL)
        s.stop()
    assert_failed_uncharged(tmp_path / "h")


@pytest.mark.slow
def test_the_tinker_api_trains_on_two_ranks_as_on_one(tmp_path):
    """An rlproxy learner (`--no-train`: the Tinker API that replicas train through) on 2 ranks:
    a PPO forward_backward's loss and log-probs, and, after optim_step, the next batch's, equal
    one process's within 1e-3; the second batch proves the other rank got the new weights."""
    tinker = pytest.importorskip("tinker")
    from tinker import types

    os.environ.setdefault("TINKER_TELEMETRY", "0")
    texts = [[11, 250, 37, 802, 64, 19, 555, 3, 48, 900, 71, 26, 133, 1200, 9],
             [40, 41, 600, 77, 12, 1000, 5, 388, 29],
             [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24],
             [300, 301, 302, 303, 304]]

    def datum(ids: list[int], sign: float) -> types.Datum:
        n = len(ids) - 1
        return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={
            "target_tokens": np.array(ids[1:], dtype=np.int64),
            "logprobs": np.full(n, -5.0, dtype=np.float32),
            "advantages": np.full(n, sign, dtype=np.float32)})

    data = [datum(t, 1.0 if i % 2 else -1.0) for i, t in enumerate(texts)]
    seen = {}
    for ranks in (1, 2):
        s = Served(tmp_path / f"t{ranks}", ranks, "--no-train")
        try:
            base = requests.get(s.url + "/v1/models", timeout=10).json()["data"][0]["id"]
            service = tinker.ServiceClient(base_url=s.url, api_key="tml-local")
            tc = service.create_lora_training_client(base_model=base, rank=8, seed=0).result()
            first = tc.forward_backward(data, "ppo").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            second = tc.forward_backward(data, "ppo").result()
            seen[ranks] = [(fb.metrics["loss:sum"],
                            [np.array(o["logprobs"].tolist()) for o in fb.loss_fn_outputs])
                           for fb in (first, second)]
        finally:
            out = s.stop()
        assert "[WARN] Node with rank" not in out, out[-3000:]
    for (loss1, lps1), (loss2, lps2) in zip(seen[1], seen[2]):
        assert loss2 == pytest.approx(loss1, abs=1e-3)
        assert [len(x) for x in lps1] == [len(x) for x in lps2] == [len(t) - 1 for t in texts]
        assert max(float(np.abs(a - b).max()) for a, b in zip(lps1, lps2)) <= 1e-3
    (_, before), (_, after) = seen[2]
    assert max(float(np.abs(a - b).max()) for a, b in zip(before, after)) > 1e-3  # it stepped
