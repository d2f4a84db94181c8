"""A Tinker run's weights brought back (remote/weights.py): the hosted service's PEFT layout and
rlproxy's own mlx-lm layout give the same served log-probs; a misfit is refused. Real files,
the real conversion, the real engine on the embedded tiny model."""

from __future__ import annotations

import queue

import mlx.core as mx
import numpy as np
import pytest

from rlproxy.remote.weights import WeightsMisfit, fit
from rlproxy.serving.engine import Engine
from rlproxy.serving.jobs import Job, SamplingParams
from rlproxy.serving.model import lora_weights
from rlproxy.serving.peft import read_adapter, to_peft, write_mlx, write_peft
from rlproxy.training.learner import training_copy


def served(engine: Engine, weights, version: int, prompt: list[int]):
    """(ids, log-probs) the engine samples for PROMPT (seed 7) once WEIGHTS are published."""
    engine.publish_adapter(weights, version)
    q: queue.Queue = queue.Queue()
    engine.submit(Job(prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=7), q.put))
    ids, lps = [], []
    while True:
        step = q.get(timeout=60)
        if step.token is not None:
            assert step.token.adapter_version == version
            ids.append(step.token.id)
            lps.append(step.token.logprob)
        if step.finish_reason:
            assert step.error is None
            return ids, np.array(lps)


@pytest.fixture
def trained(own):
    """A LoRA adapter of the tiny model with lora_b away from 0 (a trained one's shape)."""
    model = training_copy(own)
    rng = np.random.default_rng(3)
    weights = {k: mx.array(rng.normal(0, 0.05, v.shape).astype(np.float32))
               if k.endswith("lora_b") else v for k, v in lora_weights(model).items()}
    return model, weights


def test_peft_and_mlx_layouts_serve_the_same_logprobs(own, trained, tmp_path):
    model, weights = trained
    current, cfg = lora_weights(model), own.lora_config
    blocks, scale = len(model.layers), cfg["lora_parameters"]["scale"]
    write_mlx(tmp_path / "mlx", weights, cfg)
    peft_weights, peft_cfg = to_peft(weights, cfg, "tiny", blocks)
    peft_cfg["lora_alpha"] = peft_cfg["r"] * 2 * scale  # another scale: lora_b is rescaled
    peft_weights = {k: v / 2 if "lora_B" in k else v for k, v in peft_weights.items()}
    write_peft(tmp_path / "peft", peft_weights, peft_cfg)

    from_mlx = fit(*read_adapter(tmp_path / "mlx"), current, scale, blocks)
    from_peft = fit(*read_adapter(tmp_path / "peft"), current, scale, blocks)
    for k in current:
        assert mx.allclose(from_mlx[k], from_peft[k], atol=1e-6).item(), k

    engine = Engine(own.model, own.tokenizer.eos_token_ids)
    engine.start()
    try:
        prompt = [1, 691, 201, 85, 351, 981]
        base_ids, base_lps = served(engine, current, 1, prompt)
        ids_a, lps_a = served(engine, from_mlx, 2, prompt)
        ids_b, lps_b = served(engine, from_peft, 3, prompt)
    finally:
        engine.stop()
    assert ids_a == ids_b and np.abs(lps_a - lps_b).max() < 1e-5
    n = min(len(base_ids), len(ids_a))
    assert base_ids != ids_a or np.abs(base_lps[:n] - lps_a[:n]).max() > 1e-3  # it applied


def test_an_adapter_that_does_not_fit_is_refused(own, trained):
    model, weights = trained
    current, cfg = lora_weights(model), own.lora_config
    blocks, scale = len(model.layers), cfg["lora_parameters"]["scale"]
    rank4 = {k: (v[:, :4] if k.endswith("lora_a") else v[:4]) for k, v in weights.items()}
    small = {**cfg, "lora_parameters": {**cfg["lora_parameters"], "rank": 4}}
    with pytest.raises(WeightsMisfit, match="another --lora-rank"):
        fit(rank4, small, current, scale, blocks)
    extra = {**weights, "model.layers.0.mlp.extra.lora_a": mx.zeros((4, 8))}
    with pytest.raises(WeightsMisfit, match="no LoRA layer"):
        fit(extra, cfg, current, scale, blocks)
    # a module the run does not train is served as not adapted (lora_b = 0), not refused
    some = {k: v for k, v in weights.items() if "self_attn" in k}
    got = fit(some, cfg, current, scale, blocks)
    assert all(not got[k].any().item() for k in got if "self_attn" not in k
               and k.endswith("lora_b"))
