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
from mlx.utils import tree_map
import numpy as np
import pytest
import requests

from rlproxy.cli import main
from rlproxy.training.examples import shards
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


SERVE = ["serve", "--model", "tiny", "--no-judge", "--no-at-least-one", "--reward-function",
         "test_trainer:target_reward", "--batch-size", "4", "--learning-rate", "1e-3",
         "--train-seed", "0", "--eval-every", "0", "--log-level", "INFO"]


def children(pid: int) -> list[int]:
    """PID's child processes (mlx.launch starts each rank from a thread of its own)."""
    return [int(c) for task in Path(f"/proc/{pid}/task").glob("*")
            for c in (task / "children").read_text().split()]


def rank_pid(launcher: int, rank: int) -> int:
    """The process mlx.launch started as RANK (its launch script execs the command)."""
    for pid in children(launcher):
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"MLX_RANK={rank}".encode() in env:
            return pid
    raise AssertionError(f"no rank {rank} under {launcher}")


class Served:
    """`rlproxy serve` on RANKS ranks (mlx.launch) or in one plain process, until stopped with
    SIGINT to rank 0 (rank 0 then tells the others to stop)."""

    def __init__(self, data: Path, ranks: int, *extra: str):
        self.port = free_ports(1)
        args = [*SERVE, "--data-dir", str(data), "--port", str(self.port), *extra]
        self.log = (data.parent / f"{data.name}.out").open("w")
        if ranks > 1:
            self.proc = launch(args, ranks, stdout=self.log, stderr=subprocess.STDOUT)
        else:
            env = {**os.environ, "PYTHONPATH": str(TESTS)}
            self.proc = subprocess.Popen([sys.executable, "-m", "rlproxy.cli", *args], env=env,
                                         stdout=self.log, stderr=subprocess.STDOUT)
        self.ranks, self.url = ranks, f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 180
        while True:
            assert self.proc.poll() is None, self.output()
            assert time.time() < deadline, self.output()
            try:
                if requests.get(self.url + "/healthz", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.5)

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def rank(self, r: int) -> int:
        return rank_pid(self.proc.pid, r) if self.ranks > 1 else self.proc.pid

    def health(self) -> dict:
        return requests.get(self.url + "/healthz", timeout=10).json()

    def chat(self, text: str, seed: int, session: str | None = None, **kw) -> dict:
        headers = {"X-Session-Id": session, "X-Session-Done": "1"} if session else {}
        r = requests.post(self.url + "/v1/chat/completions", headers=headers, timeout=120, json={
            "model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 10,
            "seed": seed, **kw})
        assert r.status_code == 200, r.text
        return r.json()

    def turns(self, first: int, n: int = 4) -> None:
        for i in range(first, first + n):
            self.chat(f"hello {i}", seed=i, session=f"s-{i}")

    def wait(self, what, timeout: float = 180) -> dict:
        deadline = time.time() + timeout
        while not what(h := self.health()):
            assert time.time() < deadline, (h, self.output()[-3000:])
            time.sleep(0.3)
        return h

    def stop(self) -> str:
        if self.proc.poll() is None:
            try:
                os.kill(self.rank(0), signal.SIGINT)
            except (AssertionError, ProcessLookupError):
                self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                for pid in children(self.proc.pid):
                    os.kill(pid, signal.SIGKILL)
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return Path(self.log.name).read_text()


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
        finally:
            out = s.stop()
        assert "[WARN] Node with rank" not in out, out[-3000:]
        assert max(abs(a - b) for a, b in zip(before, served[ranks])) > 1e-3  # it learned
        if ranks == 2:
            steps = read_records(tmp_path / "r2", "training.jsonl")
            assert [len(line["shard_tokens"]) for line in steps] == [2, 2]
            assert "rank 1 of 2: a gradient worker" in out
            assert not (tmp_path / "r2" / "rank0.log").exists()
    assert len(served[1]) == len(served[2]) > 0
    assert max(abs(a - b) for a, b in zip(served[1], served[2])) <= 1e-3, served


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
        h = s.wait(lambda h: (h["trainer"]["error"] or "").startswith(
            "training waits for the learner"), timeout=60)
        assert "rank 1 exited" in h["trainer"]["error"], h
        assert "training waits until the launch is restarted" in h["trainer"]["error"]
        assert h["trainer"]["steps"] == 1 and h["trainer"]["quarantined"] == 0
        assert h["status"] == "ok" and s.proc.poll() is None
    finally:
        out = s.stop()
    log = (tmp_path / "d" / "rank0.log").read_text()
    assert "serves on with training paused" in out
    assert "SIGTERM: not stopping" in log
    failed = [line for line in read_records(tmp_path / "d", "train_journal.jsonl")
              if line["kind"] == "step_end" and not line["ok"]]
    assert failed and not any(line["charged"] for line in failed), failed  # turns not blamed


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
        h = s.wait(lambda h: (h["trainer"]["error"] or "").startswith(
            "training waits for the learner"), timeout=120)
        assert "did not answer within 5 s" in h["trainer"]["error"], h
        assert "did not answer within 5 s" in h["trainer"]["ranks_error"]
        assert h["trainer"]["steps"] == 0 and h["trainer"]["quarantined"] == 0
        s.chat("still there?", seed=1)
    finally:
        os.kill(worker, signal.SIGKILL)
        s.stop()
    failed = [line for line in read_records(tmp_path / "h", "train_journal.jsonl")
              if line["kind"] == "step_end" and not line["ok"]]
    assert failed and not any(line["charged"] for line in failed), failed


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
