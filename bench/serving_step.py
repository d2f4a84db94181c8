"""What the serving model's per-token extras cost: its LoRA layers, and reading each token's log-prob.

1. LoRA forward: greedy `stream_generate` decode time per token (after the first) of the serving
   model as rlproxy loads it (LoRA layers, `ServingLoRALinear`: the term added in one addmm),
   the same model with mlx-lm's `LoRALinear` forward, and the model without LoRA layers
   (`mlx_lm.load`), alternated `--rounds` times; medians and their ratios to the plain model.
2. Log-prob read: the engine's per-step read of the sampled tokens' log-probs from 16 evaluated
   rows at a 151k vocabulary (and at the model's own), stacking the rows in MLX (the read before)
   versus serving/logprobs.py's `chosen_logprobs` (NumPy, in place); median microseconds.
3. Greedy batch: one BatchGenerator step of 8 greedy streams when they share serving/sampler.py's
   one greedy function (one argmax for the batch) and when each has a sampler of its own
   (mlx-lm then samples row by row, as it did for rlproxy's greedy requests before), with long
   prompts (PROMPT, ~1,200 tokens) and short ones (a few tokens); medians.

    python bench/serving_step.py [--model tiny] [--rounds 7] [--max-tokens 128]
                                 [--out bench/results/serving_step.json]
"""

import rlproxy  # noqa: F401, I001  (first: preloads OpenBLAS before anything imports mlx)

import argparse
import os
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import BatchGenerator, stream_generate
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tuner.lora import LoRALinear

from common import environment, report
from rlproxy.serving.logprobs import chosen_logprobs
from rlproxy.serving.model import ServingLoRALinear, load_serving_model, resolve_source
from rlproxy.serving.sampler import greedy
from rlproxy.settings import load_settings

PROMPT = "Summarise the quarterly figures for the northern warehouse. " * 20


def decode_s(model, tokenizer, ids: list[int], max_tokens: int) -> float:
    """Seconds per decoded token after the first (greedy; the prompt's prefill not counted)."""
    n, first = 0, None
    for _ in stream_generate(model, tokenizer, ids, max_tokens=max_tokens,
                             sampler=make_sampler(0.0)):
        n += 1
        if n == 1:
            first = time.perf_counter()
    return (time.perf_counter() - first) / max(1, n - 1)


def set_forward(model, cls) -> None:
    for _, module in model.named_modules():
        if isinstance(module, LoRALinear):
            module.__class__ = cls


def read_us(vocab: int, rows: int = 16, reps: int = 200) -> dict:
    logits = mx.random.normal((rows, vocab))
    batch = list(logits - mx.logsumexp(logits, axis=-1, keepdims=True))  # as the decode step
    mx.eval(batch)
    tokens = [(i * 7919) % vocab for i in range(rows)]

    def stacked():
        ids = mx.array(tokens)
        picked = mx.take_along_axis(mx.stack(batch), ids[:, None], axis=1)[:, 0]
        return picked.tolist()

    assert all(abs(a - b) < 1e-6 for a, b in zip(stacked(), chosen_logprobs(batch, tokens)))
    out = {}
    for name, fn in (("stacked", stacked), ("in_place", lambda: chosen_logprobs(batch, tokens))):
        times = []
        for _ in range(reps):
            tic = time.perf_counter()
            fn()
            times.append((time.perf_counter() - tic) * 1e6)
        out[name] = statistics.median(times)
    return out


def batch_step_ms(model, tokenizer, streams: int, shared: bool, max_tokens: int,
                  prompt: str) -> float:
    """Milliseconds a decode step of STREAMS greedy streams takes, once all of them decode."""
    ids = [tokenizer.encode(f"{prompt} Report {i}.") for i in range(streams)]
    samplers = [greedy if shared else (lambda lp: greedy(lp)) for _ in range(streams)]
    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=streams,
                         prefill_batch_size=streams)
    gen.insert(ids, max_tokens=[max_tokens] * streams, samplers=samplers)
    steps, tic = 0, None
    while True:
        _, responses = gen.next()
        if tic is None and len(responses) == streams:
            tic, steps = time.perf_counter(), 0
        steps += 1
        if any(r.finish_reason for r in responses):
            break
    gen.close()
    return (time.perf_counter() - tic) / max(1, steps - 1) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=Path("bench/results/serving_step.json"))
    a = p.parse_args()
    load_before = os.getloadavg()[0]
    served = load_serving_model(load_settings({"model": a.model}, environ={}).model)
    plain, tokenizer = load(resolve_source(a.model, "auto").path)
    ids = tokenizer.encode(PROMPT)
    runs = {"addmm": [], "mlx_lm": [], "plain": []}
    for _ in range(a.rounds + 1):  # the first round warms up and is dropped
        set_forward(served.model, ServingLoRALinear)
        runs["addmm"].append(decode_s(served.model, tokenizer, ids, a.max_tokens))
        set_forward(served.model, LoRALinear)
        runs["mlx_lm"].append(decode_s(served.model, tokenizer, ids, a.max_tokens))
        runs["plain"].append(decode_s(plain, tokenizer, ids, a.max_tokens))
    set_forward(served.model, ServingLoRALinear)
    ms = {k: statistics.median(v[1:]) * 1000 for k, v in runs.items()}
    reads = {vocab: read_us(vocab) for vocab in (151_000, served.vocab_size)}
    prompts = {"long": PROMPT, "short": "Summarise the figures."}
    batch = {f"{length}_{kind}": [] for length in prompts for kind in ("shared", "own")}
    for _ in range(a.rounds + 1):
        for name, got in batch.items():
            length, kind = name.split("_")
            got.append(batch_step_ms(served.model, tokenizer, 8, kind == "shared",
                                     a.max_tokens, prompts[length]))
    step_ms = {name: statistics.median(v[1:]) for name, v in batch.items()}
    lines = [f"decode ms/token ({a.model}, median of {a.rounds}): LoRA in one addmm "
             f"{ms['addmm']:.3f} ({ms['addmm'] / ms['plain']:.2f}x the plain model), mlx-lm's "
             f"LoRALinear {ms['mlx_lm']:.3f} ({ms['mlx_lm'] / ms['plain']:.2f}x), plain "
             f"{ms['plain']:.3f}"]
    lines += [f"log-prob read, 16 rows of {vocab}: stacked {r['stacked']:.1f} us, in place "
              f"{r['in_place']:.1f} us" for vocab, r in reads.items()]
    lines += [f"decode step of 8 greedy streams, {length} prompts: one shared sampler "
              f"{step_ms[length + '_shared']:.2f} ms, a sampler each {step_ms[length + '_own']:.2f}"
              f" ms ({step_ms[length + '_own'] / step_ms[length + '_shared']:.2f}x)"
              for length in prompts]
    result = {**environment(a.model, load_before, served.model_id,
                            {"rounds": a.rounds, "max_tokens": a.max_tokens}),
              "decode_ms_per_token": ms, "decode_s_runs": runs,
              "logprob_read_us": {str(k): v for k, v in reads.items()},
              "greedy_batch_step_ms": step_ms, "greedy_batch_step_runs": batch}
    report(lines, result, a.out)


if __name__ == "__main__":
    main()
