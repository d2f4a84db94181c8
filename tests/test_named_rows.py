"""Adapters served by name decode in the live batch, each row with its own adapter
(serving/named.py): rows of the live adapter and of named adapters of two ranks share one
forward pass, and each row's tokens and log-probs are its own adapter's, checked against that
adapter's model object run alone (the real engine thread; the embedded tiny model, and SmolLM2)."""

from __future__ import annotations

import json
import queue

import rlproxy  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import pytest

from rlproxy.serving.engine import Engine, Job, SamplingParams
from rlproxy.serving.logprobs import token_logprobs
from rlproxy.serving.model import lora_model, lora_weights, serve_lora_in_one_step


def drawn_adapter(own, rank: int, seed: int):
    """A model object over OWN's base arrays with LoRA of RANK, every lora_b drawn."""
    config = json.loads(json.dumps(own.lora_config))
    config["lora_parameters"]["rank"] = rank
    model = lora_model(own, config, seed)  # lora_a drawn from SEED too
    weights = lora_weights(model)
    model.load_weights([(k, mx.random.normal(v.shape, key=mx.random.key(seed + i)) * 0.05)
                        for i, (k, v) in enumerate(sorted(weights.items()))
                        if k.endswith("lora_b")], strict=False)
    serve_lora_in_one_step(model)  # as serving/saved.py's adapters are
    model.eval()
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("which,speculate", [
    ("tiny", "off"), ("tiny", "ngram"),
    pytest.param("smollm2", "off", marks=pytest.mark.real_model)])
def test_rows_of_several_adapters_decode_together_each_with_its_own(which, speculate, request):
    own = request.getfixturevalue("own" if which == "tiny" else "real")
    eos = own.tokenizer.eos_token_ids
    a, b = drawn_adapter(own, 8, 100), drawn_adapter(own, 4, 200)  # another rank too
    engine = Engine(own.model, eos, speculate=speculate)
    engine.add_adapter("a", a)
    engine.add_adapter("b", b)
    engine.start()
    try:
        prompts = [list(range(20, 50)), list(range(60, 75)), list(range(80, 120))]
        asked = [(None, prompts[0]), ("a", prompts[1]), ("b", prompts[2]), ("a", prompts[2]),
                 (None, prompts[1])]
        queues = []
        for name, prompt in asked:  # all submitted before any decodes: one batch
            q = queue.Queue()
            engine.submit(Job(prompt, SamplingParams(max_tokens=8, temperature=0.0), q.put,
                              adapter=name))
            queues.append(q)
        got = []
        for q in queues:
            ids, lps = [], []
            while True:
                step = q.get(timeout=120)
                assert step.error is None, step.error
                ids.append(step.token.id)
                lps.append(step.token.logprob)
                if step.finish_reason:
                    break
            got.append((ids, lps))
        # one pass held rows of both named adapters (and its stacks were built for both)
        assert {id(m) for m in engine._named._slots} == {id(a), id(b)}
        assert not engine._named.of_uid  # every named row has left the batch
    finally:
        engine.stop()
    models = {None: own.model, "a": a, "b": b}
    for (name, prompt), (ids, lps) in zip(asked, got):
        seq = prompt + ids
        want = token_logprobs(models[name], mx.array(seq[:-1])[None],
                              mx.array(seq[1:])[None])[0][len(prompt) - 1:]
        # a named row's term comes out of one GEMM over every adapter's columns, rounded
        # otherwise than its model's own; with these strong drawn adapters SmolLM2 drifts up
        # to ~1.5e-4 (the live rows, whose B is zero at version 0, within 1e-5)
        tolerance = 1e-4 if name is None else 2.5e-4
        assert max(abs(x - y) for x, y in zip(want.tolist(), lps)) < tolerance, name
        logits = models[name](mx.array(seq[:-1])[None])[0, len(prompt) - 1:]
        assert mx.argmax(logits, axis=-1).tolist() == ids, name  # greedy: its own argmax
    # the adapters differ enough that the same prompt reads differently under each
    assert got[2] != got[3]


def test_sampler_weights_that_misfit_the_model_are_a_user_error_not_a_failed_batch(own,
                                                                                    tmp_path):
    """Saved weights whose arrays misfit their layout are refused when loaded (serving/model.py
    `saved_adapter_model`), as the Tinker API's user error naming the array; joined to the
    batch, they would fail every request decoding in it."""
    import asyncio

    from rlproxy.serving.model import save_adapter
    from rlproxy.serving.saved import SavedAdapters
    from rlproxy.tinker.sampling import Samplers
    from rlproxy.tinker.wire import UserError

    folder = save_adapter(own.model, own.lora_config, tmp_path / "weights")
    arrays = mx.load(str(folder / "adapters.safetensors"))
    first = sorted(arrays)[0]
    arrays[first] = arrays[first].T
    mx.save_safetensors(str(folder / "adapters.safetensors"), arrays)
    engine = Engine(own.model, own.tokenizer.eos_token_ids)
    engine.start()

    async def ask():
        saved = SavedAdapters(own, engine)
        samplers = Samplers(own, engine, None, saved)
        samplers.open("s", folder, "tinker://run/weights/misfit")
        try:
            with pytest.raises(UserError) as refused:
                await samplers.adapter_for("s")
            return str(refused.value), dict(saved.adapters)
        finally:
            await saved.aclose()

    try:
        message, loaded = asyncio.run(ask())
    finally:
        engine.stop()
    assert message.startswith("the sampler weights at tinker://run/weights/misfit do not fit")
    assert f"{first}: " in message and not loaded
