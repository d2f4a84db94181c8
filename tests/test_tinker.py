"""The Tinker API (/api/v1) with the real `tinker` SDK against the real server on a free port and
the embedded tiny model: SFT, RL (importance_sampling, ppo), sampling from saved weights, exact
prompt log-probs, save/load that resumes bit-identically, two clients at once, the async
variants, and the "user" errors bad input gets."""

from __future__ import annotations

import asyncio
import io
import json
import os
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from conftest import ServerThread, make_settings  # noqa: E402

os.environ.setdefault("TINKER_TELEMETRY", "0")
PROMPT = [5, 17, 42, 99, 7, 300]
TEXT = [[11, 250, 37, 802, 64, 19, 555, 3, 48, 900, 71, 26, 133, 1200, 9],
        [40, 41, 600, 77, 12, 1000, 5, 388, 29, 411, 73, 88, 150, 6, 16]]


@pytest.fixture(scope="module")
def tk(tiny, tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    with ServerThread(make_settings(data, tinker_max_models=32), tiny) as s:
        s.service = tinker.ServiceClient(base_url=s.url, api_key="tml-local")
        s.base = tiny.model_id
        yield s


def sft_datum(ids: list[int], prompt_len: int = 0) -> types.Datum:
    n = len(ids) - 1
    weights = np.array([0.0] * max(prompt_len - 1, 0) + [1.0] * (n - max(prompt_len - 1, 0)),
                       dtype=np.float32)
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(ids[1:], dtype=np.int64),
                                       "weights": weights})


def sft_step(tc, data, lr=2e-3) -> float:
    fb = tc.forward_backward(data, loss_fn="cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=lr)).result()
    return fb.result().metrics["loss:sum"]


def test_sft_loss_falls_by_half(tk):
    tc = tk.service.create_lora_training_client(base_model=tk.base, rank=8, seed=0).result()
    data = [sft_datum(t) for t in TEXT]
    losses = [sft_step(tc, data) for _ in range(20)]
    assert losses[-1] <= 0.5 * losses[0], losses
    out = tc.forward(data, loss_fn="cross_entropy").result()  # forward_only: no update
    assert len(out.loss_fn_outputs) == 2
    assert out.loss_fn_outputs[0]["logprobs"].shape == [len(TEXT[0]) - 1]
    assert abs(out.metrics["loss:sum"] - tc.forward(data, "cross_entropy").result()
               .metrics["loss:sum"]) < 1e-6


def test_sampler_from_saved_weights_samples_those_weights(tk, tiny):
    """Teach a client one continuation; its saved sampler greedily says it, the live adapter
    (the base model here) does not, and the saved directory is a real mlx-lm adapter."""
    import mlx_lm

    tc = tk.service.create_lora_training_client(base_model=tk.base, rank=8, seed=1).result()
    target = [800, 801, 802, 803]
    for _ in range(30):
        sft_step(tc, [sft_datum(PROMPT + target, len(PROMPT))])
    saved = tc.save_weights_for_sampler(name="taught").result().path
    assert saved.endswith("/sampler_weights/taught")
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
    prompt = types.ModelInput.from_ints(PROMPT)
    taught = tk.service.create_sampling_client(model_path=saved).result()
    live = tk.service.create_sampling_client(base_model=tk.base).result()
    both = [taught.sample(prompt, 1, greedy), live.sample(prompt, 1, greedy)]  # one batch loop
    assert list(both[0].result().sequences[0].tokens) == target
    assert list(both[1].result().sequences[0].tokens) != target
    run = saved.split("/")[2]
    path = Path(tk.data_dir) / "tinker" / run / "sampler_weights" / "taught"
    model, _ = mlx_lm.load(tiny.source, adapter_path=str(path))
    import mlx.core as mx
    nxt = model(mx.array([PROMPT])).argmax(-1)[0, -1].item()
    assert nxt == target[0]
    # listing and archive download
    listing = json.loads(urllib.request.urlopen(
        f"{tk.url}/api/v1/training_runs/{tc.model_id}/checkpoints").read())
    assert any(c["tinker_path"] == saved for c in listing["checkpoints"])
    blob = urllib.request.urlopen(
        f"{tk.url}/api/v1/training_runs/{run}/checkpoints/sampler_weights/taught/archive").read()
    names = tarfile.open(fileobj=io.BytesIO(blob)).getnames()
    assert "taught/adapters.safetensors" in names and "taught/adapter_config.json" in names


def test_compute_logprobs_equal_engine_logprobs(tk):
    tc = tk.service.create_lora_training_client(base_model=tk.base, rank=4, seed=2).result()
    sft_step(tc, [sft_datum(TEXT[0])])
    sampler = tc.save_weights_and_get_sampling_client().result()
    res = sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=3,
                         sampling_params=types.SamplingParams(max_tokens=8, seed=5)).result()
    assert len(res.sequences) == 3
    for seq in res.sequences:
        full = types.ModelInput.from_ints(PROMPT + list(seq.tokens))
        lps = sampler.compute_logprobs(full).result()
        assert lps[0] is None and len(lps) == len(PROMPT) + len(seq.tokens)
        np.testing.assert_allclose(lps[len(PROMPT):], seq.logprobs, atol=1e-4)


def test_save_and_load_resume_bit_identically(tk):
    import mlx.core as mx

    data = [sft_datum(t) for t in TEXT]
    a = tk.service.create_lora_training_client(base_model=tk.base, rank=8, seed=3).result()
    for _ in range(2):
        sft_step(a, data, lr=5e-3)
    state = a.save_state("two-steps").result().path
    sft_step(a, data, lr=5e-3)
    after_a = a.save_state("three-a").result().path
    b = tk.service.create_training_client_from_state_with_optimizer(state).result()
    sft_step(b, data, lr=5e-3)
    after_b = b.save_state("three-b").result().path

    def files(uri):
        run, kind, name = uri.removeprefix("tinker://").split("/")
        return Path(tk.data_dir) / "tinker" / run / kind / name
    for f in ("adapters.safetensors", "optimizer.safetensors"):
        x, y = mx.load(str(files(after_a) / f)), mx.load(str(files(after_b) / f))
        assert x.keys() == y.keys()
        for k in x:
            assert mx.array_equal(x[k], y[k]).item(), (f, k)
    # weights only (no optimizer): same weights, a fresh optimizer
    c = tk.service.create_training_client_from_state(state).result()
    fa = a.forward(data, "cross_entropy").result()
    fc = c.forward(data, "cross_entropy").result()
    assert fa.metrics["loss:sum"] != fc.metrics["loss:sum"]  # a trained one step further


def group_rl(tk, loss_fn: str, config: dict | None, good: set[int], iters: int = 8):
    """Reward 1 when a sample's first token is in GOOD; advantages are group-relative (reward
    minus the mean of its group of num_samples=16). Returns each iteration's mean reward."""
    tc = tk.service.create_lora_training_client(base_model=tk.base, rank=8, seed=4).result()
    prompt = types.ModelInput.from_ints(PROMPT)
    pad = len(PROMPT) - 1
    means = []
    for i in range(iters):
        sampler = tc.save_weights_and_get_sampling_client().result()
        res = sampler.sample(prompt, num_samples=16, sampling_params=types.SamplingParams(
            max_tokens=2, seed=100 * i)).result()
        rewards = np.array([float(s.tokens[0] in good) for s in res.sequences])
        means.append(rewards.mean())
        data = []
        for s, adv in zip(res.sequences, rewards - rewards.mean()):
            ids = PROMPT + list(s.tokens)
            n = len(ids) - 1
            data.append(types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={
                    "target_tokens": np.array(ids[1:], dtype=np.int64),
                    "logprobs": np.array([0.0] * pad + list(s.logprobs), dtype=np.float32),
                    "advantages": np.array([0.0] * pad + [adv] * (n - pad), dtype=np.float32)}))
        for _ in range(2):  # the second step is off-policy: where ppo's clip matters
            tc.forward_backward(data, loss_fn=loss_fn, loss_fn_config=config).result()
            tc.optim_step(types.AdamParams(learning_rate=3e-3)).result()
    return means


@pytest.fixture(scope="module")
def good_tokens(tiny):
    """The base model's 30 most likely first tokens after PROMPT: sampled now and then."""
    import mlx.core as mx

    logits = tiny.model(mx.array([PROMPT]))[0, -1]
    return set(mx.argsort(-logits)[:30].tolist())


@pytest.mark.parametrize("loss_fn,config", [
    ("importance_sampling", None),
    ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
])
def test_rl_raises_a_verifiable_reward(tk, good_tokens, loss_fn, config):
    means = group_rl(tk, loss_fn, config, good_tokens)
    print(loss_fn, "mean reward per iteration", [round(float(m), 3) for m in means])
    assert np.mean(means[-3:]) > np.mean(means[:3]) + 0.25, means


def test_two_clients_at_once_do_not_interfere(tk):
    data = [sft_datum(TEXT[0])]
    a = tk.service.create_lora_training_client(base_model=tk.base, rank=8, seed=5).result()
    b = tk.service.create_lora_training_client(base_model=tk.base, rank=4, seed=6).result()
    ref = a.forward(data, "cross_entropy").result().metrics["loss:sum"]
    futures = [b.forward_backward([sft_datum(TEXT[1])], "cross_entropy") for _ in range(3)]
    futures.append(b.optim_step(types.AdamParams(learning_rate=1e-2)))
    assert a.forward(data, "cross_entropy").result().metrics["loss:sum"] == ref
    [f.result() for f in futures]
    assert a.forward(data, "cross_entropy").result().metrics["loss:sum"] == ref
    assert b.forward(data, "cross_entropy").result().metrics["loss:sum"] != ref


@pytest.mark.filterwarnings("ignore::FutureWarning")  # 0.38 deprecates *_async for awaiting
def test_async_variants(tk):
    async def main():
        tc = await tk.service.create_lora_training_client_async(base_model=tk.base, rank=8)
        data = [sft_datum(t) for t in TEXT]
        first = None
        for _ in range(3):
            fb = await tc.forward_backward_async(data, "cross_entropy")
            opt = await tc.optim_step_async(types.AdamParams(learning_rate=1e-2))
            loss = (await fb).metrics["loss:sum"]
            await opt
            first = first or loss
        assert loss < first
        path = (await (await tc.save_weights_for_sampler_async("async-s"))).path
        sampler = await tk.service.create_sampling_client_async(model_path=path)
        res = await sampler.sample_async(types.ModelInput.from_ints(PROMPT), 2,
                                         types.SamplingParams(max_tokens=4))
        assert len(res.sequences) == 2 and all(len(s.tokens) == 4 for s in res.sequences)
        lps = await sampler.compute_logprobs_async(types.ModelInput.from_ints(PROMPT))
        assert lps[0] is None and len(lps) == len(PROMPT)
        # 0.38's preferred form: await the APIFutures themselves, both in flight at once
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-2))
        assert (await fb).metrics["loss:sum"] > 0 and (await opt) is not None
    asyncio.run(main())


def user_error(fn) -> str:
    with pytest.raises(tinker.RequestFailedError) as e:
        fn()
    assert e.value.category.value == "user", e.value
    return str(e.value)


def test_bad_input_is_a_user_error(tk):
    tc = tk.service.create_lora_training_client(base_model=tk.base, rank=8).result()
    ok = sft_datum(TEXT[0])
    assert "unknown loss" in user_error(
        lambda: tc.forward_backward([ok], "no_such_loss").result())
    short = types.Datum(model_input=ok.model_input, loss_fn_inputs={
        "target_tokens": np.array(TEXT[0][1:4], dtype=np.int64),
        "weights": np.ones(3, dtype=np.float32)})
    assert "shape" in user_error(lambda: tc.forward_backward([short], "cross_entropy").result())
    huge = sft_datum([5, 6, 7, 10**6])
    assert "vocabulary" in user_error(lambda: tc.forward_backward([huge], "cross_entropy")
                                      .result())
    assert "needs loss_fn_inputs" in user_error(
        lambda: tc.forward_backward([ok], "ppo").result())
    sampler = tc.save_weights_and_get_sampling_client().result()
    assert "context" in user_error(lambda: sampler.sample(
        types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=10**6)).result())
    assert "vocabulary" in user_error(lambda: sampler.sample(
        types.ModelInput.from_ints([1, 2, 99999]), 1, types.SamplingParams(max_tokens=2))
        .result())
    with pytest.raises(Exception, match="unknown base_model"):
        tk.service.create_lora_training_client(base_model="no-such-model", rank=8).result()
    sft_step(tc, [ok])  # the model still trains after all that

    def post(route, body):
        req = urllib.request.Request(f"{tk.url}/api/v1/{route}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req).read())
    rid = post("optim_step", {"model_id": "nope:train:0", "seq_id": 1,
                              "adam_params": {"learning_rate": 1e-3}})["request_id"]
    failed = post("retrieve_future", {"request_id": rid})
    assert failed["category"] == "user" and "unknown model id" in failed["error"]
    with pytest.raises(urllib.error.HTTPError) as gone:  # unknown or expired: 410
        post("retrieve_future", {"request_id": "no-such-request"})
    assert gone.value.code == 410


def test_model_limit_is_a_clear_user_error(tiny, tmp_path):
    with ServerThread(make_settings(tmp_path, tinker_max_models=1), tiny) as s:
        service = tinker.ServiceClient(base_url=s.url, api_key="tml-local")
        service.create_lora_training_client(base_model=tiny.model_id, rank=4).result()
        with pytest.raises(Exception, match="tinker-max-models"):
            service.create_lora_training_client(base_model=tiny.model_id, rank=4).result()


def test_api_key_and_the_proxy_beside_tinker(tiny, tmp_path):
    """With --api-key only that key gets in; the proxy's own serving and trainer thread keep
    running beside a Tinker client training on the same base."""
    settings = make_settings(tmp_path, api_key="tml-secret", train=True)
    with ServerThread(settings, tiny) as s:
        wrong = tinker.ServiceClient(base_url=s.url, api_key="tml-wrong")
        with pytest.raises(tinker.AuthenticationError):
            wrong.create_lora_training_client(base_model=tiny.model_id, rank=4).result()
        service = tinker.ServiceClient(base_url=s.url, api_key="tml-secret")
        tc = service.create_lora_training_client(base_model=tiny.model_id, rank=4).result()
        sft_step(tc, [sft_datum(TEXT[0])])
        chat = s.client(api_key="tml-secret").chat.completions.create(
            model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert chat.choices[0].message.content is not None
        health = json.loads(urllib.request.urlopen(f"{s.url}/healthz").read())
        assert health["trainer"]["enabled"] and health["trainer"]["alive"]


def test_requests_run_in_seq_id_order(tk):
    """An optim_step that arrives before the forward_backward it follows (seq_id 2 before 1)
    waits for it: the step applies that call's gradients."""
    from tinker.proto.request_conv import forward_backward_request_to_proto

    tc = tk.service.create_lora_training_client(base_model=tk.base, rank=4).result()

    def post(route, body: bytes, kind="application/json"):
        req = urllib.request.Request(f"{tk.url}/api/v1/{route}", data=body,
                                     headers={"Content-Type": kind})
        return json.loads(urllib.request.urlopen(req).read())
    step = post("optim_step", json.dumps({"model_id": tc.model_id, "seq_id": 2, "adam_params": {
        "learning_rate": 1e-3}}).encode())["request_id"]
    fb = forward_backward_request_to_proto(types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[sft_datum(TEXT[0])],
                                                          loss_fn="cross_entropy"),
        model_id=tc.model_id, seq_id=1))
    first = post("forward_backward", fb.SerializeToString(), "application/x-protobuf")
    assert first["request_id"]
    done = post("retrieve_future", json.dumps({"request_id": step}).encode())
    assert done["metrics"]["grad_norm:mean"] > 0  # the gradients of seq_id 1 were there
