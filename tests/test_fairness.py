"""Chunked-prefill fairness on real parts: the tiny model and a real engine thread.

A short request that arrives while a long prompt prefills must finish within twice its idle time
plus one prefill chunk (issue 13, item 11), and the long prompt, prefilled a chunk at a time
between decode steps, must still give exactly what a direct forward pass gives.
"""

from __future__ import annotations

import random
import statistics
import threading
import time

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from rlproxy.serving.engine import Engine, Job, SamplingParams

STEP = 512  # prefill chunk: small, so a long prompt is many chunks and the test stays short


@pytest.fixture(scope="module")
def engine(tiny):
    e = Engine(tiny.model, tiny.tokenizer.eos_token_ids, prefill_step_size=STEP)
    e.start()
    yield e
    e.stop()


def submit(engine, prompt, max_tokens, **params):
    """(job, finished event, steps); the steps are filled in as they come."""
    done, steps = threading.Event(), []

    def deliver(step):
        steps.append((time.perf_counter(), step))
        if step.finish_reason is not None:
            done.set()

    job = engine.submit(Job(list(prompt), SamplingParams(max_tokens=max_tokens, **params),
                            deliver))
    return job, done, steps


def short_latency(engine, tiny, rng) -> float:
    no_end = {t: -100.0 for t in tiny.tokenizer.eos_token_ids}  # exactly 4 tokens
    tic = time.perf_counter()
    _, done, steps = submit(engine, [rng.randrange(10, 1300) for _ in range(30)], 4,
                            temperature=0.0, logit_bias=no_end)
    assert done.wait(60)
    assert [s.error for _, s in steps] == [None] * 4
    return time.perf_counter() - tic


def test_short_request_is_not_stuck_behind_a_long_prefill(engine, tiny):
    rng = random.Random(0)
    idle = statistics.median(short_latency(engine, tiny, rng) for _ in range(3))
    long_prompt = [rng.randrange(10, 1300) for _ in range(6000)]  # 12 chunks of 512
    chunks = engine.stats.prefill_chunks
    tic = time.perf_counter()
    job, done, steps = submit(engine, long_prompt, 1, temperature=0.0)
    while engine.stats.prefill_chunks < chunks + 2:  # well into its prefill
        time.sleep(0.005)
    during = short_latency(engine, tiny, rng)
    assert not done.is_set(), "the long prompt finished first: nothing was measured"
    assert done.wait(120)
    long_total = time.perf_counter() - tic
    chunk = engine.stats.max_prefill_chunk_ms / 1000
    bound = 2 * idle + chunk
    print(f"idle {idle:.3f}s, during a long prefill {during:.3f}s, bound {bound:.3f}s "
          f"(longest chunk {chunk:.3f}s), long prompt {long_total:.2f}s")
    assert engine.stats.prefill_chunks - chunks >= 11  # it was prefilled a chunk at a time
    assert during <= 1.5 * bound + 0.2  # margin for the shared CPU
    assert during < long_total / 3  # far from waiting for the whole prefill

    # Exactness: the chunked prefill between decode steps gives a direct forward pass's answer.
    cache = make_prompt_cache(tiny.model)
    for i in range(0, len(long_prompt) - 1, 1000):  # other chunk boundaries than the engine's
        tiny.model(mx.array(long_prompt[i:min(i + 1000, len(long_prompt) - 1)])[None],
                   cache=cache)
        mx.eval([c.state for c in cache])
    logits = tiny.model(mx.array(long_prompt[-1:])[None], cache=cache)[0, -1]
    logprobs = (logits - mx.logsumexp(logits)).astype(mx.float32)
    (_, step), = steps
    assert step.token.id == mx.argmax(logprobs).item()
    assert abs(step.token.logprob - logprobs[step.token.id].item()) < 1e-4


def test_a_cancelled_prefill_leaves_the_engine_serving(engine, tiny):
    rng = random.Random(1)
    chunks = engine.stats.prefill_chunks
    job, done, steps = submit(engine, [rng.randrange(10, 1300) for _ in range(4000)], 4)
    while engine.stats.prefill_chunks < chunks + 1:
        time.sleep(0.005)
    engine.cancel(job)
    short_latency(engine, tiny, rng)  # served as usual
    time.sleep(0.2)
    assert steps == [] and job.done
    assert engine.stats.active == 0 and not engine.busy()


def test_a_long_prompt_is_prefilled_while_the_batch_is_full_and_short_ones_wait(tiny):
    """With every batch slot decoding and a short request waiting for one, a long prompt's
    chunks still run (they need no slot): it is not held up behind the short one. A short
    request in turn joins the batch as soon as a slot frees, between the long one's chunks."""
    engine = Engine(tiny.model, tiny.tokenizer.eos_token_ids, max_batch=2, prefill_step_size=STEP)
    engine.start()
    rng = random.Random(2)
    no_end = {t: -100.0 for t in tiny.tokenizer.eos_token_ids}
    try:
        hogs = [submit(engine, [rng.randrange(10, 1300) for _ in range(20)], 100_000,
                       temperature=0.0, logit_bias=no_end) for _ in range(2)]
        while any(not steps for _, _, steps in hogs):  # both decoding: the batch is full
            time.sleep(0.005)
        waiting = submit(engine, [rng.randrange(10, 1300) for _ in range(20)], 4,
                         temperature=0.0, logit_bias=no_end)
        chunks = engine.stats.prefill_chunks
        long_job = submit(engine, [rng.randrange(10, 1300) for _ in range(8 * STEP)], 1,
                          temperature=0.0)
        deadline = time.time() + 30
        while engine.stats.prefill_chunks < chunks + 4 and time.time() < deadline:
            time.sleep(0.01)
        assert engine.stats.prefill_chunks >= chunks + 4, "no chunk ran while the batch was full"
        assert not waiting[1].is_set() and not long_job[1].is_set()  # no slot for either yet
        engine.cancel(hogs[0][0])  # a slot frees: the short one takes it and finishes
        assert waiting[1].wait(30)
        assert [s.error for _, s in waiting[2]] == [None] * 4
        engine.cancel(hogs[1][0])
        assert long_job[1].wait(60)
        assert long_job[2][-1][1].error is None
    finally:
        engine.stop()
