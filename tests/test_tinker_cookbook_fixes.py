"""What tinker-cookbook recipes need of rlproxy's Tinker API, with the real `tinker` SDK against the
real server on a free port: an RL step's burst of first samples on fresh sampler weights all
succeed (one load, shared), a replaced or dropped adapter lets the jobs admitted on it finish on
its weights, a client that exits without close() frees its run's slot, and at the slot limit an
idle run is saved and evicted, then loaded back, unchanged, on its client's next request."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
import urllib.request

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from conftest import ServerThread, make_settings  # noqa: E402
from test_tinker import PROMPT, TEXT, sft_datum  # noqa: E402

os.environ.setdefault("TINKER_TELEMETRY", "0")
KEY = "tml-local"
LR = types.AdamParams(learning_rate=1e-2)


def service(url: str):
    return tinker.ServiceClient(base_url=url, api_key=KEY)


def health(url: str) -> dict:
    req = urllib.request.Request(f"{url}/healthz", headers={"X-API-Key": KEY})
    return json.loads(urllib.request.urlopen(req, timeout=30).read())["tinker"]


def step(tc) -> int:
    """One SFT step; the run's step count after it."""
    tc.forward_backward([sft_datum(TEXT[0])], "cross_entropy").result()
    return int(tc.optim_step(LR).result().metrics["rlproxy_run_step"])


def test_a_burst_of_first_samples_on_fresh_sampler_weights_all_succeed(tiny, tmp_path):
    """The cookbook's RL loop: save_weights_and_get_sampling_client, then every rollout at once.
    Each of 8 concurrent first samples must succeed, round after round (each round new weights,
    so a new sampler to load). Before the fix each request loaded its own copy and re-added the
    adapter, failing the jobs queued on the one before: 'adapter ... was replaced'."""
    with ServerThread(make_settings(tmp_path, tinker_max_models=2), tiny) as s:
        tc = service(s.url).create_lora_training_client(base_model=tiny.model_id, rank=4,
                                                        seed=0).result()
        greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
        prompt = types.ModelInput.from_ints(PROMPT)
        for round_ in range(4):
            step(tc)
            sampler = tc.save_weights_and_get_sampling_client().result()
            burst = [sampler.sample(prompt, 1, greedy) for _ in range(8)]
            outcomes = []
            for f in burst:
                try:
                    outcomes.append(list(f.result().sequences[0].tokens))
                except Exception as e:  # collected, so the assertion shows every failure
                    outcomes.append(f"{type(e).__name__}: {e}")
            failed = [o for o in outcomes if isinstance(o, str)]
            assert not failed, f"round {round_}: {len(failed)} of 8 failed: {failed[:2]}"
            assert all(o == outcomes[0] and o for o in outcomes), outcomes  # one set of weights
            assert health(s.url)["samplers"] == round_ + 1


def test_replacing_or_dropping_an_adapter_never_fails_jobs_already_admitted(own):
    """On the real engine: jobs admitted on adapter 'a' finish on the weights they were admitted
    with after 'a' names other weights (and after it is dropped); the same model added again
    changes nothing; jobs admitted later decode with the new weights."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    from rlproxy.serving.engine import Engine, Job, SamplingParams
    from rlproxy.tinker import models

    def adapter(seed: int):
        model = models.lora_model(own, own.lora_config, seed)
        mx.random.seed(seed)
        model.update(tree_unflatten([(k, mx.random.normal(v.shape) * 0.5)
                                     for k, v in tree_flatten(model.trainable_parameters())]))
        mx.eval(model.parameters())
        return model

    first, second = adapter(1), adapter(2)
    engine = Engine(own.model, own.tokenizer.eos_token_ids)
    engine.start()

    def submit(name: str) -> tuple[Job, list]:
        got: list = []
        job = Job(list(PROMPT), SamplingParams(max_tokens=12, temperature=0.0), got.append,
                  adapter=name)
        return engine.submit(job), got

    def tokens(got: list) -> list[int]:
        deadline = time.monotonic() + 60
        while not got or got[-1].finish_reason is None:
            assert time.monotonic() < deadline, got
            time.sleep(0.01)
        errors = [s.error for s in got if s.error]
        assert not errors, errors
        return [s.token.id for s in got]

    try:
        engine.add_adapter("a", first)
        alone = tokens(submit("a")[1])
        engine.add_adapter("b", second)
        on_second = tokens(submit("b")[1])
        assert alone != on_second  # the two adapters decode differently
        queued = [submit("a") for _ in range(4)]  # admitted on FIRST
        engine.add_adapter("a", first)  # the same weights again: nothing changes
        engine.add_adapter("a", second)  # replaced while those decode
        later = submit("a")
        assert [tokens(got) for _, got in queued] == [alone] * 4
        assert tokens(later[1]) == on_second
        queued = [submit("b") for _ in range(3)]
        engine.drop_adapter("b")  # dropped while they decode
        assert [tokens(got) for _, got in queued] == [on_second] * 3
        dropped = Job(list(PROMPT), SamplingParams(max_tokens=4), lambda s: None, adapter="b")
        got: list = []
        dropped.deliver = got.append
        engine.submit(dropped)
        deadline = time.monotonic() + 30
        while not got:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert "no adapter named 'b'" in got[-1].error  # a new job on a dropped name: refused
    finally:
        engine.stop()


EXITING_CLIENT = textwrap.dedent("""
    import os, sys
    import numpy as np
    import tinker
    from tinker import types
    os.environ["TINKER_TELEMETRY"] = "0"
    url, base = sys.argv[1], sys.argv[2]
    tc = tinker.ServiceClient(base_url=url, api_key="tml-local").create_lora_training_client(
        base_model=base, rank=4, seed=3).result()
    ids = list(range(11, 27))
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={
        "target_tokens": np.array(ids[1:], dtype=np.int64),
        "weights": np.ones(len(ids) - 1, dtype=np.float32)})
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    print(tc.model_id, flush=True)
    # and exits without ServiceClient.close(), as the cookbook's recipes do
""")


def test_a_client_that_exits_without_close_frees_its_slot(tiny, tmp_path, monkeypatch):
    """A real client process trains a step and exits without close(). Its slot is refused to
    others while its session may still be alive (the refusal says when it frees), and is free
    once the session has been silent for SESSION_EXPIRY_S (3 s here; idle eviction kept out of
    the way); its trained run is saved first, not lost."""
    from rlproxy.tinker import runs

    monkeypatch.setattr(runs, "SESSION_EXPIRY_S", 3.0)
    monkeypatch.setattr(runs, "IDLE_S", 3600.0)
    with ServerThread(make_settings(tmp_path, tinker_max_models=1), tiny) as s:
        out = subprocess.run([sys.executable, "-c", EXITING_CLIENT, s.url, tiny.model_id],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        gone = out.stdout.split()[-1]
        exited = time.monotonic()
        assert health(s.url)["handles"] == 1  # nobody told the server it left
        sc = service(s.url)
        while True:  # retried as a user would, until the slot frees
            try:
                tc = sc.create_lora_training_client(base_model=tiny.model_id, rank=4).result()
                break
            except tinker.RequestFailedError as e:
                assert "tinker-max-models 1" in str(e) and "the next slot frees in about" in str(e)
                assert time.monotonic() - exited < 15, "the exited client's slot never freed"
                time.sleep(0.5)
        assert health(s.url)["handles"] == 1 and health(s.url)["models"] == 1
        assert step(tc) == 1
        saved = tmp_path / "tinker" / gone.replace(":", "_") / "weights" / "evicted-step-1"
        assert saved.is_dir(), list((tmp_path / "tinker").rglob("*"))
        sc.close("success").result()
        again = service(s.url).create_training_client_from_state_with_optimizer(
            f"tinker://{saved.parent.parent.name}/weights/evicted-step-1").result()
        assert step(again) == 2  # what the exited client learned goes on, AdamW step and all


def test_an_idle_run_is_evicted_for_a_new_one_and_comes_back_unchanged(tiny, tmp_path,
                                                                        monkeypatch):
    """One slot. While A's run is in use a new run is refused, saying when the slot frees; once
    A's run has had no request for IDLE_S it is saved and evicted for B's; A's next request loads
    it back (same log-probs, same step count, AdamW state kept), evicting B's idle run in turn."""
    from rlproxy.tinker import runs

    monkeypatch.setattr(runs, "IDLE_S", 3600.0)
    data = [sft_datum(TEXT[1])]
    with ServerThread(make_settings(tmp_path, tinker_max_models=1), tiny) as s:
        a = service(s.url).create_lora_training_client(base_model=tiny.model_id, rank=4,
                                                       seed=5).result()
        assert step(a) == 1
        before = a.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
        b_service = service(s.url)
        with pytest.raises(tinker.RequestFailedError) as refused:
            b_service.create_lora_training_client(base_model=tiny.model_id, rank=4).result()
        message = str(refused.value)
        assert "already holds 1 Tinker training runs" in message
        assert re.search(r"the next slot frees in about 3[56]\d\d s, when run '\S+' has had "
                         r"no request for 3600 s", message), message

        monkeypatch.setattr(runs, "IDLE_S", 0.5)
        time.sleep(0.6)
        b = b_service.create_lora_training_client(base_model=tiny.model_id, rank=4).result()
        a_run = tmp_path / "tinker" / a.model_id.replace(":", "_")
        assert (a_run / "weights" / "evicted-step-1" / "optimizer.safetensors").is_file()
        assert health(s.url)["models"] == 1 and health(s.url)["handles"] == 2

        time.sleep(0.6)  # B's run idle now: A's request evicts it and loads A's back
        after = a.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
        np.testing.assert_array_equal(np.asarray(before.tolist()), np.asarray(after.tolist()))
        assert step(a) == 2  # the run's step count survived the round trip
        assert (tmp_path / "tinker" / b.model_id.replace(":", "_") / "weights" /
                "evicted-step-0").is_dir()
        time.sleep(0.6)
        assert step(b) == 1  # and B's comes back in turn
