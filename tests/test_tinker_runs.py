"""rlproxy as a shared Tinker learner, with the real `tinker` SDK against the real server on a free
port: clients of two sessions (two replicas) train one named run, interleaved steps equal the
same steps one after another, a run resumes from its saved state on a restarted learner, the
run's weights download through save_weights_external + get_external_weights_urls, and /healthz
and /metrics count the work."""

from __future__ import annotations

import json
import time
import os
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from conftest import ServerThread, make_settings, server_with  # noqa: E402
from test_tinker import TEXT, sft_datum  # noqa: E402

os.environ.setdefault("TINKER_TELEMETRY", "0")
KEY = "tml-local"
LR = types.AdamParams(learning_rate=1e-2)


learner = server_with(tinker_max_models=8)


def service(url: str):
    return tinker.ServiceClient(base_url=url, api_key=KEY)


def join(sc, base: str, run: str, rank: int = 4, seed: int = 7):
    return sc.create_lora_training_client(base_model=base, rank=rank, seed=seed,
                                          user_metadata={"rlproxy_run": run}).result()


def get(url: str, headers: dict | None = None) -> bytes:
    req = urllib.request.Request(url, headers={"X-API-Key": KEY, **(headers or {})})
    return urllib.request.urlopen(req, timeout=30).read()


def download(url: str, tc, name: str, into: Path) -> dict:
    """The run's weights as a replica gets them: save_weights_external, the URLs, each file."""
    path = tc.save_weights_external(name).result().path
    assert path.startswith("tinker://") and path.endswith(f"/external_weights/{name}")
    urls = tinker.RestClient(base_url=url, api_key=KEY).get_external_weights_urls(path).result()
    assert {"adapters.safetensors", "adapter_config.json"} <= set(urls.urls)
    folder = into / name
    folder.mkdir(parents=True)
    for rel, file_url in urls.urls.items():
        (folder / rel).write_bytes(get(file_url))
    import mlx.core as mx

    return {"folder": folder, "adapter": mx.load(str(folder / "adapters.safetensors"))}


def assert_same(a: dict, b: dict, atol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(np.array(a[k]), np.array(b[k]), atol=atol, err_msg=k)


def step_of(optim_result) -> int:
    return int(optim_result.metrics["rlproxy_run_step"])


def user_error(fn) -> str:
    with pytest.raises(tinker.RequestFailedError) as e:
        fn()
    assert e.value.category.value == "user", e.value
    return str(e.value)


def health(url: str) -> dict:
    return json.loads(get(f"{url}/healthz"))["tinker"]


def metric(url: str, name: str) -> float:
    for line in get(f"{url}/metrics").decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_interleaved_replicas_equal_serial_steps(learner, tiny, tmp_path):
    before = health(learner.url)
    fb_before = metric(learner.url, "rlproxy_tinker_forward_backward_total")
    a = join(service(learner.url), tiny.model_id, "r")  # two sessions: two replicas
    b = join(service(learner.url), tiny.model_id, "r")
    assert a.model_id != b.model_id and a.get_info().lora_rank == 4
    da, db = [sft_datum(TEXT[0])], [sft_datum(TEXT[1])]
    initial = download(learner.url, a, "r-initial", tmp_path)
    # interleaved: B's gradients were taken before A stepped; its step must use its batch at
    # the weights A's step left, as if the two had come one after another
    a.forward_backward(da, "cross_entropy").result()
    b.forward_backward(db, "cross_entropy").result()
    steps = [step_of(a.optim_step(LR).result()), step_of(b.optim_step(LR).result())]
    assert steps == [1, 2]
    now = health(learner.url)
    assert now["models"] == before["models"] + 1 and now["handles"] == before["handles"] + 2
    assert now["forward_backward"] == before["forward_backward"] + 2
    assert now["optim_steps"] == before["optim_steps"] + 2
    assert metric(learner.url, "rlproxy_tinker_forward_backward_total") == fb_before + 2
    assert metric(learner.url, "rlproxy_tinker_models") == now["models"]

    sa = join(service(learner.url), tiny.model_id, "s")
    sb = join(service(learner.url), tiny.model_id, "s")
    sa.forward_backward(da, "cross_entropy").result()
    assert step_of(sa.optim_step(LR).result()) == 1
    sb.forward_backward(db, "cross_entropy").result()
    assert step_of(sb.optim_step(LR).result()) == 2

    r = download(learner.url, b, "r-after", tmp_path)["adapter"]
    s = download(learner.url, sb, "s-after", tmp_path)["adapter"]
    assert_same(r, s)
    moved = [k for k in r if k.endswith("lora_b")]
    assert moved and all(np.abs(np.array(r[k]) - np.array(initial["adapter"][k])).max() > 1e-4
                         for k in moved)
    # an optim_step with nothing accumulated on that client is an error, never an empty step
    assert "no forward_backward" in user_error(lambda: a.optim_step(LR).result())
    a.forward_backward(da, "cross_entropy").result()
    assert step_of(a.optim_step(LR).result()) == 3  # the run's count, not the client's


def test_joining_with_another_rank_is_a_user_error(learner, tiny):
    join(service(learner.url), tiny.model_id, "ranked", rank=8)
    with pytest.raises(Exception, match=r"run 'ranked' trains base .* at rank 8; this client "
                       r"asked for base .* rank 16"):
        join(service(learner.url), tiny.model_id, "ranked", rank=16)
    assert join(service(learner.url), tiny.model_id, "ranked", rank=8).get_info().lora_rank == 8


def test_external_weights_open_in_mlx_lm_and_equal_the_run(learner, tiny, tmp_path):
    import mlx.core as mx
    import mlx_lm

    tc = join(service(learner.url), tiny.model_id, "ext", rank=8)
    tc.forward_backward([sft_datum(TEXT[0])], "cross_entropy").result()
    tc.optim_step(LR).result()
    state = tc.save_state("st").result().path
    got = download(learner.url, tc, "now", tmp_path)
    saved = mx.load(str(Path(learner.data_dir) / "tinker" / "ext" / "weights" / "st" /
                        "adapters.safetensors"))
    assert_same(got["adapter"], saved, atol=0)
    assert state == "tinker://ext/weights/st"
    model, _ = mlx_lm.load(tiny.source, adapter_path=str(got["folder"]))
    sampler = tc.save_weights_and_get_sampling_client().result()
    ids = TEXT[1]
    lps = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    mine = (logits - mx.logsumexp(logits, axis=-1, keepdims=True))[mx.arange(len(ids) - 1),
                                                                   mx.array(ids[1:])]
    np.testing.assert_allclose(lps[1:], np.array(mine), atol=1e-3)
    # behind a proxy the URLs name the address the client used
    run, name = "ext", "now"
    body = json.loads(get(f"{learner.url}/api/v1/training_runs/{run}/checkpoints/"
                          f"external_weights/{name}/external_weights_urls",
                          {"X-Forwarded-Proto": "https", "X-Forwarded-Host": "learner.example"}))
    assert all(u.startswith("https://learner.example/api/v1/") for u in body["urls"].values())
    with pytest.raises(urllib.error.HTTPError) as missing:
        get(f"{learner.url}/api/v1/training_runs/{run}/checkpoints/external_weights/nope/"
            "external_weights_urls")
    assert missing.value.code == 404


def test_a_restarted_learner_resumes_the_run(tiny, tmp_path):
    data = [sft_datum(TEXT[0])]
    with ServerThread(make_settings(tmp_path, tinker_max_models=4), tiny) as s:
        tc = join(service(s.url), tiny.model_id, "p")
        for _ in range(2):
            tc.forward_backward(data, "cross_entropy").result()
            tc.optim_step(LR).result()
        tc.save_state("two").result()
        before = download(s.url, tc, "before", tmp_path / "dl")["adapter"]
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(LR).result()  # not saved: a restart goes back to "two"
    with ServerThread(make_settings(tmp_path, tinker_max_models=4), tiny) as s:
        assert "rank 8" in str(pytest.raises(Exception, join, service(s.url), tiny.model_id,
                                             "p", rank=8).value)
        tc = join(service(s.url), tiny.model_id, "p")
        after = download(s.url, tc, "after", tmp_path / "dl")["adapter"]
        assert_same(before, after, atol=0)
        tc.forward_backward(data, "cross_entropy").result()
        assert step_of(tc.optim_step(LR).result()) == 3
        assert health(s.url)["models"] == 1


def test_an_idle_named_run_is_saved_before_it_leaves_memory(tiny, tmp_path):
    """At --tinker-max-models, a named run no client holds makes room, saved first: a rejoin
    resumes it; a run a client still holds is never evicted."""
    data = [sft_datum(TEXT[0])]
    with ServerThread(make_settings(tmp_path, tinker_max_models=1), tiny) as s:
        first = service(s.url)
        tc = join(first, tiny.model_id, "e1")
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(LR).result()
        with pytest.raises(Exception, match="tinker-max-models"):
            join(service(s.url), tiny.model_id, "e2")
        first.close("success").result()
        assert health(s.url) == {"enabled": True, "models": 1, "handles": 0,
                                 "forward_backward": 1, "optim_steps": 1, "samplers": 0}
        second = service(s.url)
        join(second, tiny.model_id, "e2")  # e1 is saved and leaves
        assert (tmp_path / "tinker" / "e1" / "weights" / "evicted-step-1").is_dir()
        second.close("success").result()
        again = join(service(s.url), tiny.model_id, "e1")
        again.forward_backward(data, "cross_entropy").result()
        assert step_of(again.optim_step(LR).result()) == 2


def test_a_client_that_stops_heartbeating_frees_its_run(tiny, tmp_path, monkeypatch):
    """A replica killed without finishing its session holds its run only until its heartbeats
    stop for SESSION_EXPIRY_S: then the run is saved and makes room like an idle one; a run
    whose client keeps beating is never taken."""
    from rlproxy.tinker import runs
    # the SDK beats every 10 s: by hand, every 0.2 s, against an expiry that leaves a beat slow
    # on a loaded machine seconds of room (1 s expired the live one too at load average 15)
    monkeypatch.setattr(runs, "SESSION_EXPIRY_S", 3.0)
    data = [sft_datum(TEXT[0])]
    with ServerThread(make_settings(tmp_path, tinker_max_models=2), tiny) as s:
        alive = join(service(s.url), tiny.model_id, "h2")  # the least recently used run
        silent = join(service(s.url), tiny.model_id, "h1")  # never closed: as if killed
        silent.forward_backward(data, "cross_entropy").result()
        silent.optim_step(LR).result()
        sid = alive.model_id.split(":")[0]
        silent_since = time.monotonic()
        while time.monotonic() - silent_since < 4.0:  # h2 beats; h1 is silent past the expiry
            req = urllib.request.Request(
                s.url + "/api/v1/session_heartbeat", data=json.dumps({"session_id": sid})
                .encode(), headers={"X-API-Key": KEY, "Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=10).read()
            time.sleep(0.2)
        join(service(s.url), tiny.model_id, "h3")  # h1 makes room, h2 stays
        assert (tmp_path / "tinker" / "h1" / "weights" / "evicted-step-1").is_dir()
        assert not (tmp_path / "tinker" / "h2" / "weights").exists()
        alive.forward_backward(data, "cross_entropy").result()  # its handle still works
        assert step_of(alive.optim_step(LR).result()) == 1
