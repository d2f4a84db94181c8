"""The eval gate: a candidate adapter is served only if it is not worse than the served one.

With `eval_every` N > 0 the trainer publishes nothing between evaluations. Every N optimizer
steps, between batches, on the trainer thread, in units that yield to serving like a training
step's (each ends in mx.eval, then the trainer's pacer: training/pacing.py), the candidate is
measured through the learner's model (training/learner.py):

  probes     eval_probes prompts: the lines of --eval-prompts FILE.jsonl ({messages, tools?})
             first, then the most recent distinct prompts of the recorded main turns the trainer
             was given (prompts over MAX_PROBE_TOKENS are left out: each costs 4 prefills); with
             fewer distinct prompts than eval_probes they are reused with other seeds. Drawn once
             per served version, so the served adapter and every candidate meet the same probes
             and the same dice.
  samples    one per probe at temperature 1 (the distribution the trainer trains), at most
             eval_max_tokens tokens, a fixed seed per probe: by the candidate at every eval, by
             the served adapter once per served version (cached).
  reward     the mean over samples of the eval reward functions (eval_reward_functions, held
             back from training; default: the scoring ones), called like the scorer calls them,
             (turn, next_state=None) with the sample as the turn's only choice, first non-None
             value, clipped to [-1, 1]. A function that raises or runs past reward_timeout_s gives
             that sample no reward. With no function the reward check is skipped.
  KL         the mean per token of the exact KL over the vocabulary
                 KL_t(c || o) = sum_v p_c(v | x_<t) (log p_c(v | x_<t) - log p_o(v | x_<t))
             at the positions of the candidate's own probe samples x (every sampled token,
             the end token included), for o = the served adapter and o = the base model (the
             same LoRA layers with lora_b = 0, exactly the base).
  degeneracy the samples' figures of collapse (training/degeneracy.py: repeated 3-grams, empty
             replies, the share of whitespace characters, the share of distinct tokens), each
             compared with its limit and with the served adapter's figure on the same probes. On the
             samples, not on greedy replies: they cost no extra decode, and a collapse of the
             kind seen on the real model (entropy 1.10 -> 0.04) shows in them too; greedy
             replies would show one a little earlier.

Verdict (`refusal`): publish if reward >= served reward - eval_tolerance, both KLs < max_kl
(when set) and not degenerate. `check` returns it as a `Verdict`, with the `eval` line, and the
trainer (training/loop.py) applies it: it publishes the candidate, or rolls back to the last good
state (the state when the served adapter was published: adapter, optimizer, reward baseline and
the update count the LR schedule runs on), multiplies the learning rate by rollback_lr_factor and
writes a `rollback` line with the figures and the reason; max_rollbacks in a row pause
training, with the reason as the trainer's error (on /healthz). Every evaluation writes an
`eval` line to training.jsonl.

Not here: training, publishing, saving, the trainer's state (training/loop.py); the model and its
weights (training/learner.py); the degeneracy figures (training/degeneracy.py); the reward
functions are the user's (scoring/rewards.py loads and calls them). Probes are decoded one at a
time, not batched (mlx-lm's generate_step is not used: it samples from (1, V) log-probs, which
draws other tokens than (V,) ones for the same seed, and computes token n + 1 before it yields
token n, so its yields would not be pauses).
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from rlproxy.scoring.rewards import (
    Overran, call, call_with_timeout, load_reward_functions, takes_choice,
)
from rlproxy.serving.chat_template import render_prompt
from rlproxy.serving.logprobs import log_softmax, prefill
from rlproxy.serving.model import resolve_model_path
from rlproxy.serving.sampler import make_sampler
from rlproxy.settings import Settings
from rlproxy.training import degeneracy
from rlproxy.training.chunked_grad import chunk_bounds
from rlproxy.training.learner import LearnerUnavailable
from rlproxy.training.pacing import Pacer

log = logging.getLogger("rlproxy.trainer")
MAX_PROBE_TOKENS = 8192
RECENT_PROMPTS = 16  # recorded prompts kept to draw probes from
SEED = 7919  # probe i samples with seed SEED + i


# ---- pure figures ----

def refusal(cand: dict, served: dict, t) -> str | None:
    """Why the candidate must not be published (None: publish it). CAND and SERVED hold
    "reward" (None: not measured) and the degeneracy figures; CAND also "kl_base",
    "kl_served". T: the trainer settings."""
    reasons = []
    if cand["reward"] is not None and served["reward"] is not None \
            and cand["reward"] < served["reward"] - t.eval_tolerance:
        reasons.append(f"probe reward {cand['reward']:.3f} is below the served adapter's "
                       f"{served['reward']:.3f} by more than eval_tolerance {t.eval_tolerance}")
    for name in ("kl_base", "kl_served"):
        if t.max_kl is not None and cand[name] >= t.max_kl:
            reasons.append(f"KL to the {name[3:]} {cand[name]:.4f} >= max_kl {t.max_kl}")
    reasons += degeneracy.degenerate(cand, served)
    return "; ".join(reasons) or None


def load_eval_prompts(path: Path | None, tokenizer) -> list[dict]:
    """--eval-prompts FILE.jsonl: one {"messages": [...], "tools": [...]?} per line."""
    if path is None:
        return []
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            messages, tools = item["messages"], item.get("tools")
            ids = render_prompt(tokenizer, messages, tools)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--eval-prompts {path}, line {n}: expected a JSON object with "
                             f"'messages' (and optional 'tools'): {type(e).__name__}: {e}") \
                from None
        out.append({"prompt_ids": list(ids), "messages": messages, "tools": tools,
                    "source": f"{Path(path).name}:{n}"})
    return out


# ---- model work, in units ----

def sample(model, prompt: list[int], max_tokens: int, seed: int, eos, chunk: int, pace):
    """(tokens sampled at temperature 1, the end token included if reached; their (L, V)
    log-prob rows). PACE(seconds) after each unit: a prefill chunk, a token."""
    cache = prefill(model, prompt, _cuts(len(prompt) - 1, chunk), pace)
    sampler = make_sampler(1.0, 1.0, seed)
    y, tokens, rows = prompt[-1], [], []
    for _ in range(max_tokens):
        tic = time.perf_counter()
        logp = log_softmax(model(mx.array([[y]]), cache=cache)[0, -1])
        tok = sampler(logp)
        mx.eval(tok, logp)
        pace(time.perf_counter() - tic)
        y = int(tok.item())
        tokens.append(y)
        rows.append(logp)
        if y in eos:
            break
    return tokens, mx.stack(rows)


def token_rows(model, prompt: list[int], tokens: list[int], chunk: int, pace) -> mx.array:
    """(L, V) log-probs of the next token at each position of TOKENS after PROMPT."""
    cache = prefill(model, prompt, _cuts(len(prompt) - 1, chunk), pace)
    tic = time.perf_counter()
    out = log_softmax(model(mx.array([prompt[-1]] + tokens[:-1])[None], cache=cache)[0])
    mx.eval(out)
    pace(time.perf_counter() - tic)
    return out


def _cuts(n: int, chunk: int) -> list[tuple[int, int]]:
    """The prefill of N positions in units of at most CHUNK (fewer deep into a long prompt,
    as a training step's: chunked_grad.chunk_bounds)."""
    return [(a, b) for a, b, _ in chunk_bounds([0.0] * n, chunk)]


def kl_sum(p_rows: mx.array, q_rows: mx.array) -> float:
    """Sum over positions of KL(p || q), each over the whole vocabulary."""
    return float((mx.exp(p_rows) * (p_rows - q_rows)).sum().item())


# ---- the gate ----

@dataclass
class Verdict:
    """What an evaluation decided; the trainer applies it (training/loop.py)."""

    line: dict  # the `eval` line
    candidate: dict | None = None  # passed: the weights measured, the ones to publish
    good: dict | None = None  # refused: the state to restore (the served adapter's)
    lr_factor: float = 1.0  # refused: the learning-rate scale is multiplied by it
    in_a_row: int = 0  # refused: rollbacks since the last publish, this one included
    pause: bool = False  # refused max_rollbacks times in a row: training pauses

    @property
    def passed(self) -> bool:
        return self.line["passed"]


class EvalGate:
    """One per trainer; all its model work runs on the trainer thread, through the LEARNER's
    model, with PACE(seconds) after each unit. VERSION and GOOD: the served adapter's version
    and the trainer's state that goes with it (a snapshot: what a rollback restores)."""

    def __init__(self, settings: Settings, learner, pace: Pacer, tokenizer, functions: list,
                 version: int, good: dict):
        self.t, self.learner, self.pace, self.tokenizer = settings.trainer, learner, pace, tokenizer
        self.functions = functions
        self.timeout_s = settings.scoring.reward_timeout_s
        self.eos = set(tokenizer.eos_token_ids)
        self.extra = load_eval_prompts(self.t.eval_prompts, tokenizer)
        self.recent: deque = deque(maxlen=RECENT_PROMPTS)  # appended from any thread
        self.since = 0  # optimizer steps since the last evaluation or rollback
        self.in_a_row = 0  # rollbacks since the last publish
        self.served_version = version
        self.served_weights = good["adapter"]  # the learner's state it was given: served
        self.good = good
        self._served: tuple[int, list[dict], dict] | None = None  # version, probes, figures

    def observe(self, turn: dict) -> None:
        """A recorded main turn given to the trainer: its prompt may become a probe."""
        if len(turn["prompt_ids"]) <= MAX_PROBE_TOKENS:
            self.recent.append({"prompt_ids": turn["prompt_ids"], "messages": turn.get(
                "messages"), "tools": turn.get("tools"), "source": turn["uid"]})

    def published(self, version: int, weights: dict, good: dict) -> None:
        """The engine serves WEIGHTS as VERSION now; GOOD is the trainer's state with them."""
        self.served_version, self.served_weights = version, weights
        self.good, self.in_a_row, self.since = good, 0, 0

    def stepped(self) -> None:
        """One more optimizer step not evaluated yet."""
        self.since += 1

    @property
    def due(self) -> bool:
        return self.since >= self.t.eval_every

    def draw(self) -> list[dict]:
        distinct, seen = list(self.extra), set()
        for p in reversed(list(self.recent)):
            if tuple(p["prompt_ids"]) not in seen:
                seen.add(tuple(p["prompt_ids"]))
                distinct.append(p)
        distinct = distinct[:self.t.eval_probes]
        if not distinct:
            return []
        return [{**distinct[i % len(distinct)], "seed": SEED + i}
                for i in range(self.t.eval_probes)]

    def _sample_all(self, probes: list[dict]) -> list[tuple[list[int], mx.array]]:
        model, chunk = self.learner.model, self.t.train_chunk_tokens
        return [sample(model, p["prompt_ids"], self.t.eval_max_tokens, p["seed"], self.eos,
                       chunk, self.pace) for p in probes]

    def figures(self, probes: list[dict], samples: list[list[int]]) -> dict:
        replies = [[i for i in ids if i not in self.eos] for ids in samples]
        texts = [self.tokenizer.decode(ids) for ids in replies]
        rewards = [self.reward(p, ids, text) for p, ids, text in zip(probes, replies, texts)]
        rewards = [r for r in rewards if r is not None]
        return {"reward": sum(rewards) / len(rewards) if rewards else None,
                "rewarded": len(rewards), **degeneracy.figures(texts, replies),
                "example": texts[0][:200] if texts else None}

    def reward(self, probe: dict, ids: list[int], text: str) -> float | None:
        turn = {"uid": f"probe-{probe['seed'] - SEED}", "session_id": "rlproxy-eval",
                "index": 0, "turn_type": "main", "prompt_ids": probe["prompt_ids"],
                "messages": probe["messages"], "tools": probe["tools"], "next_state": None,
                "end": None, "chosen_choice": 0,
                "choices": [{"completion_ids": ids, "text": text, "tool_calls": []}]}
        for fn in self.functions:
            name = getattr(fn, "__name__", fn)
            try:
                value = call_with_timeout(call, (fn, turn, None, 0, takes_choice(fn)),
                                          self.timeout_s, "rlproxy-eval-reward")
            except Overran:  # left running on its own thread: it must not hold the trainer
                log.warning("eval reward function %s ran past %.0f s", name, self.timeout_s)
                continue
            except Exception:
                log.exception("eval reward function %s failed", name)
                continue
            if value is not None:
                return max(-1.0, min(1.0, float(value)))
        return None

    def evaluate(self) -> dict:
        """The candidate's figures, the served adapter's, and the verdict (`refused`: the
        reason, or None). The model holds the candidate again afterwards."""
        tic = time.perf_counter()
        self.pace.restart()
        candidate = self.learner.save_weights_for_sampler()
        base = {k: mx.zeros_like(v) if k.endswith("lora_b") else v for k, v in candidate.items()}
        model, chunk, use = self.learner.model, self.t.train_chunk_tokens, self.learner.set_weights
        try:
            if self._served is None or self._served[0] != self.served_version:
                probes = self.draw()
                use(self.served_weights)
                served = self.figures(probes, [ids for ids, _ in self._sample_all(probes)])
                self._served = (self.served_version, probes, served)
            _, probes, served = self._served
            samples, kl = [], {"kl_served": 0.0, "kl_base": 0.0}
            for p in probes:  # one probe's rows at a time: (L, V) each, not all of them
                use(candidate)
                (tokens, rows), = self._sample_all([p])
                samples.append(tokens)
                for name, weights in (("kl_served", self.served_weights), ("kl_base", base)):
                    use(weights)
                    kl[name] += kl_sum(rows, token_rows(model, p["prompt_ids"], tokens, chunk,
                                                        self.pace))
        finally:
            use(candidate)
        positions = max(1, sum(len(s) for s in samples))
        cand = {**self.figures(probes, samples),
                **{k: round(v / positions, 6) for k, v in kl.items()}}
        self.measured = candidate
        return {"probes": len(probes), "positions": positions, "candidate": cand,
                "served": served, "refused": refusal(cand, served, self.t) if probes else None,
                "eval_s": round(time.perf_counter() - tic, 3), **self.pace.units}

    def check(self, step: int, version: int) -> Verdict:
        """Evaluate candidate VERSION (trained up to STEP): publish it, or roll back."""
        self.measured = None
        try:
            result = self.evaluate()
        except LearnerUnavailable:  # a learner elsewhere is down: no verdict, tried again
            raise
        except Exception as e:  # never publish what could not be measured
            log.exception("the eval gate failed at step %d", step)
            result = {"error": f"{type(e).__name__}: {e}",
                      "refused": f"the evaluation failed: {type(e).__name__}: {e}"}
        line = {"kind": "eval", "step": step, "candidate_version": version,
                "served_version": self.served_version, "passed": result["refused"] is None,
                **result, "kl_on": "the candidate's probe samples", "time": time.time()}
        if line["passed"]:  # published: `published` makes this state the good one
            return Verdict(line, candidate=self.measured)
        self.in_a_row += 1
        self.since = 0
        return Verdict(line, good=self.good, lr_factor=self.t.rollback_lr_factor,
                       in_a_row=self.in_a_row, pause=self.in_a_row >= self.t.max_rollbacks)


def make_gate(settings: Settings, learner, pace: Pacer, version: int, good: dict,
              tokenizer=None) -> EvalGate:
    """The eval gate, with its reward functions and tokenizer (loaded from the model's
    directory when the caller has none at hand: config and tokenizer only)."""
    if tokenizer is None:
        import mlx_lm

        _, tokenizer = mlx_lm.load(resolve_model_path(settings.model)[0], lazy=True)
    names = settings.trainer.eval_reward_functions or settings.scoring.reward_functions
    return EvalGate(settings, learner, pace, tokenizer, load_reward_functions(names), version,
                    good)
