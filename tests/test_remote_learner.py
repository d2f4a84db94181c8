"""--trainer tinker: replicas train on a learner elsewhere over the Tinker API, on real parts.

The learner is a real `rlproxy serve` process (it answers the Tinker API on /api/v1); replicas
are real `rlproxy serve --trainer tinker` processes driven through the `openai` SDK, with a
verifiable reward function; the learner is checked through the real `tinker` SDK. The learner's
own tests (named runs, atomic steps, downloads) are tests/test_tinker_runs.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import openai
import pytest
import requests

from conftest import read_records
from rlproxy.ops.served import free_port, server_env, wait_healthy

TESTS = Path(__file__).resolve().parent
KEY = "tml-remote-test"
pytestmark = pytest.mark.slow


class Server:
    """An `rlproxy serve --model tiny` process on a free port."""

    def __init__(self, data_dir: Path, *flags: str, port: int | None = None, key=KEY):
        self.data_dir, self.port = Path(data_dir), port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = self.data_dir.with_suffix(".log")
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        env = {**server_env(TESTS), "TINKER_API_KEY": key, "TINKER_TELEMETRY": "0"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlproxy.cli", "serve", "--model", "tiny", "--port",
             str(self.port), "--data-dir", str(self.data_dir), "--no-fsync", *flags],
            stdout=self.log.open("ab"), stderr=subprocess.STDOUT, env=env)

    def wait(self, timeout: float = 120) -> "Server":
        wait_healthy(self.proc, self.url, self.log, timeout)
        return self

    def health(self) -> dict:
        return requests.get(self.url + "/healthz", timeout=10).json()

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def replica_flags(learner: Server, run: str) -> list[str]:
    return ["--trainer", "tinker", "--tinker-url", learner.url, "--tinker-run", run,
            "--tinker-timeout-s", "10", "--no-judge", "--reward-function",
            "test_trainer:target_reward", "--baseline", "none", "--batch-size", "2",
            "--learning-rate", "0.02", "--no-prefix-cache"]


def until(check, timeout: float = 60, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def drive(server: Server, sessions: list[str], seed: int = 0) -> None:
    """One ended session per name: a turn each, released to scoring and training."""
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    for i, sid in enumerate(sessions):
        c.chat.completions.create(model="m", max_tokens=8, seed=seed + i, temperature=1.0,
                                  messages=[{"role": "user", "content": f"count {sid}"}],
                                  extra_headers={"X-Session-Id": sid})
        requests.post(f"{server.url}/v1/sessions/{sid}/end", timeout=30).raise_for_status()


def greedy_logprobs(server: Server) -> np.ndarray:
    """The served log-probs of one greedy reply, not recorded (opted out)."""
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    r = c.chat.completions.create(model="m", max_tokens=6, temperature=0, logprobs=True,
                                  messages=[{"role": "user", "content": "the same probe"}],
                                  extra_headers={"X-RL-Opt-Out": "1"})
    return np.array([t.logprob for t in r.choices[0].logprobs.content])


def handled(server: Server) -> int:
    t = server.health()["trainer"]
    return t["turns_trained"] + t["skipped"]


def probe(server: Server, sid: str) -> dict:
    """A greedy turn in session SID, ended; its record (prompt ids, completion ids, log-probs)."""
    drive(server, [sid])
    return until(lambda: next((r for r in read_records(server.data_dir)
                               if r.get("session_id") == sid), None), 30, f"record of {sid}")


def learner_logprobs(learner: Server, run: str | None, ids: list[int]) -> np.ndarray:
    """The learner's own log-probs of IDS under RUN's current weights (None: the base)."""
    import tinker
    sc = tinker.ServiceClient(base_url=learner.url, api_key=KEY)
    if run is None:
        sampler = sc.create_sampling_client(base_model="rlproxy-embedded-tiny").result()
    else:
        tc = sc.create_lora_training_client(base_model="rlproxy-embedded-tiny", rank=8,
                                            train_unembed=False,
                                            user_metadata={"rlproxy_run": run}).result()
        path = tc.save_weights_for_sampler(f"check-{time.time_ns()}").result().path
        sampler = sc.create_sampling_client(model_path=path).result()
    lps = sampler.compute_logprobs(tinker.types.ModelInput.from_ints(ids)).result()
    sc.close("success").result()
    return np.array([np.nan if v is None else v for v in lps], dtype=np.float64)


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("learner") / "data", "--no-train",
               "--tinker-max-models", "16").wait()
    yield s
    s.stop()


def test_replica_trains_on_the_learner_and_serves_the_learners_weights(learner, tmp_path):
    rep = Server(tmp_path / "r1", *replica_flags(learner, "shared")).wait()
    try:
        before = probe(rep, "probe-before")
        drive(rep, [f"a{i}" for i in range(5)])
        until(lambda: handled(rep) >= 6 and rep.health()["trainer"]["remote_step"], 60,
              "the turns to train")
        t = rep.health()["trainer"]
        assert t["backend"] == "tinker" and t["run"] == "shared" and t["error"] is None
        assert t["url"] == learner.url and t["remote_step"] >= 2 and t["syncs"] >= 2
        lines = [json.loads(x) for x in (rep.data_dir / "training.jsonl").read_text().splitlines()]
        assert lines and all(ln["backend"] == "tinker" for ln in lines)
        steps = [ln for ln in lines if ln["kind"] == "step"]
        assert [ln["step"] for ln in steps] == list(range(1, len(steps) + 1))
        tinker_counts = learner.health()["tinker"]
        assert tinker_counts["optim_steps"] >= len(steps)

        after = probe(rep, "probe-after")  # one turn: it waits for a batch partner, untrained
        ids = after["prompt_ids"] + after["choices"][0]["completion_ids"]
        served = np.array(after["choices"][0]["logprobs"])
        assert min(after["choices"][0]["adapter_versions"]) > before["choices"][0][
            "adapter_versions"][0]
        n = len(after["choices"][0]["completion_ids"])
        theirs = learner_logprobs(learner, "shared", ids)[-n:]
        assert np.abs(theirs - served).max() < 1e-3  # the learner's weights, served here
        base = learner_logprobs(learner, None, ids)[-n:]
        assert np.abs(base - served).max() > 1e-3  # and they moved off the base

        # a second replica joining the run serves the same weights from its first request
        rep2 = Server(tmp_path / "r2", *replica_flags(learner, "shared")).wait()
        try:
            again = probe(rep2, "probe-after")
            assert again["choices"][0]["completion_ids"] == after["choices"][0]["completion_ids"]
            assert np.abs(np.array(again["choices"][0]["logprobs"]) - served).max() < 1e-4
        finally:
            rep2.stop()
    finally:
        rep.stop()


def test_learner_down_mid_training_serving_goes_on_and_nothing_is_lost(tmp_path):
    lrn = Server(tmp_path / "learner", "--no-train").wait()
    rep = Server(tmp_path / "rep", *replica_flags(lrn, "outage")).wait()  # saves every 10
    try:
        drive(rep, ["b0", "b1"])
        until(lambda: handled(rep) >= 2, 60, "the first step")
        lrn.stop(signal.SIGKILL)
        drive(rep, ["b2", "b3", "b4", "b5"])  # served with the learner down
        until(lambda: "waits for the learner" in (rep.health()["trainer"]["error"] or ""), 60,
              "the trainer to report the learner down")
        assert rep.health()["status"] in ("ok", "degraded")
        lrn2 = Server(lrn.data_dir, "--no-train", port=lrn.port).wait()
        try:
            # the new learner has no saved state of the run: it starts it afresh, and the
            # turns of the step it lost (b0, b1) train again, after the four waiting ones
            until(lambda: rep.health()["trainer"]["turns_trained"] >= 8, 120,
                  "training to resume and the lost step's turns to train again")
            t = rep.health()["trainer"]
            assert t["error"] is None and t["quarantined"] == 0
            lines = [json.loads(x) for x in (rep.data_dir / "training.jsonl").read_text()
                     .splitlines()]
            recorded = {r["session_id"]: r["uid"] for r in read_records(rep.data_dir)}
            assert len(recorded) == 6
            steps = [ln for ln in lines if ln["kind"] == "step"]
            trained = [u for ln in steps for u in ln["uids"]]
            assert set(recorded.values()) <= set(trained)  # every recorded turn trained
            again = [ln for ln in lines if ln["kind"] == "train_again"]
            assert len(again) == 1 and set(again[0]["turns_again"]) == {
                recorded["b0"], recorded["b1"]}
            assert trained.count(recorded["b0"]) == 2  # once before the crash, once after
            # the run on the new learner holds every step since the crash, none twice
            assert steps[-1]["run_step"] == len(steps) - 1

            # the learner restarts while the replica is idle: its handle is unknown to the new
            # one; the replica joins again instead of blaming the turns
            lrn2.stop(signal.SIGKILL)
            lrn3 = Server(lrn.data_dir, "--no-train", port=lrn.port).wait()
            try:
                drive(rep, ["c0", "c1"])
                until(lambda: rep.health()["trainer"]["turns_trained"] >= 16, 120,
                      "the new turns, and the lost steps' six again")
                t = rep.health()["trainer"]
                assert t["quarantined"] == 0 and t["error"] is None  # nothing quarantined, training healthy
                lines = [json.loads(x) for x in (rep.data_dir / "training.jsonl").read_text()
                         .splitlines()]
                assert len([ln for ln in lines if ln["kind"] == "train_again"]) == 2

                # the replica restarts while the learner is down: it serves its last
                # checkpoint's adapter (the run's weights), not the base model
                served = greedy_logprobs(rep)
                rep.stop()
                lrn3.stop(signal.SIGKILL)
                rep = Server(rep.data_dir, *replica_flags(lrn, "outage"), port=rep.port).wait()
                assert np.abs(greedy_logprobs(rep) - served).max() < 1e-4
                assert rep.health()["trainer"]["sync_error"] or rep.health()["trainer"]["error"]
            finally:
                lrn3.stop()
        finally:
            lrn2.stop()
    finally:
        rep.stop()
        lrn.stop()


def test_refusals_are_start_up_errors(learner, tmp_path):
    guarded = Server(tmp_path / "guarded", "--no-train", "--api-key", "tml-right").wait()
    try:
        cases = [
            (Server(tmp_path / "k", *replica_flags(guarded, "k"), key="tml-wrong"),
             "refused the API key"),
            (Server(tmp_path / "b", *replica_flags(learner, "b"), "--tinker-base-model",
                    "no-such-model"), "has no base model 'no-such-model'"),
        ]
        for server, said in cases:
            assert server.proc.wait(timeout=120) == 2, server.log.read_text()
            assert said in server.log.read_text()
    finally:
        guarded.stop()
    # a run of another rank: the run exists at rank 8 (the first test's, or made here)
    first = Server(tmp_path / "r8", *replica_flags(learner, "rank8")).wait()
    first.stop()
    other = Server(tmp_path / "r4", *replica_flags(learner, "rank8"), "--lora-rank", "4")
    assert other.proc.wait(timeout=120) == 2, other.log.read_text()
    assert "rank 8" in other.log.read_text()


def test_two_replicas_stepping_at_once_equal_their_batches_applied_one_after_another(
        learner, tiny, tmp_path, monkeypatch):
    """Two replicas' learners (remote/learner.py, as `--trainer tinker` makes them) on one run,
    each forward_backward before either optim_step; then the same batches, in the order the run
    applied them, on a fresh run by one learner: the same weights."""
    from conftest import make_settings
    from rlproxy.remote.learner import RemoteLearner
    from rlproxy.training.learner import training_copy

    monkeypatch.setenv("TINKER_API_KEY", KEY)
    settings = make_settings(tmp_path, trainer="tinker", tinker_url=learner.url,
                             learning_rate=0.05)

    def replica(name: str, run: str) -> RemoteLearner:
        return RemoteLearner(settings, training_copy(tiny), tiny.lora_config,
                             tmp_path / name, "rlproxy-embedded-tiny",
                             {"run": run, "replica": name})

    rng = np.random.default_rng(0)

    def batch() -> list[dict]:
        out = []
        for _ in range(2):
            ids = [int(i) for i in rng.integers(3, 400, size=12)]
            mask = [0.0] * 5 + [1.0] * 6
            out.append({"ids": ids, "mask": mask, "tokens": 6,
                        "old": [0.0] * 5 + [float(x) for x in rng.uniform(-7, -5, 6)],
                        "adv": [0.0] * 5 + [float(x) for x in rng.normal(0, 1, 6)]})
        return out

    run = f"conc-{time.time_ns()}"
    a, b = replica("a", run), replica("b", run)
    batches = {"a": [batch() for _ in range(3)], "b": [batch() for _ in range(3)]}
    applied: list[tuple[int, list[dict]]] = []
    gate = threading.Barrier(2)
    errors = []

    def train(name: str, lrn: RemoteLearner) -> None:
        try:
            for examples in batches[name]:
                lrn.forward_backward(examples)
                gate.wait(timeout=60)  # both have gradients waiting before either steps
                out = lrn.optim_step(lrn.learning_rate())
                applied.append((out.run_step, examples))
                gate.wait(timeout=60)
        except Exception as e:  # surfaced below
            errors.append(e)
            gate.abort()

    threads = [threading.Thread(target=train, args=(n, lrn)) for n, lrn in (("a", a), ("b", b))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not errors, errors
    steps = sorted(s for s, _ in applied)
    assert steps == list(range(1, 7))  # every step one batch: none lost, none merged

    serial = replica("s", f"serial-{time.time_ns()}")
    for _, examples in sorted(applied, key=lambda x: x[0]):
        serial.forward_backward(examples)
        serial.optim_step(serial.learning_rate())
    shared, alone = a.save_weights_for_sampler(), serial.save_weights_for_sampler()
    assert set(shared) == set(alone)
    for k in shared:
        assert mx.allclose(shared[k], alone[k], atol=1e-5).item(), k
    assert any(not mx.allclose(shared[k], replica("z", run).weights[k]).item()
               for k in shared if k.endswith("lora_b"))  # it did train


def test_eval_gate_and_operator_rollback_with_a_remote_learner(learner, tmp_path):
    """--eval-every on a replica: the gate measures the run's weights locally and publishes
    them; an operator's rollback loads the checkpoint's saved state back into the run."""
    rep = Server(tmp_path / "gate", *replica_flags(learner, "gated"), "--eval-every", "1",
                 "--eval-probes", "2", "--eval-max-tokens", "4", "--save-interval", "1",
                 "--eval-tolerance", "100").wait()
    try:
        drive(rep, [f"g{i}" for i in range(4)])
        until(lambda: handled(rep) >= 4 and rep.health()["trainer"]["evals"] >= 2, 120,
              "two evaluations")
        lines = [json.loads(x) for x in (rep.data_dir / "training.jsonl").read_text()
                 .splitlines()]
        evals = [ln for ln in lines if ln["kind"] == "eval"]
        assert evals and all(ln["backend"] == "tinker" for ln in evals)
        assert rep.health()["trainer"]["error"] is None
        first = min(ln["step"] for ln in lines if ln["kind"] == "step")
        r = requests.post(f"{rep.url}/v1/adapters/{first}/serve", timeout=120)
        assert r.status_code == 200, r.text
        ckpt = rep.data_dir / "checkpoints" / f"step_{first:06d}"
        state = json.loads((ckpt / "trainer_state.json").read_text())
        assert state["backend"] == "tinker" and state["tinker_path"].startswith("tinker://gated/")
        saved = mx.load(str(ckpt / "adapters.safetensors"))
        now = requests.get(rep.url + "/healthz", timeout=10).json()["adapter_version"]
        assert now > state["adapter_version"]  # published as a new version
        # the run itself went back: its weights now are the checkpoint's
        import tinker
        sc = tinker.ServiceClient(base_url=learner.url, api_key=KEY)
        tc = sc.create_lora_training_client(base_model="rlproxy-embedded-tiny", rank=8,
                                            train_unembed=False,
                                            user_metadata={"rlproxy_run": "gated"}).result()
        from rlproxy.remote.weights import fetch
        got = fetch(tc, tinker.RestClient(base_url=learner.url, api_key=KEY), "check", KEY,
                    learner.url, 30, {k: mx.zeros_like(v) for k, v in saved.items()},
                    20.0, 10 ** 6)
        for k, v in saved.items():
            assert mx.allclose(got.weights[k], v, atol=1e-6).item(), k
    finally:
        rep.stop()


def test_a_gate_refusal_rolls_the_run_back_on_the_learner(learner, tmp_path):
    """A candidate the replica's gate refuses (here: any KL at all) is undone on the learner:
    the run is back at the good state the gate saved there, its lora_b all zero again."""
    rep = Server(tmp_path / "refuse", *replica_flags(learner, "refused"), "--eval-every", "1",
                 "--eval-probes", "2", "--eval-max-tokens", "4", "--max-kl", "1e-12").wait()
    try:
        drive(rep, ["r0", "r1"])
        until(lambda: rep.health()["trainer"]["gate_rollbacks"] >= 1, 120, "a gate rollback")
        lines = [json.loads(x) for x in (rep.data_dir / "training.jsonl").read_text()
                 .splitlines()]
        (rollback,) = [ln for ln in lines if ln["kind"] == "rollback"]
        assert rollback["gate"] and "kl" in rollback["reason"].lower()
        import tinker
        from rlproxy.remote.weights import fetch
        sc = tinker.ServiceClient(base_url=learner.url, api_key=KEY)
        tc = sc.create_lora_training_client(base_model="rlproxy-embedded-tiny", rank=8,
                                            train_unembed=False,
                                            user_metadata={"rlproxy_run": "refused"}).result()
        saved = mx.load(str(next((rep.data_dir / "checkpoints").glob("step_*"))
                            / "adapters.safetensors"))
        got = fetch(tc, tinker.RestClient(base_url=learner.url, api_key=KEY), "check", KEY,
                    learner.url, 30, {k: mx.zeros_like(v) for k, v in saved.items()}, 20.0,
                    10 ** 6)
        sc.close("success").result()
        b = [k for k in got.weights if k.endswith("lora_b")]
        assert b and all(not got.weights[k].any().item() for k in b)  # the step is undone
    finally:
        rep.stop()
