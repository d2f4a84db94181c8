"""How one request turns logits into a token: its seeded sampler and its logits processors.

Owns the per-request sampling rules and their order; the engine (serving/engine.py) applies them inside
mlx-lm's BatchGenerator. What the engine records as a token's log-prob is the log-softmax after
these processors and before the sampler's temperature, top_k and top_p.

- The sampler applies temperature first, then top_k and top_p, in OpenAI's order (mlx-lm's own
  `make_sampler` filters top_p before temperature). Each request owns a PRNG key from its seed,
  so the same seed gives the same tokens whatever else is in the batch.
- `logit_bias` is mlx-lm's processor. `presence_penalty` / `frequency_penalty` are our own, as
  OpenAI defines them: over every token of the completion so far, and only the completion
  (mlx-lm's penalties look at a 20-token window that also covers the prompt).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p, make_logits_processors


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def make_sampler(temperature: float, top_p: float, seed: int, top_k: int = 0):
    """A per-request sampler with its own PRNG key: the same seed gives the same tokens.
    Greedy requests all share one function, so BatchGenerator picks a batch of them in one call
    (it samples row by row when the rows' samplers differ). On a 2-core CPU the step time is the
    same either way within noise (`bench/serving_step.py`: 0.83-1.22x over four runs)."""
    if temperature == 0:
        return greedy
    key = mx.random.key(seed % 2**64)  # MLX keys take uint64; OpenAI seeds may be negative

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        scaled = logprobs * (1.0 / temperature)
        if 0 < top_k < scaled.shape[-1]:  # a k at or past the vocabulary keeps every token
            scaled = apply_top_k(scaled, top_k)
        if top_p < 1.0:
            scaled = apply_top_p(scaled - mx.logsumexp(scaled, axis=-1, keepdims=True), top_p)
        return mx.random.categorical(scaled, key=sub)

    return sample


def make_penalties(presence: float, frequency: float):
    """OpenAI's penalties: logit[j] -= frequency * c[j] + presence * (c[j] > 0), where c[j]
    counts token j in the completion so far. A logits processor for BatchGenerator, which calls
    it once per step with the whole sequence (prompt, then every token sampled): its length at
    the first call is where the completion starts."""
    start, taken, counts = None, 0, None

    def penalize(tokens: mx.array, logits: mx.array) -> mx.array:
        nonlocal start, taken, counts
        if start is None:
            start, counts = len(tokens), mx.zeros((logits.shape[-1],), mx.float32)
        new = tokens[start + taken:]  # one token per step: the one sampled last
        if len(new):
            counts = counts.at[new].add(1.0)
            taken += len(new)
        penalty = frequency * counts + presence * (counts > 0)
        return logits - penalty.astype(logits.dtype)

    return penalize


def make_processors(logit_bias: dict[int, float] | None, presence: float, frequency: float):
    processors = make_logits_processors(logit_bias=logit_bias)
    if presence or frequency:
        processors.append(make_penalties(presence, frequency))
    return processors
