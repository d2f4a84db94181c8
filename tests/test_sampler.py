"""Sampling rules on real parts: the tiny model, a real engine thread, a direct forward pass.

presence_penalty / frequency_penalty follow OpenAI's definition: every token of the completion so
far counts, however long ago it was sampled, and no prompt token does (mlx-lm's own penalties
look at the last 20 tokens, prompt included).
"""

from __future__ import annotations

import random
import threading

import mlx.core as mx
import pytest

from rlproxy.serving.engine import Engine, Job, SamplingParams

PRESENCE, FREQUENCY = 1.5, 0.8


@pytest.fixture(scope="module")
def engine(tiny):
    e = Engine(tiny.model, tiny.tokenizer.eos_token_ids)
    e.start()
    yield e
    e.stop()


def run(engine, prompt, **params):
    done, steps = threading.Event(), []

    def deliver(step):
        steps.append(step)
        if step.finish_reason is not None:
            done.set()

    engine.submit(Job(list(prompt), SamplingParams(**params), deliver))
    assert done.wait(60) and steps[-1].error is None
    return [s.token.id for s in steps], [s.token.logprob for s in steps]


def expected_logprobs(model, prompt, completion, bias, window=None):
    """What the engine should record at each step, from one forward pass over the sequence:
    log-softmax of logits + bias - penalties over completion[:t] (the last WINDOW tokens of
    prompt + completion when WINDOW is given: mlx-lm's rule)."""
    logits = model(mx.array(prompt + completion[:-1])[None])[0, len(prompt) - 1:]
    logits = logits.astype(mx.float32) + bias
    out = []
    for t, token in enumerate(completion):
        seen = completion[:t] if window is None else (prompt + completion[:t])[-window:]
        counts = mx.zeros(logits.shape[-1]).at[mx.array(seen, mx.int32)].add(1.0) if seen \
            else mx.zeros(logits.shape[-1])
        row = logits[t] - FREQUENCY * counts - PRESENCE * (counts > 0)
        out.append((row - mx.logsumexp(row))[token].item())
    return out


def test_penalties_cover_the_whole_completion_and_only_it(engine, tiny):
    rng = random.Random(0)
    prompt = [rng.randrange(10, 1300) for _ in range(40)]
    eos = sorted(tiny.tokenizer.eos_token_ids)
    tokens, logprobs = run(engine, prompt, max_tokens=80, temperature=0.0,
                           presence_penalty=PRESENCE, frequency_penalty=FREQUENCY,
                           logit_bias={t: -100.0 for t in eos})
    bias = mx.zeros(tiny.vocab_size).at[mx.array(eos)].add(-100.0)
    want = expected_logprobs(tiny.model, prompt, tokens, bias)
    assert max(abs(a - b) for a, b in zip(logprobs, want)) < 1e-4
    # A token generated 30 or more tokens earlier (and not since) still counts ...
    old = [t for t in range(30, len(tokens)) if any(
        j not in tokens[t - 20:t] for j in tokens[:t - 29])]
    assert old, "no step with a token from 30 steps back: the test shows nothing"
    # ... where mlx-lm's 20-token window (prompt included) would have given other log-probs.
    windowed = expected_logprobs(tiny.model, prompt, tokens, bias, window=20)
    assert max(abs(logprobs[t] - windowed[t]) for t in old) > 1e-3


def test_same_seed_same_tokens_with_penalties(engine):
    prompt = list(range(100, 140))
    params = dict(max_tokens=24, temperature=1.0, seed=11, presence_penalty=0.5,
                  frequency_penalty=0.5)
    assert run(engine, prompt, **params) == run(engine, prompt, **params)


def test_greedy_requests_decoded_together_get_what_each_gets_alone(engine):
    """Greedy requests share one sampler, so the engine's batch picks all their tokens in one
    argmax; each row must still be its own request's."""
    from rlproxy.serving.sampler import make_sampler

    assert make_sampler(0.0, 1.0, 1) is make_sampler(0.0, 0.5, 2, 5)  # what lets them batch
    prompts = [[(7 * i + 13 * j) % 1300 + 10 for j in range(30 + 5 * i)] for i in range(8)]
    alone = [run(engine, p, max_tokens=24, temperature=0.0) for p in prompts]
    together: list = [None] * len(prompts)

    def one(i):
        together[i] = run(engine, prompts[i], max_tokens=24, temperature=0.0)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({tuple(tokens) for tokens, _ in alone}) > 1, "every prompt gave the same tokens"
    for (tokens, logprobs), (want, want_lp) in zip(together, alone):
        assert tokens == want
        assert max(abs(a - b) for a, b in zip(logprobs, want_lp)) < 1e-3
