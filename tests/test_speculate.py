"""Prompt-lookup speculation (serving/speculate.py) and the merged adapter (serving/merge.py), on
real parts: the tiny model and SmolLM2 in a real engine thread, the real app over HTTP.

What must hold: speculative greedy decoding gives the non-speculative tokens and log-probs; a
sampled token is distributed exactly as the sampler's target (a chi-square test); what the
trainer computes for a speculated turn at version 0 is what was recorded (ratio 1); a stream
handed to the batch when another request arrives goes on as if it had decoded there all along;
the merged adapter serves the unmerged log-probs.
"""

from __future__ import annotations

import threading

import rlproxy  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

from rlproxy.serving.engine import Engine, Job, SamplingParams
from rlproxy.serving.jobs import SamplingParams as Params
from rlproxy.serving.logprobs import token_logprobs
from rlproxy.serving.merge import merge_layers, merged_weights, set_merged
from rlproxy.serving.model import lora_weights
from rlproxy.serving.sampler import make_sampler
from rlproxy.serving.speculate import Tokens, draft, target_logits, verify
from conftest import ServerThread, make_settings, read_records, server_with

CODE = "\n".join(f"def handler_{i}(request):\n    return process(request.path, "
                 f"'/srv/app/module_{i}.py')" for i in range(24))
COPY_MESSAGES = [{"role": "user", "content": "Here is the file:\n" + CODE +
                  "\nRepeat the file exactly."}]


def run(engine, prompt, done_after=None, jobs=None, **params):
    """(token ids, log-probs, steps) of one job; DONE_AFTER: (n, callback) calls callback once
    n tokens have arrived; JOBS: a list the job is appended to."""
    done, steps = threading.Event(), []

    def deliver(step):
        steps.append(step)
        if done_after and len(steps) == done_after[0]:
            done_after[1]()
        if step.finish_reason is not None:
            done.set()

    job = Job(list(prompt), SamplingParams(**params), deliver)
    if jobs is not None:
        jobs.append(job)
    engine.submit(job)
    assert done.wait(300) and steps[-1].error is None, steps[-1].error
    return [s.token.id for s in steps], [s.token.logprob for s in steps], steps


@pytest.fixture(scope="module")
def engines(tiny):
    on = Engine(tiny.model, tiny.tokenizer.eos_token_ids, speculate="ngram")
    off = Engine(tiny.model, tiny.tokenizer.eos_token_ids, speculate="off")
    on.start()
    off.start()
    yield on, off
    on.stop()
    off.stop()


# ---- drafting ----

def test_draft_continues_the_latest_earlier_occurrence_of_the_suffix():
    seq = [1, 2, 3, 4, 5, 6, 9, 9, 2, 3, 4]
    assert draft(Tokens(seq), 3) == [5, 6, 9]
    assert draft(Tokens([7, 8, 1, 2, 3]), 3) == []  # no earlier occurrence of any suffix
    # a run that repeats: the occurrence with K tokens after it, not the one just before
    assert draft(Tokens([5] * 10), 4) == [5, 5, 5, 5]
    assert draft(Tokens(seq), 0) == []
    t = Tokens(seq)
    t.append(list(range(200)))  # grows past its first buffer
    assert t.list() == seq + list(range(200))


def test_greedy_verify_keeps_drafts_while_they_are_the_argmax():
    lp = mx.log(mx.array([[0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6]]))
    p = Params(max_tokens=8, temperature=0.0)
    assert [t for t, _ in verify(lp, [1, 0], p, None)] == [1, 0, 2]  # both kept, one more
    assert [t for t, _ in verify(lp, [1, 2], p, None)] == [1, 0]  # the second is not argmax
    out = verify(lp, [2, 0], p, None)
    assert [t for t, _ in out] == [1] and out[0][1] == pytest.approx(np.log(0.7), abs=1e-6)


# ---- the engine: same tokens, same log-probs ----

def test_speculative_greedy_equals_batched_greedy_on_the_tiny_model(engines, tiny):
    on, off = engines
    prompt = tiny.tokenizer.apply_chat_template(COPY_MESSAGES, add_generation_prompt=True)
    before = on.stats.spec_accepted
    ids_on, lps_on, _ = run(on, prompt, max_tokens=96, temperature=0.0, top_logprobs=3)
    ids_off, lps_off, _ = run(off, prompt, max_tokens=96, temperature=0.0)
    assert on.stats.spec_accepted > before, "nothing was speculated: the test shows nothing"
    assert ids_on == ids_off
    assert max(abs(a - b) for a, b in zip(lps_on, lps_off)) < 1e-4


def test_logit_bias_holds_under_speculation(engines, tiny):
    on, off = engines
    prompt = tiny.tokenizer.apply_chat_template(COPY_MESSAGES, add_generation_prompt=True)
    plain, _, _ = run(off, prompt, max_tokens=8, temperature=0.0)
    bias = {plain[0]: -100.0, 42: 30.0}
    ids_on, lps_on, _ = run(on, prompt, max_tokens=40, temperature=0.0, logit_bias=bias)
    ids_off, lps_off, _ = run(off, prompt, max_tokens=40, temperature=0.0, logit_bias=bias)
    assert ids_on == ids_off and plain[0] not in ids_on
    assert max(abs(a - b) for a, b in zip(lps_on, lps_off)) < 1e-4


def test_a_stream_handed_to_the_batch_goes_on_as_if_it_had_decoded_there(engines, tiny):
    """A second request arrives while the first decodes alone: the first joins the batch
    with its KV and finishes with the tokens it would have had; the second is served too."""
    on, off = engines
    prompt = tiny.tokenizer.apply_chat_template(COPY_MESSAGES, add_generation_prompt=True)
    other = tiny.tokenizer.apply_chat_template([{"role": "user", "content": "Hi."}],
                                               add_generation_prompt=True)
    second = {}

    def join():
        t = threading.Thread(target=lambda: second.update(
            out=run(on, other, max_tokens=16, temperature=0.0)))
        t.start()
        second["thread"] = t

    first = []
    ids_on, lps_on, _ = run(on, prompt, done_after=(10, join), jobs=first, max_tokens=120,
                            temperature=0.0)
    second["thread"].join(60)
    ids_off, lps_off, _ = run(off, prompt, max_tokens=120, temperature=0.0)
    assert first[0].drafted > 0, "the stream never speculated"
    assert first[0].produced > 0, "the stream never reached the batch"  # tokens out of it
    assert ids_on == ids_off and len(ids_on) == 120
    assert max(abs(a - b) for a, b in zip(lps_on, lps_off)) < 1e-4
    assert second["out"][0] == run(off, other, max_tokens=16, temperature=0.0)[0]


def test_the_last_job_left_in_the_batch_decodes_alone_again(engines, tiny):
    """Two requests start together (the batch takes both); once the short one ends, the long
    one leaves the batch with its KV and speculates, with the tokens it would have had."""
    on, off = engines
    prompt = tiny.tokenizer.apply_chat_template(COPY_MESSAGES, add_generation_prompt=True)
    other = tiny.tokenizer.apply_chat_template([{"role": "user", "content": "Hi."}],
                                               add_generation_prompt=True)
    results = {}
    # an engine not started yet: both jobs wait in its inbox, and start as one batch (a
    # group of two: neither runs alone)
    fresh = Engine(tiny.model, tiny.tokenizer.eos_token_ids, speculate="ngram")
    threads = [threading.Thread(target=lambda k=k, pr=pr, n=n: results.update(
        {k: run(fresh, pr, max_tokens=n, temperature=0.0)}))
        for k, pr, n in (("long", prompt, 120), ("short", other, 4))]
    for t in threads:
        t.start()
    import time
    time.sleep(0.5)
    fresh.start()
    try:
        for t in threads:
            t.join(120)
        assert fresh.stats.steps > 0 and fresh.stats.spec_steps > 0, fresh.stats
        ids_off, lps_off, _ = run(off, prompt, max_tokens=120, temperature=0.0)
        assert results["long"][0] == ids_off
        assert max(abs(a - b) for a, b in zip(results["long"][1], lps_off)) < 1e-4
    finally:
        fresh.stop()


def test_a_budget_ends_a_speculated_stream_exactly(engines, tiny):
    on, _ = engines
    prompt = tiny.tokenizer.apply_chat_template(COPY_MESSAGES, add_generation_prompt=True)
    for n in (1, 2, 7):
        ids, _, steps = run(on, prompt, max_tokens=n, temperature=0.0)
        assert len(ids) == n and steps[-1].finish_reason == "length"


def test_a_step_never_drafts_past_the_budget_and_keeps_the_kv_in_step(tiny):
    """LoneStream itself: each step yields at most what is left of the budget, and the KV
    always holds every token but the last."""
    from rlproxy.serving.speculate import LoneStream

    prompt = tiny.tokenizer.apply_chat_template(COPY_MESSAGES, add_generation_prompt=True)
    for budget in (3, 9, 40):
        lone = LoneStream.start(tiny.model, Job(list(prompt), Params(
            max_tokens=budget, temperature=0.0), lambda s: None), None, 0)
        drafted = 0
        while lone.produced < budget:
            lone.step(tiny.model)
            drafted += lone.last_drafted
            assert lone.produced <= budget
            assert lone.cache[0].offset == len(prompt) + lone.produced - 1
        assert drafted > 0 or budget < 9, "nothing drafted: the cap was never tested"


@pytest.mark.real_model
def test_speculative_greedy_equals_batched_greedy_on_smollm2(real):
    """On the real model, where drafts from the prompt are right most of the time."""
    on = Engine(real.model, real.tokenizer.eos_token_ids, speculate="ngram")
    off = Engine(real.model, real.tokenizer.eos_token_ids, speculate="off")
    on.start()
    off.start()
    try:
        prompt = real.tokenizer.apply_chat_template(COPY_MESSAGES, add_generation_prompt=True)
        ids_on, lps_on, _ = run(on, prompt, max_tokens=64, temperature=0.0)
        ids_off, lps_off, _ = run(off, prompt, max_tokens=64, temperature=0.0)
        assert ids_on == ids_off
        assert max(abs(a - b) for a, b in zip(lps_on, lps_off)) < 1e-4
        assert on.stats.spec_tokens / on.stats.spec_steps > 1.5  # copying: several a step
        assert "handler_0" in real.tokenizer.decode(ids_on)
    finally:
        on.stop()
        off.stop()


# ---- exact sampling: a chi-square test ----

N_DRAWS = 20_000  # per side
ALPHA = 0.001


def chi_square_same(a: np.ndarray, b: np.ndarray, categories) -> bool:
    """Whether a two-sample chi-square test at significance ALPHA accepts that A and B come from
    one distribution over CATEGORIES (every token not among them is one more category). The
    critical value is Wilson and Hilferty's approximation of the chi-square quantile (within 1%
    at these degrees of freedom): no SciPy needed."""
    def counts(x):
        c = [(x == k).sum() for k in categories]
        return c + [len(x) - sum(c)]
    table = np.array([counts(a), counts(b)], dtype=float)
    table = table[:, table.sum(axis=0) > 0]
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0) / table.sum()
    statistic = ((table - expected) ** 2 / expected).sum()
    df = table.shape[1] - 1
    z = 3.0902  # the standard normal's 1 - ALPHA quantile
    critical = df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3
    return statistic < critical


def test_sampled_tokens_follow_the_samplers_distribution(tiny):
    """The tiny model's next-token distribution after a fixed prompt (temperature 0.3, top_p
    0.9), with a draft of the second most likely token: the first token the rejection rule
    yields and the batched sampler's tokens agree by a two-sample chi-square test at
    significance 0.001 over the three likeliest tokens and the rest, 20,000 draws each. That
    many detect a 2% shift of a token's probability (expected statistic 25 against a critical
    16.3): the same rule shifted by 2% toward the draft is refused below."""
    prompt = tiny.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a colour."}], add_generation_prompt=True)
    logits = tiny.model(mx.array(prompt)[None])[0, -1:].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    p = Params(max_tokens=4, temperature=0.3, top_p=0.9)
    q = np.exp(np.array(target_logits(logprobs, p)[0]))
    order = np.argsort(-q)
    assert 0.1 < q[order[1]] < 0.9, "no token to draft that tells anything"
    drafted, categories = int(order[1]), [int(t) for t in order[:3]]

    # without speculation: the engine's own sampler, over N_DRAWS copies of the row at once
    sampler = make_sampler(p.temperature, p.top_p, seed=1)
    batched = np.array(sampler(mx.repeat(logprobs, N_DRAWS, axis=0)))
    # with: the rejection rule on [the drafted position, the one after it]; the first token
    # it yields (the draft when accepted, else a draw from q without it)
    keys = mx.random.split(mx.random.key(2), N_DRAWS)
    mx.eval(keys)
    rows = mx.concatenate([logprobs, logprobs])
    spec = np.array([verify(rows, [drafted], p, keys[i])[0][0] for i in range(N_DRAWS)])
    assert chi_square_same(spec, batched, categories)
    assert abs((spec == drafted).mean() - q[drafted]) < 0.015
    # The test's power: the drafted token 2% likelier than q says is refused.
    move = np.random.default_rng(3).random(N_DRAWS) < 0.02 / (1 - q[drafted])
    assert not chi_square_same(np.where(move, drafted, spec), batched, categories)


# ---- the trainer's view of a speculated turn, over HTTP ----

server = server_with()


def last_turn(data_dir) -> dict:
    """The last turn recorded: pending its next state, or in conversations.jsonl."""
    turns = [t for name in ("conversations.jsonl", "pending_turns.jsonl")
             for t in read_records(data_dir, name) if t.get("choices")]
    assert turns, "no turn recorded"
    return max(turns, key=lambda t: t["timings"].get("finished_at", 0) if isinstance(
        t.get("timings"), dict) else 0)


def spec_accepted(server) -> float:
    import urllib.request

    text = urllib.request.urlopen(server.url + "/metrics", timeout=30).read().decode()
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("rlproxy_spec_accepted_tokens_total"))


def test_a_speculated_turn_trains_with_ratio_one_at_version_0(server, tiny):
    """Over HTTP, with the shipped default (--speculate auto: ngram, the base being float32): a
    turn whose drafts were
    accepted is recorded with the log-probs the trainer's own forward gives its tokens."""
    from rlproxy.training.loop import training_copy

    before = spec_accepted(server)
    reply = server.client().chat.completions.create(
        model="tiny", messages=COPY_MESSAGES, max_tokens=64, temperature=0)
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert spec_accepted(server) > before, "nothing was speculated: the test shows nothing"
    turn = last_turn(server.data_dir)
    choice = turn["choices"][0]
    assert choice["adapter_versions"] == [0] * len(choice["completion_ids"])
    ids = turn["prompt_ids"] + choice["completion_ids"]
    model = training_copy(tiny)
    new = token_logprobs(model, mx.array(ids[:-1])[None], mx.array(ids[1:])[None])[0]
    new = np.array(new[len(turn["prompt_ids"]) - 1:])
    ratio = np.exp(new - np.array(choice["logprobs"]))
    assert np.abs(ratio - 1).max() < 1e-4


# ---- the merged adapter ----

def test_the_merged_adapter_serves_the_unmerged_log_probs(own):
    """A trained-like adapter (every lora_b drawn): merged and unmerged forwards agree within
    1e-4 in log-probs; version 0's merge is the base weight itself, no copy."""
    model = own.model
    layers = merge_layers(model)
    assert layers, "the tiny model's float32 LoRA layers should merge"
    weights = lora_weights(model)
    zero = merged_weights(layers, weights)
    assert all(zero[n].weight is layer.linear.weight for n, layer in layers.items())
    drawn = {k: (mx.random.normal(v.shape, key=mx.random.key(i)) * 0.05
                 if k.endswith("lora_b") else v) for i, (k, v) in enumerate(weights.items())}
    from mlx.utils import tree_unflatten
    model.update(tree_unflatten(list(drawn.items())))
    ids = mx.array(list(range(10, 90)))[None]
    set_merged(layers, None)
    unmerged = token_logprobs(model, ids[:, :-1], ids[:, 1:])
    set_merged(layers, merged_weights(layers, drawn))
    merged = token_logprobs(model, ids[:, :-1], ids[:, 1:])
    set_merged(layers, None)
    base = {k: mx.zeros_like(v) if k.endswith("lora_b") else v for k, v in drawn.items()}
    model.update(tree_unflatten(list(base.items())))
    plain = token_logprobs(model, ids[:, :-1], ids[:, 1:])
    assert mx.abs(merged - unmerged).max().item() < 1e-4
    assert mx.abs(unmerged - plain).max().item() > 1e-2  # the adapter changes them


def test_a_published_adapter_is_served_merged_from_its_first_step(own):
    engine = Engine(own.model, own.tokenizer.eos_token_ids, speculate="off")
    engine.start()
    try:
        assert engine.stats.merged and engine.stats.merged_bytes == 0  # version 0: no copy
        weights = {k: (mx.random.normal(v.shape, key=mx.random.key(7)) * 0.05
                       if k.endswith("lora_b") else v) for k, v in lora_weights(own.model).items()}
        mx.eval(weights)
        prompt = list(range(20, 60))
        engine.publish_adapter(weights, 1)
        import time
        deadline = time.monotonic() + 30
        while engine.adapter_version != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.adapter_version == 1 and engine.stats.merged
        assert engine.stats.merged_bytes > 0
        _, lps, steps = run(engine, prompt, max_tokens=6, temperature=0.0)
        assert all(s.token.adapter_version == 1 for s in steps[1:])
        ids = prompt + [s.token.id for s in steps]
        set_merged(merge_layers(own.model), None)  # the unmerged form, on this thread
        want = token_logprobs(own.model, mx.array(ids[:-1])[None], mx.array(ids[1:])[None])[0]
        assert np.abs(np.array(want[len(prompt) - 1:]) - np.array(lps)).max() < 1e-4
    finally:
        engine.stop()


def test_a_swap_sets_references_and_frees_the_merged_weights_it_replaced(own):
    """A swap puts the published arrays themselves into the model (no walk over the module
    tree), and the merged weights it replaces are freed off the swap: a few a decode step, all
    of them once nothing decodes (SmolLM2's 405 MiB at once took 30-90 ms of the engine thread:
    bench/swap.py --size smollm2-135m-instruct --swap-only)."""
    import time

    engine = Engine(own.model, own.tokenizer.eos_token_ids, speculate="off")
    engine.start()
    try:
        drawn = {k: (mx.random.normal(v.shape, key=mx.random.key(3)) * 0.05
                     if k.endswith("lora_b") else v) for k, v in lora_weights(own.model).items()}
        versions = [{k: v * (i + 1) if k.endswith("lora_b") else v for k, v in drawn.items()}
                    for i in range(2)]
        mx.eval(versions)
        deadline = time.monotonic() + 30
        for version, weights in enumerate(versions, start=1):
            engine.publish_adapter(weights, version)
            while engine.adapter_version != version and time.monotonic() < deadline:
                time.sleep(0.01)
            # a request decodes across the swap's aftermath (freeing goes on between steps)
            run(engine, list(range(20, 40)), max_tokens=4, temperature=0.0)
        while engine._retired and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.adapter_version == 2 and engine.stats.merged_bytes > 0
        assert not engine._retired  # version 1's merged weights: replaced, and freed
        assert all(v is versions[1][k] for k, v in lora_weights(own.model).items())
        layers = merge_layers(own.model)
        assert all(layer._merged.a is versions[1][f"{n}.lora_a"] for n, layer in layers.items())
    finally:
        engine.stop()


def test_auto_speculates_but_not_on_a_quantized_base_on_the_cpu(tiny, tmp_path):
    """`--speculate auto`, the default: ngram for a float base; off for a quantized one on the
    CPU, where MLX's quantized matmuls cost more per row over a draft's rows than over one, so
    a verifying pass loses (bench/draft_sweep.py --dequantize no); an explicit setting stands.
    A real server says which on /healthz and serves its lone stream a token a step."""
    import requests

    from rlproxy.serving.model import load_serving_model
    from rlproxy.settings import ModelSettings

    eos = tiny.tokenizer.eos_token_ids
    quantized = load_serving_model(ModelSettings(model="tiny", quantize_bits=4)).model
    on_cpu = mx.default_device() == mx.cpu
    assert Engine(tiny.model, eos).speculate == "ngram"
    assert Engine(quantized, eos).speculate == ("off" if on_cpu else "ngram")
    assert Engine(quantized, eos, speculate="ngram").speculate == "ngram"
    assert Engine(tiny.model, eos, speculate="off").speculate == "off"
    with ServerThread(make_settings(tmp_path, quantize_bits=4), None) as s:
        r = s.client().chat.completions.create(model="m", messages=COPY_MESSAGES, max_tokens=24,
                                               temperature=0)
        assert r.usage.completion_tokens == 24
        engine = requests.get(s.url + "/healthz", timeout=30).json()["engine"]
    if on_cpu:
        assert engine["speculate"] == "off" and engine["spec_steps"] == 0, engine
