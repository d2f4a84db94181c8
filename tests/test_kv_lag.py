"""Prefix KV reuse across adapter versions (--kv-reuse-max-lag) on real parts: the tiny model,
real engine threads, the real app on a free port and the records it writes.

A lagged hit is checked against what it claims to be: the first log-prob equals a manual pass
that prefills the prefix under the old adapter and the rest under the new one, and differs from
the exact pass under the new adapter (so a recomputed prefix would fail the test).
"""

from __future__ import annotations

import random
import threading
import time

import mlx.core as mx
import pytest
import requests
from mlx.utils import tree_unflatten
from mlx_lm.models.cache import make_prompt_cache

from conftest import ServerThread, make_settings, read_records
from rlproxy.appkeys import ENGINE
from rlproxy.serving.engine import Job, SamplingParams
from rlproxy.serving.model import load_serving_model, lora_weights
from rlproxy.settings import ModelSettings
from test_prefix_cache import Engines, changed_adapter, publish, random_tokens


def run(e: Engines, prompt: list[int], max_tokens: int = 8) -> tuple[list, Job]:
    """(delivered steps, the job) of one request; the store has written its KV when it returns."""
    done, steps = threading.Event(), []

    def deliver(step):
        steps.append(step)
        if step.finish_reason is not None:
            done.set()

    job = e.engine.submit(Job(list(prompt), SamplingParams(max_tokens=max_tokens, seed=3),
                              deliver))
    assert done.wait(60), "the engine did not finish the request"
    assert steps[-1].error is None, steps[-1].error
    e.cache.flush()
    return steps, job


def first_logprob(model, weights: list[dict], prompt: list[int], n: int, token: int) -> float:
    """log p(token | prompt) with prompt[:n] prefilled under weights[0], the rest under [1]."""
    cache = make_prompt_cache(model)
    model.update(tree_unflatten(list(weights[0].items())))
    model(mx.array(prompt[:n])[None], cache=cache)
    model.update(tree_unflatten(list(weights[1].items())))
    logits = model(mx.array(prompt[n:])[None], cache=cache)[0, -1]
    return (logits - mx.logsumexp(logits)).astype(mx.float32)[token].item()


@pytest.fixture
def changing():
    """A model of its own (its adapter changes here) and the adapters it will be given."""
    loaded = load_serving_model(ModelSettings(model="tiny"))
    v0 = dict(lora_weights(loaded.model))
    return loaded, [v0] + [changed_adapter(loaded.model, seed=s) for s in (1, 2, 3)]


def test_lagged_prefix_is_reused_and_bounded(changing, tmp_path):
    loaded, adapters = changing
    e = Engines(loaded, tmp_path / "pc", kv_reuse_max_lag=2)
    try:
        rng = random.Random(0)
        p0 = random_tokens(rng, 120)
        steps, _ = run(e, p0)
        stored = p0 + [s.token.id for s in steps]
        publish(e.engine, adapters[1], 1)
        prompt = stored + random_tokens(rng, 20)
        steps, job = run(e, prompt)
        assert (job.cached_tokens, job.cached_version) == (len(stored), 0)
        assert steps[0].token.adapter_version == 1
        c = e.cache.health()
        assert (c["hits_stale"], c["cached_tokens_stale"]) == (1, len(stored))
        # The KV really is version 0's: the log-prob of a v0 prefix + v1 rest, not exact v1's.
        ref = load_serving_model(ModelSettings(model="tiny")).model
        got, token = steps[0].token.logprob, steps[0].token.id
        stale = first_logprob(ref, adapters[:2], prompt, len(stored), token)
        exact = first_logprob(ref, adapters[1:2] * 2, prompt, len(stored), token)
        assert abs(got - stale) < 1e-4
        assert abs(got - exact) > 1e-3
        # Its KV mixes v0 and v1: filed under v0, the oldest, extending v0's entry.
        assert c["entries_by_version"] == {"0": 1} and c["stores"] == 2
        longer = prompt + [s.token.id for s in steps] + random_tokens(rng, 10)
        publish(e.engine, adapters[2], 2)
        _, job = run(e, longer)  # v0 is 2 versions old: still within the lag
        assert (job.cached_tokens, job.cached_version) == (len(longer) - 10, 0)
        publish(e.engine, adapters[3], 3)
        e.cache.flush()
        c = e.cache.health()
        assert "0" not in c["entries_by_version"] and c["evicted_stale"] >= 1
        assert c["servable_versions"] == [3, 2, 1]
        _, job = run(e, longer)  # so no token's KV is ever more than 2 versions old
        assert (job.cached_tokens, job.cached_version) == (0, None)
    finally:
        e.close()


def test_eviction_keeps_the_window(changing, tmp_path):
    loaded, adapters = changing
    e = Engines(loaded, tmp_path / "pc", kv_reuse_max_lag=1)
    try:
        rng = random.Random(1)
        a, b = random_tokens(rng, 60), random_tokens(rng, 60)
        run(e, a)
        publish(e.engine, adapters[1], 1)
        steps, job = run(e, b)  # a fresh prompt under v1: its own entry
        assert job.cached_tokens == 0
        assert e.cache.health()["entries_by_version"] == {"0": 1, "1": 1}
        publish(e.engine, adapters[2], 2)
        e.cache.flush()
        assert e.cache.health()["entries_by_version"] == {"1": 1}  # v0 left the window
        b_next = b + [s.token.id for s in steps]
        _, job = run(e, b_next + [7])
        assert (job.cached_version, job.cached_tokens) == (1, len(b_next))
        _, job = run(e, a + [7])
        assert job.cached_tokens == 0
    finally:
        e.close()


def test_swap_during_a_job_files_its_kv_under_the_older_version(changing, tmp_path):
    """A job that started under v0 and finished under v1 holds KV of both: kept under v0 with a
    lag, refused with lag 0 (the exact behaviour)."""
    loaded, adapters = changing
    no_end = {t: -100.0 for t in loaded.tokenizer.eos_token_ids}  # long enough to see a swap
    for lag, want in ((1, {"0": 1}), (0, {})):
        loaded.model.update(tree_unflatten(list(adapters[0].items())))
        e = Engines(loaded, tmp_path / f"pc{lag}", kv_reuse_max_lag=lag)
        try:
            started = threading.Event()
            steps: list = []

            def deliver(step):
                steps.append(step)
                started.set()

            job = e.engine.submit(Job(random_tokens(random.Random(2), 60),
                                      SamplingParams(max_tokens=150, seed=1,
                                                     logit_bias=no_end), deliver))
            assert started.wait(60)
            publish(e.engine, adapters[1], 1)
            while steps[-1].finish_reason is None:
                threading.Event().wait(0.05)
            e.cache.flush()
            assert {s.token.adapter_version for s in steps} == {0, 1}, "no swap mid-job"
            c = e.cache.health()
            assert c["entries_by_version"] == want
            assert c["not_stored_stale"] == (0 if lag else 1)
            assert job.done
        finally:
            e.close()


SYSTEM = ("You are a careful coding agent. Read before you edit, run the tests after each "
          "change, and keep answers short. ") * 30


@pytest.mark.parametrize("lag", [2, 0])
def test_records_say_where_reused_kv_came_from(changing, tmp_path, lag):
    """Two sessions share a long system prompt; the trainer's step lands between them."""
    loaded, adapters = changing
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0}
    settings = make_settings(tmp_path, kv_reuse_max_lag=lag, judge=False)
    with ServerThread(settings, loaded) as s:
        client = s.client()
        for session, question, adapter in (("a", "List the files.", None),
                                           ("b", "Run the tests.", adapters[1])):
            if adapter is not None:
                publish(s.app[ENGINE], adapter, 1)
            r = client.chat.completions.create(
                messages=[{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": question}],
                extra_headers={"X-Session-Id": session, "X-Session-Done": "true"}, **body)
        health = requests.get(s.url + "/healthz", timeout=30).json()["prefix_cache"]
    cached = r.usage.prompt_tokens_details.cached_tokens
    turns = {t["session_id"]: t for t in read_records(tmp_path) if t.get("kind") == "turn"}
    choice = turns["b"]["choices"][0]
    assert choice["adapter_versions"][0] == 1
    if lag:
        assert cached > 256  # the shared system prompt, from session a's v0 KV
        assert (choice["cached_tokens"], choice["cached_kv_version"], choice["kv_lag"]) == \
            (cached, 0, 1)
        assert (health["hits_stale"], health["cached_tokens_stale"]) == (1, cached)
    else:
        assert cached == 0
        assert (choice["cached_tokens"], choice["cached_kv_version"], choice["kv_lag"]) == \
            (0, None, 0)
        assert health["hits_stale"] == 0 and health["hits"] == 0
    assert health["kv_reuse_max_lag"] == lag
    assert turns["a"]["choices"][0]["cached_kv_version"] is None


def test_restart_resuming_a_served_adapter_keeps_its_window(changing, tmp_path):
    """The lineage survives a restart: resuming v2 may reuse v1's KV from before it, while an
    adapter numbered 2 with other weights reuses nothing (ancestry is by fingerprint)."""
    loaded, adapters = changing
    rng = random.Random(4)
    a = random_tokens(rng, 60)
    e = Engines(loaded, tmp_path / "pc", kv_reuse_max_lag=2)
    try:
        publish(e.engine, adapters[1], 1)
        steps, _ = run(e, a)
        publish(e.engine, adapters[2], 2)
        e.cache.flush()
    finally:
        e.close()
    prompt = a + [s.token.id for s in steps] + [7]
    for resumed, want in ((adapters[2], (1, len(prompt) - 1)), (adapters[3], (None, 0))):
        fresh = load_serving_model(ModelSettings(model="tiny"))  # a new process: version 0, zero adapter
        e = Engines(fresh, tmp_path / "pc", kv_reuse_max_lag=2)
        try:
            publish(e.engine, resumed, 2)  # what Trainer.resume does with its checkpoint
            _, job = run(e, prompt)
            assert (job.cached_version, job.cached_tokens) == want
        finally:
            e.close()


def test_a_rollback_starts_a_new_lineage(changing, tmp_path):
    """Trainer.rollback publishes v+1 with an old checkpoint's weights: v+1 did not come from
    the adapters served since, so their KV is not reused under it (nor the old one's: it is a
    new lineage), while an ordinary step after the rollback links to it again."""
    from rlproxy.training.checkpoints import save_checkpoint
    from rlproxy.training.loop import Trainer, training_copy

    loaded, adapters = changing
    rng = random.Random(6)
    a = random_tokens(rng, 60)
    e = Engines(loaded, tmp_path / "pc", kv_reuse_max_lag=4)
    trainer = Trainer(make_settings(tmp_path, train=True), training_copy(loaded),
                      loaded.lora_config, engine=e.engine, data_dir=tmp_path)
    try:
        checkpoint = save_checkpoint(trainer.learner.checkpoints, 1, 1, adapters[3],
                                     trainer.learner.optimizer.state, loaded.lora_config, {})
        for v in (1, 2):
            publish(e.engine, adapters[v], v)
            steps, _ = run(e, a)
        prompt = a + [s.token.id for s in steps] + [7]
        _, job = run(e, prompt)
        assert job.cached_version == 1 and job.cached_tokens > 0  # lagged KV, in the window
        trainer.version = 2
        trainer.rollback(checkpoint)  # publishes v3 = adapters[3], a weight set never served
        while e.engine.adapter_version != 3:
            time.sleep(0.01)
        assert [v for v, _ in e.cache.window()] == [3]
        _, job = run(e, prompt)
        assert (job.cached_version, job.cached_tokens) == (None, 0)
        publish(e.engine, changed_adapter(loaded.model, seed=9), 4)  # a step after it
        assert [v for v, _ in e.cache.window()] == [4, 3]
    finally:
        trainer.stop()
        e.close()
