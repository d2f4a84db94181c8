"""Prompt-lookup speculation for a stream that decodes alone (`--speculate ngram`).

Agents copy: tool calls quote paths from the prompt, edits repeat the lines they change. So the
next tokens are often the ones that followed the last few tokens somewhere earlier in the prompt
or the completion. A step drafts up to DRAFT_MAX of them (`draft`: what followed the latest
earlier occurrence of the last NGRAM_MAX .. NGRAM_MIN tokens, longest first, that has that many
after it), then verifies them in one
forward pass of the model over [last token, drafts...]: on a CPU or a Mac a lone stream is
memory-bound, so k + 1 positions cost little more than one. A wrong draft costs that margin and
nothing else; a right one gives several tokens for one step.

Exactness (what RL needs; `verify`):
- each position's logits go through the request's logit_bias, then log-softmax at temperature 1
  is the recorded log-prob, as in the batched path (serving/engine.py's docstring);
- greedy: a drafted token is kept while it is the argmax, so the text is the non-speculative
  greedy text (up to float rounding between a k + 1-row and a 1-row forward, which could only
  flip an exact near-tie: the tests find the same tokens and log-probs within 1e-4);
- temperature > 0: the target q is the sampler's (temperature, then top_k, then top_p, as in
  serving/sampler.py). A drafted token x (a point mass) is accepted with probability q(x); on a
  rejection the token is drawn from q with x removed, renormalised; after k acceptances one more
  token is drawn from the last position. Each emitted token is then distributed exactly as q
  (Leviathan et al. 2023, Chen et al. 2023), and its log-prob is read from the verifying pass.
- The KV cache is trimmed back to the accepted tokens (`LoneStream.step`).

Who speculates (`speculable`): a job of the live adapter, starting while nothing else decodes,
without presence/frequency penalties (their counts run over the completion: those requests take
the batched path), and at temperature 0 or without a `seed` of its own (a seeded sampled request
keeps its promise: the same tokens whatever else runs). The engine hands the stream over to its
BatchGenerator as soon as another job wants to decode, and takes a job back from the batch when
it is the last one left (`LoneStream.resume`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from rlproxy.serving.jobs import Job, SamplingParams
from rlproxy.serving.logprobs import top_logprobs
from rlproxy.serving.sampler import make_processors

DRAFT_MAX = 6  # tokens drafted per step: 7 positions cost SmolLM2 ~1.5x one (bench/draft_sweep.py)
NGRAM_MAX, NGRAM_MIN = 4, 2  # the suffix lengths looked up, longest first
# a seed the sampled stream's own draws take, apart from the batched sampler's (seeded by the
# job's seed), so a stream handed over does not draw the same numbers twice
_KEY_OFFSET = 0x9E3779B97F4A7C15


def speculation(setting: str, model) -> str:
    """What `--speculate SETTING` means for MODEL: "ngram" or "off". `auto` is ngram but for a
    quantized base on the CPU: MLX's CPU kernels for quantized matmuls cost far more per row on
    several rows than on one, so a verifying pass costs more than the tokens it saves
    (SmolLM2 4-bit: 0.68x the no-draft decode speed on an edit, 0.69x on plain text, with
    `bench/draft_sweep.py --dequantize no`)."""
    if setting != "auto":
        return setting
    quantized = any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    return "off" if quantized and mx.default_device() == mx.cpu else "ngram"


def speculable(job: Job, explicit_seed: bool) -> bool:
    p = job.params
    return (not p.presence_penalty and not p.frequency_penalty
            and (p.temperature == 0 or not explicit_seed))


class Tokens:
    """The sequence so far (prompt, then completion) in a growing NumPy buffer, for lookups."""

    def __init__(self, ids: list[int]):
        self.buf = np.zeros(max(64, 2 * len(ids)), dtype=np.int64)
        self.buf[:len(ids)] = ids
        self.n = len(ids)

    def append(self, ids: list[int]) -> None:
        if self.n + len(ids) > len(self.buf):
            grown = np.zeros(2 * (self.n + len(ids)), dtype=np.int64)
            grown[:self.n] = self.buf[:self.n]
            self.buf = grown
        self.buf[self.n:self.n + len(ids)] = ids
        self.n += len(ids)

    def list(self) -> list[int]:
        return self.buf[:self.n].tolist()


def draft(tokens: Tokens, k: int) -> list[int]:
    """Up to K tokens that followed an earlier occurrence of the sequence's last n tokens (n from
    NGRAM_MAX down to NGRAM_MIN); [] when there is none."""
    seq, n_all = tokens.buf, tokens.n
    if k <= 0:
        return []
    for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
        if n_all <= n:
            continue
        suffix = seq[n_all - n:n_all]
        # p: where an earlier n-gram ends (inclusive), p < n_all - 1 so something follows it
        ends = np.flatnonzero(seq[n - 1:n_all - 1] == suffix[-1]) + (n - 1)
        for j in range(1, n):
            if not len(ends):
                break
            ends = ends[seq[ends - j] == suffix[-1 - j]]
        if len(ends):
            # the latest occurrence with K tokens after it (the latest of all, in a run that
            # repeats, is the one just before the suffix: it has one token to give), else the
            # earliest
            whole = ends[ends + k < n_all]
            p = int(whole[-1] if len(whole) else ends[0])
            return seq[p + 1:min(p + 1 + k, n_all)].tolist()
    return []


@dataclass
class Emitted:
    token: int
    logprob: float
    top: list | None


@dataclass
class LoneStream:
    """One job decoding alone. `cache` holds the KV of `tokens` but its last one, which is the
    next step's first input. `produced`: completion tokens delivered."""

    job: Job
    cache: list
    tokens: Tokens
    produced: int = 0
    last_drafted: int = 0  # the last step's drafted tokens, and of those accepted
    last_accepted: int = 0
    key: mx.array | None = None
    processors: list = field(default_factory=list)

    @classmethod
    def start(cls, model, job: Job, cache: list | None, done: int) -> "LoneStream | None":
        """Fill CACHE (KV of prompt_ids[:DONE], or None) up to all but the last prompt token;
        None when the cache cannot be trimmed (then the job takes the batched path)."""
        cache = cache if cache is not None else make_prompt_cache(model)
        if not can_trim_prompt_cache(cache):
            return None
        ids = job.prompt_ids
        if done >= len(ids):  # a cached prefix covering the whole prompt: refeed the last one
            trim_prompt_cache(cache, done - len(ids) + 1)
            done = len(ids) - 1
        if done < len(ids) - 1:
            model(mx.array(ids[done:-1])[None], cache=cache)
            mx.eval([c.state for c in cache])
        return cls.made(job, cache, ids, 0)

    @classmethod
    def resume(cls, job: Job, cache: list, tokens: list[int]) -> "LoneStream | None":
        """A job taken back from the batch: CACHE holds the KV of TOKENS (its prompt and every
        token delivered); the last of them becomes the next step's input. None when the cache
        cannot be trimmed or does not match."""
        produced = len(tokens) - len(job.prompt_ids)
        if not can_trim_prompt_cache(cache) or produced < 1 or cache[0].offset != len(tokens):
            return None
        trim_prompt_cache(cache, 1)
        return cls.made(job, cache, tokens, produced)

    @classmethod
    def made(cls, job: Job, cache: list, tokens: list[int], produced: int) -> "LoneStream":
        p = job.params
        # its own draws, apart from the batched sampler's; a stream resumed again draws anew
        key = None if p.temperature == 0 else mx.random.key(
            (p.seed + _KEY_OFFSET + produced) % 2**64)
        return cls(job, cache, Tokens(tokens), produced=produced, key=key,
                   processors=make_processors(p.logit_bias, 0.0, 0.0))

    def step(self, model) -> list[Emitted]:
        """One forward pass over the last token and a draft; the tokens it yields (at least
        one), the cache trimmed to them."""
        p = self.job.params
        left = p.max_tokens - self.produced
        # the first token alone: its time is the time to first token, kept as the batch's
        # (and none once the cache cannot be trimmed back: a sliding window past its size)
        drafts = (draft(self.tokens, min(DRAFT_MAX, left - 1))
                  if self.produced and can_trim_prompt_cache(self.cache) else [])
        inputs = [int(self.tokens.buf[self.tokens.n - 1])] + drafts
        logits = model(mx.array(inputs)[None], cache=self.cache)[0]
        for processor in self.processors:
            logits = processor(None, logits)
        logits = logits.astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        out = verify(logprobs, drafts, p, self._next_key() if self.key is not None else None)
        emitted = [Emitted(t, lp, top_logprobs(logprobs[i], p.top_logprobs)
                           if p.top_logprobs else None) for i, (t, lp) in enumerate(out)]
        # the cache now holds inputs; keep the last token and the accepted drafts
        accepted = len(out) - 1
        trim_prompt_cache(self.cache, len(drafts) - accepted)
        self.tokens.append([e.token for e in emitted])
        self.produced += len(emitted)
        self.last_drafted, self.last_accepted = len(drafts), accepted
        return emitted

    def _next_key(self) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return sub

    def kv_tokens(self) -> list[int]:
        """The tokens the cache holds: all but the last."""
        return self.tokens.list()[:-1]


def target_logits(logprobs: mx.array, p: SamplingParams) -> mx.array:
    """The sampler's distribution as logits, row by row (serving/sampler.py's order)."""
    scaled = logprobs * (1.0 / p.temperature)
    if 0 < p.top_k < scaled.shape[-1]:
        scaled = apply_top_k(scaled, p.top_k)
    if p.top_p < 1.0:
        scaled = apply_top_p(scaled - mx.logsumexp(scaled, axis=-1, keepdims=True), p.top_p)
    return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)


def verify(logprobs: mx.array, drafts: list[int], p: SamplingParams,
           key: mx.array | None) -> list[tuple[int, float]]:
    """(token, recorded log-prob) for each token the step yields: the accepted drafts, then
    one token drawn (or the argmax) at the first rejected position or after the last draft.
    LOGPROBS: (len(drafts) + 1, V), row i the distribution after input i."""
    k = len(drafts)
    if key is None:  # greedy: keep a draft while it is the argmax
        best = mx.argmax(logprobs, axis=-1)
        chosen = mx.take_along_axis(logprobs, best[:, None], axis=-1)[:, 0]
        mx.eval(best, chosen)
        best, chosen = best.tolist(), chosen.tolist()
        out = []
        for i in range(k + 1):
            out.append((best[i], chosen[i]))
            if i == k or best[i] != drafts[i]:
                return out
    target = target_logits(logprobs, p)
    k_accept, k_draw = mx.random.split(key)
    d = mx.array(drafts + [0])
    q_draft = mx.exp(mx.take_along_axis(target, d[:, None], axis=-1)[:, 0])
    u = mx.random.uniform(shape=(k + 1,), key=k_accept)
    # a draw for every row, each from q with that row's draft removed (the last row has no
    # draft: it draws from q itself); only the first rejected row's is used
    removed = mx.where(mx.arange(target.shape[-1])[None] == d[:, None], -mx.inf, target)
    removed = mx.concatenate([removed[:k], target[k:]]) if k else target
    draws = mx.random.categorical(removed, key=k_draw)
    lp_draft = mx.take_along_axis(logprobs, d[:, None], axis=-1)[:, 0]
    lp_draws = mx.take_along_axis(logprobs, draws[:, None], axis=-1)[:, 0]
    mx.eval(q_draft, u, draws, lp_draft, lp_draws)  # one evaluation, then plain lists
    q_draft, u, draws, lp_draft, lp_draws = (a.tolist() for a in (
        q_draft, u, draws, lp_draft, lp_draws))
    out = []
    for i in range(k):
        if u[i] < q_draft[i]:
            out.append((drafts[i], lp_draft[i]))
        else:
            return out + [(draws[i], lp_draws[i])]
    return out + [(draws[k], lp_draws[k])]
