"""The prefix KV store on real parts: the tiny model, real engine threads, real files on disk.

Every comparison is against the same prompt generated from scratch by an engine without a cache:
a restored prefix must give the same tokens and the same log-probs (within float noise).
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest
import requests
from mlx.utils import tree_unflatten

from conftest import ServerThread, make_settings
from rlproxy.kv.prefix_cache import open_prefix_cache
from rlproxy.serving.engine import Engine, Job, SamplingParams
from rlproxy.serving.model import load_serving_model, lora_weights
from rlproxy.settings import CacheSettings, ModelSettings

TOL = 1e-4


def generate(engine: Engine, prompt: list[int], max_tokens: int = 16, seed: int = 7):
    """(token ids, log-probs, cached prompt tokens) of one sampled request, temperature 1."""
    done, steps = threading.Event(), []

    def deliver(step):
        steps.append(step)
        if step.finish_reason is not None:
            done.set()

    job = engine.submit(Job(list(prompt), SamplingParams(max_tokens=max_tokens, temperature=1.0,
                                                         seed=seed), deliver))
    assert done.wait(60), "the engine did not finish the request"
    assert steps[-1].error is None, steps[-1].error
    return [s.token.id for s in steps], [s.token.logprob for s in steps], job.cached_tokens


def assert_same(got, want):
    assert got[0] == want[0], "different tokens than from scratch"
    assert max(abs(a - b) for a, b in zip(got[1], want[1])) < TOL, "different log-probs"


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 1300) for _ in range(n)]  # plain tokens of the tiny vocabulary


class Engines:
    """A cached engine over `directory` and an uncached reference engine, same weights."""

    def __init__(self, loaded, directory: Path, reference_model=None, **cache):
        self.settings = CacheSettings(**{"prefix_block_tokens": 16, **cache})
        self.cache = open_prefix_cache(directory, self.settings, loaded.model, loaded.model_id)
        eos = loaded.tokenizer.eos_token_ids
        self.engine = Engine(loaded.model, eos, prefix_cache=self.cache)
        self.reference = Engine(reference_model or loaded.model, eos)
        self.engine.start()
        self.reference.start()

    def run(self, prompt, **kw):
        got = generate(self.engine, prompt, **kw)
        self.cache.flush()
        return got

    def close(self):
        self.engine.stop()
        self.reference.stop()
        self.cache.close()


@pytest.fixture
def engines(tiny, tmp_path):
    e = Engines(tiny, tmp_path / "prefix_cache")
    yield e
    e.close()


@pytest.mark.parametrize("case", ["exact", "shorter", "longer", "inside", "long_rest"])
def test_restored_prefix_matches_scratch(engines, case):
    rng = random.Random(case)
    p0 = random_tokens(rng, 120)
    tokens, _, cached = engines.run(p0)
    assert cached == 0
    stored = p0 + tokens  # the entry: prompt + every sampled token
    prompt, expected = {
        "exact": (stored, len(stored) - 1),  # all cached: one token is left to prefill
        "shorter": (stored + random_tokens(rng, 40), len(stored)),
        "longer": (p0[:70] + random_tokens(rng, 30), 70),  # diverges inside the entry
        "inside": (p0[:70], 69),  # a strict prefix of the entry
        # the rest is long enough for the engine's chunked prefill (serving/prefill.py), from the hit
        "long_rest": (stored + random_tokens(rng, 2100), len(stored)),
    }[case]
    got = engines.run(prompt)
    assert got[2] == expected
    assert_same(got, generate(engines.reference, prompt))
    assert engines.cache.health()["memory_hits"] == 1
    assert engines.engine.stats.prefill_chunks == (case == "long_rest")


def test_queued_write_serves_the_next_turn(engines, monkeypatch):
    """An agent's next request can arrive before the writer thread has stored the last turn."""
    gate = threading.Event()
    write = engines.cache._write
    monkeypatch.setattr(engines.cache, "_write", lambda *a: (gate.wait(30), write(*a)))
    rng = random.Random(0)
    p0 = random_tokens(rng, 120)
    tokens, _, _ = generate(engines.engine, p0)  # no flush: the write stays queued
    prompt = p0 + tokens + random_tokens(rng, 20)
    got = generate(engines.engine, prompt)
    assert engines.cache.health()["entries"] == 0  # not written yet ...
    assert got[2] == len(p0) + len(tokens)  # ... and still a hit, from the queued write
    gate.set()
    engines.cache.flush()
    assert_same(got, generate(engines.reference, prompt))


def test_turn_boundaries_found_without_whole_blocks(tiny, tmp_path):
    """With blocks longer than the prompts, exact turn boundaries still hit."""
    e = Engines(tiny, tmp_path / "pc", prefix_block_tokens=1024)
    try:
        rng = random.Random(1)
        p0 = random_tokens(rng, 100)
        tokens, _, _ = e.run(p0)
        prompt = p0 + tokens + random_tokens(rng, 20)
        got = e.run(prompt)
        assert got[2] == len(p0) + len(tokens)
        assert_same(got, generate(e.reference, prompt))
    finally:
        e.close()


def test_restart_reads_from_disk(tiny, tmp_path):
    rng = random.Random(2)
    p0 = random_tokens(rng, 150)
    first = Engines(tiny, tmp_path / "pc")
    tokens, _, _ = first.run(p0)
    first.close()
    second = Engines(tiny, tmp_path / "pc")  # empty memory LRU, same directory
    try:
        prompt = p0 + tokens + random_tokens(rng, 30)
        got = second.run(prompt)
        assert got[2] == len(p0) + len(tokens)
        assert_same(got, generate(second.reference, prompt))
        c = second.cache.health()
        assert (c["disk_hits"], c["memory_hits"], c["corrupt"]) == (1, 0, 0)
    finally:
        second.close()


def test_disk_hit_loads_off_the_engine_thread(tiny, tmp_path):
    """Reading, checking and unpacking an entry from disk happens on the loader thread: a slow
    disk holds up only the request that waits for it, never the streams already decoding."""
    rng = random.Random(7)
    p0 = random_tokens(rng, 150)
    first = Engines(tiny, tmp_path / "pc")
    tokens, _, _ = first.run(p0)
    first.close()
    e = Engines(tiny, tmp_path / "pc")  # empty memory tier: the next hit reads the disk
    read_on, real_get = [], e.cache._disk.get

    def slow_get(key, *a, **kw):  # a slow disk: two seconds per read
        read_on.append(threading.current_thread().name)
        time.sleep(2.0)
        return real_get(key, *a, **kw)

    e.cache._disk.get = slow_get
    try:
        no_end = {t: -100.0 for t in tiny.tokenizer.eos_token_ids}
        stamps = []
        forever = SamplingParams(max_tokens=100_000, logit_bias=no_end)
        streaming = e.engine.submit(Job(random_tokens(rng, 30), forever,
                                        lambda step: stamps.append(time.perf_counter())))
        while len(stamps) < 20:
            time.sleep(0.01)
        prompt = p0 + tokens + random_tokens(rng, 20)
        tic = time.perf_counter()
        got = generate(e.engine, prompt)
        toc = time.perf_counter()
        e.engine.cancel(streaming)
        assert read_on and "rlproxy-engine" not in read_on
        assert toc - tic >= 2.0 and e.cache.health()["disk_hits"] == 1
        assert got[2] == len(p0) + len(tokens)
        during = [t for t in stamps if tic <= t <= toc]
        gaps = [b - a for a, b in zip(during, during[1:])]
        # On the engine thread the read would stop every stream for 2 s; the margin is for the
        # shared CPU.
        assert len(during) > 20 and max(gaps) < 1.0, "decoding stalled while the disk was read"
        assert_same(got, generate(e.reference, prompt))
    finally:
        e.close()


def changed_adapter(model, seed: int) -> dict[str, mx.array]:
    mx.random.seed(seed)
    weights = {k: v + 0.05 * mx.random.normal(v.shape) if k.endswith("lora_b") else v
               for k, v in lora_weights(model).items()}
    mx.eval(weights)
    return weights


def publish(engine: Engine, weights, version: int) -> None:
    engine.publish_adapter(weights, version)
    deadline = time.time() + 30
    while engine.adapter_version != version:
        assert time.time() < deadline, "the engine did not apply the adapter"
        time.sleep(0.01)


def test_other_adapter_versions_are_never_used(tmp_path):
    """With --kv-reuse-max-lag 0 (exact KV only); test_kv_lag.py covers the lag."""
    loaded = load_serving_model(ModelSettings(model="tiny"))  # its weights change here
    reference = load_serving_model(ModelSettings(model="tiny"))
    rng = random.Random(3)
    p0 = random_tokens(rng, 120)
    e = Engines(loaded, tmp_path / "pc", reference_model=reference.model, kv_reuse_max_lag=0)
    try:
        tokens, _, _ = e.run(p0)
        prompt = p0 + tokens + random_tokens(rng, 20)
        assert e.run(prompt)[2] == len(p0) + len(tokens)  # version 0 hits under version 0
        v1 = changed_adapter(loaded.model, seed=1)
        publish(e.engine, v1, 1)
        reference.model.update(tree_unflatten(list(v1.items())))
        e.cache.flush()
        assert e.cache.health()["entries"] == 0  # version 0 can never be served again
        assert e.cache.health()["evicted_stale"] >= 1
        got = e.run(prompt)
        assert got[2] == 0
        want = generate(e.reference, prompt)
        assert_same(got, want)
        again = e.run(prompt)  # version 1's own entry does hit
        assert again[2] == len(prompt) - 1
        assert_same(again, want)
    finally:
        e.close()
    # After a restart, version 1 again but other weights: the fingerprint tells them apart.
    fresh = load_serving_model(ModelSettings(model="tiny"))
    e = Engines(fresh, tmp_path / "pc", reference_model=reference.model, kv_reuse_max_lag=0)
    try:
        v1_other = changed_adapter(fresh.model, seed=2)
        publish(e.engine, v1_other, 1)
        reference.model.update(tree_unflatten(list(v1_other.items())))
        got = e.run(prompt)
        assert got[2] == 0
        assert_same(got, generate(e.reference, prompt))
    finally:
        e.close()


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_entry_is_ignored(tiny, tmp_path, damage):
    rng = random.Random(damage)
    p0 = random_tokens(rng, 120)
    e = Engines(tiny, tmp_path / "pc")
    tokens, _, _ = e.run(p0)
    e.close()
    files = list((tmp_path / "pc").rglob("*.val"))
    assert len(files) == 1
    for f in files:
        raw = bytearray(f.read_bytes())
        if damage == "truncate":  # as a crash mid-write leaves it
            raw = raw[: len(raw) // 2]
        else:
            raw[len(raw) // 2] ^= 0x40
        f.write_bytes(bytes(raw))
    e = Engines(tiny, tmp_path / "pc")
    try:
        prompt = p0 + tokens + random_tokens(rng, 20)
        got = e.run(prompt)
        assert got[2] == 0
        assert_same(got, generate(e.reference, prompt))
        c = e.cache.health()
        assert (c["corrupt"], c["hits"]) == (1, 0)
        assert not any(f.exists() for f in files)  # deleted, not kept around
        assert e.run(prompt)[2] == len(prompt) - 1  # the fresh entry replaced it
    finally:
        e.close()


def test_byte_limits_hold_under_distinct_prompts(tiny, tmp_path):
    disk_gb, memory_mb = 0.0005, 0.2  # ~3 and ~1 entries of ~170 KB
    e = Engines(tiny, tmp_path / "pc", prefix_cache_disk_limit_gb=disk_gb,
                prefix_cache_memory_mb=memory_mb)
    rng = random.Random(4)
    disk_limit, memory_limit = int(disk_gb * 1024**3), int(memory_mb * 1024**2)
    try:
        prompts = []
        for _ in range(12):
            prompts.append(random_tokens(rng, 150))
            tokens, _, _ = e.run(prompts[-1])
            prompts[-1] += tokens
            c = e.cache.health()
            on_disk = sum(f.stat().st_size for f in (tmp_path / "pc").rglob("*.val"))
            on_disk += (tmp_path / "pc" / "cache.db").stat().st_size
            assert on_disk <= disk_limit
            assert c["disk_bytes"] <= disk_limit
            assert c["memory_bytes"] <= memory_limit
        c = e.cache.health()
        assert c["stores"] == 12 and c["evicted_budget"] >= 8 and 1 <= c["entries"] <= 4
        assert c["bytes_written"] > 3 * disk_limit  # wrote far more than it kept
        assert e.run(prompts[-1] + [7])[2] == len(prompts[-1])  # the newest survived
        assert e.run(prompts[0] + [7])[2] == 0  # the oldest did not
    finally:
        e.close()


def test_kv_quantization_shrinks_entries(tiny, tmp_path):
    rng = random.Random(5)
    p0 = random_tokens(rng, 200)
    sizes = {}
    for bits in (None, 8):
        e = Engines(tiny, tmp_path / f"pc{bits}", kv_bits=bits, kv_group_size=32,
                    quantized_kv_start=0)
        try:
            tokens, _, _ = e.run(p0)
            sizes[bits] = e.cache.health()["bytes_written"]
            prompt = p0 + tokens + random_tokens(rng, 20)
            got = e.run(prompt)
            assert got[2] == len(p0) + len(tokens)
            want = generate(e.reference, prompt)
            # Dequantized KV: close to scratch, not bit-equal.
            assert abs(got[1][0] - want[1][0]) < (TOL if bits is None else 0.05)
            stored = e.cache.health()["kv_quantization"]["stored_entries"]
            assert stored == (None if bits is None else
                              {"bits": 8, "group_size": 32, "quantized_kv_start": 0})
        finally:
            e.close()
    assert sizes[8] < 0.4 * sizes[None]


def test_by_default_agent_length_entries_are_stored_in_8_bits(tiny, tmp_path):
    """Issue 41: SmolLM2's 16k-token entries were ~740 MB each and 4 GB held five. By default an
    entry of at least 8,192 tokens is stored in 8 bits (group 32: the tiny model's head dim is
    32), a shorter one exactly; the long one restores close to scratch."""
    rng = random.Random(9)
    short, long = random_tokens(rng, 300), random_tokens(rng, 8300)
    e = Engines(tiny, tmp_path / "pc")  # CacheSettings' defaults (16-token blocks)
    try:
        assert e.cache.health()["kv_quantization"]["stored_entries"] == {
            "bits": 8, "group_size": 32, "quantized_kv_start": 8192}
        sizes = []
        for prompt in (short, long):
            before = e.cache.health()["bytes_written"]
            tokens, _, _ = e.run(prompt, max_tokens=4)
            sizes.append((e.cache.health()["bytes_written"] - before) / (len(prompt) + 4))
        assert sizes[1] < 0.35 * sizes[0]  # (1 byte + 8 of scale and bias per 32) / 4 bytes
        prompt = long + tokens + random_tokens(rng, 20)
        got = e.run(prompt)
        assert got[2] == len(long) + len(tokens)
        want = generate(e.reference, prompt)
        assert abs(got[1][0] - want[1][0]) < 0.05  # dequantized: close, not bit-equal
    finally:
        e.close()


def test_kv_group_size_must_fit_the_model(tiny, tmp_path):
    with pytest.raises(ValueError, match="kv-group-size"):  # the tiny model's head dim is 32
        open_prefix_cache(tmp_path, CacheSettings(kv_bits=4, kv_group_size=64), tiny.model,
                          tiny.model_id)


SYSTEM = ("You are a careful coding agent. Read before you edit, run the tests after each "
          "change, and keep answers short. ") * 12


def test_next_turn_after_server_restart_hits_disk(tiny, tmp_path):
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "List the files."}]
    body = {"model": "tiny", "max_tokens": 12, "temperature": 0, "logprobs": True}
    headers = {"X-Session-Id": "restart-1"}
    settings = make_settings(tmp_path)
    with ServerThread(settings, tiny) as s:
        r1 = s.client().chat.completions.create(messages=turn1, extra_headers=headers, **body)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "Now run the tests."}]
    with ServerThread(settings, tiny) as s:  # a new app: empty memory, the same data dir
        r2 = s.client().chat.completions.create(messages=turn2, extra_headers=headers, **body)
        health = requests.get(s.url + "/healthz", timeout=30).json()["prefix_cache"]
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens
    assert health["disk_hits"] == 1 and health["memory_hits"] == 0 and health["enabled"]
    off = make_settings(tmp_path / "off", prefix_cache=False)
    with ServerThread(off, tiny) as s:
        want = s.client().chat.completions.create(messages=turn2, extra_headers=headers, **body)
        assert requests.get(s.url + "/healthz", timeout=30).json()["prefix_cache"] == {
            "enabled": False, "reason": "--no-prefix-cache"}
    assert want.usage.prompt_tokens_details.cached_tokens == 0
    assert r2.choices[0].message.content == want.choices[0].message.content
    got_lp = [t.logprob for t in r2.choices[0].logprobs.content]
    want_lp = [t.logprob for t in want.choices[0].logprobs.content]
    assert len(got_lp) == len(want_lp) and max(abs(a - b) for a, b in zip(got_lp, want_lp)) < TOL
