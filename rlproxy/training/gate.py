"""The eval gate: a candidate adapter is served only if it is not worse than the served one.

With `eval_every` N > 0 the trainer publishes nothing between evaluations. Every N optimizer
steps, between batches, on the trainer thread, in units that yield to serving like a training
step's (each ends in mx.eval, then `trainer._between_units`), the candidate is measured:

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
  degeneracy the samples' figures of collapse (training/degeneracy.py: repeated 3-grams, empty replies,
             the share of whitespace characters, the share of distinct tokens), each compared
             with its limit and with the served adapter's figure on the same probes. On the
             samples, not on greedy replies: they cost no extra decode, and a collapse of the
             kind seen on the real model (entropy 1.10 -> 0.04) shows in them too; greedy
             replies would show one a little earlier.

Verdict (`refusal`): publish if reward >= served reward - eval_tolerance, both KLs < max_kl
(when set) and not degenerate. Otherwise the trainer rolls back to the last good state (the
state when the served adapter was published: adapter, optimizer, reward baseline and the
update count the LR schedule runs on), multiplies the learning rate by rollback_lr_factor and
writes a `rollback` line with the figures and the reason; max_rollbacks in a row pause
training, with the reason as the trainer's error (on /healthz). Every evaluation writes an
`eval` line to training.jsonl.

Not here: training, publishing, saving (training/trainer.py); the degeneracy figures (training/degeneracy.py);
the reward functions are the user's (scorer.load_reward_functions). Probes are decoded one at a
time, not batched.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_unflatten
from mlx_lm.models.cache import make_prompt_cache

from rlproxy.training import degeneracy
from rlproxy.serving.chat_template import render_prompt
from rlproxy.training.chunked_grad import chunk_bounds
from rlproxy.serving.engine import make_sampler
from rlproxy.serving.model import lora_weights, resolve_model_path
from rlproxy.scoring.rewards import call, load_reward_functions, takes_choice

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


def call_with_timeout(fn, args: tuple, timeout_s: float):
    """FN(*ARGS), or None when it raises or runs past TIMEOUT_S (it is left running on its own
    daemon thread: a hung user function must not hold the trainer)."""
    box: list = []

    def run():
        try:
            box.append(fn(*args))
        except Exception:
            log.exception("eval reward function %s failed", getattr(fn, "__name__", fn))

    thread = threading.Thread(target=run, name="rlproxy-eval-reward", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        log.warning("eval reward function %s ran past %.0f s", getattr(fn, "__name__", fn),
                    timeout_s)
    return box[0] if box else None


# ---- model work, in units ----

def _prefill(model, ids: list[int], chunk: int, unit):
    """A KV cache holding IDS, filled in units of at most CHUNK positions (fewer deep into a
    long prompt, as a training step's: chunked_grad.chunk_bounds)."""
    cache = make_prompt_cache(model)
    for a, b, _ in chunk_bounds([0.0] * len(ids), chunk):
        tic = time.perf_counter()
        model(mx.array(ids[a:b])[None], cache=cache)
        unit(tic, [c.state for c in cache])
    return cache


def sample(model, prompt: list[int], max_tokens: int, seed: int, eos, chunk: int, unit):
    """(tokens sampled at temperature 1, the end token included if reached; their (L, V)
    log-prob rows)."""
    cache = _prefill(model, prompt[:-1], chunk, unit)
    sampler = make_sampler(1.0, 1.0, seed)
    y, tokens, rows = prompt[-1], [], []
    for _ in range(max_tokens):
        tic = time.perf_counter()
        logits = model(mx.array([[y]]), cache=cache)[0, -1].astype(mx.float32)
        logp = logits - mx.logsumexp(logits)
        tok = sampler(logp)
        unit(tic, tok, logp)
        y = int(tok.item())
        tokens.append(y)
        rows.append(logp)
        if y in eos:
            break
    return tokens, mx.stack(rows)


def token_rows(model, prompt: list[int], tokens: list[int], chunk: int, unit) -> mx.array:
    """(L, V) log-probs of the next token at each position of TOKENS after PROMPT."""
    cache = _prefill(model, prompt[:-1], chunk, unit)
    tic = time.perf_counter()
    logits = model(mx.array([prompt[-1]] + tokens[:-1])[None], cache=cache)[0]
    logits = logits.astype(mx.float32)
    out = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    unit(tic, out)
    return out


def kl_sum(p_rows: mx.array, q_rows: mx.array) -> float:
    """Sum over positions of KL(p || q), each over the whole vocabulary."""
    return float((mx.exp(p_rows) * (p_rows - q_rows)).sum().item())


# ---- the gate ----

class EvalGate:
    """One per trainer; all its model work runs on the trainer thread."""

    def __init__(self, trainer, tokenizer, functions: list):
        self.trainer, self.t, self.tokenizer = trainer, trainer.t, tokenizer
        self.functions = functions
        self.timeout_s = trainer.settings.scoring.reward_timeout_s
        self.eos = set(tokenizer.eos_token_ids)
        self.extra = load_eval_prompts(self.t.eval_prompts, tokenizer)
        self.recent: deque = deque(maxlen=RECENT_PROMPTS)  # appended from any thread
        self.since = 0  # optimizer steps since the last evaluation or rollback
        self.in_a_row = 0  # rollbacks since the last publish
        self.served_version = trainer.version
        self.served_weights = lora_weights(trainer.model)
        self.good = trainer.snapshot()  # what a rollback restores
        self._served: tuple[int, list[dict], dict] | None = None  # version, probes, figures

    def observe(self, turn: dict) -> None:
        """A recorded main turn given to the trainer: its prompt may become a probe."""
        if len(turn["prompt_ids"]) <= MAX_PROBE_TOKENS:
            self.recent.append({"prompt_ids": turn["prompt_ids"], "messages": turn.get(
                "messages"), "tools": turn.get("tools"), "source": turn["uid"]})

    def published(self, version: int, weights: dict) -> None:
        self.served_version, self.served_weights = version, weights
        self.good, self.in_a_row = self.trainer.snapshot(), 0
        self.stepped(reset=True)

    def stepped(self, reset: bool = False) -> None:
        """One more optimizer step not evaluated yet (RESET: none left)."""
        self.since = 0 if reset else self.since + 1
        self.trainer.stats["unevaluated_steps"] = self.since

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

    def _unit(self, tic: float, *arrays) -> None:
        mx.eval(*arrays)
        self.trainer._between_units(time.perf_counter() - tic)

    def _use(self, weights: dict) -> None:
        self.trainer.model.update(tree_unflatten(list(weights.items())))

    def _sample_all(self, probes: list[dict]) -> list[tuple[list[int], mx.array]]:
        model, chunk = self.trainer.model, self.t.train_chunk_tokens
        return [sample(model, p["prompt_ids"], self.t.eval_max_tokens, p["seed"], self.eos,
                       chunk, self._unit) for p in probes]

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
            value = call_with_timeout(call, (fn, turn, None, 0, takes_choice(fn)), self.timeout_s)
            if value is not None:
                return max(-1.0, min(1.0, float(value)))
        return None

    def evaluate(self) -> dict:
        """The candidate's figures, the served adapter's, and the verdict (`refused`: the
        reason, or None). The model holds the candidate again afterwards."""
        tr = self.trainer
        tic = time.perf_counter()
        tr.units = {"units": 0, "max_unit_s": 0.0, "yielded_s": 0.0}
        candidate = lora_weights(tr.model)
        base = {k: mx.zeros_like(v) if k.endswith("lora_b") else v for k, v in candidate.items()}
        chunk = self.t.train_chunk_tokens
        try:
            if self._served is None or self._served[0] != self.served_version:
                probes = self.draw()
                self._use(self.served_weights)
                served = self.figures(probes, [ids for ids, _ in self._sample_all(probes)])
                self._served = (self.served_version, probes, served)
            _, probes, served = self._served
            samples, kl = [], {"kl_served": 0.0, "kl_base": 0.0}
            for p in probes:  # one probe's rows at a time: (L, V) each, not all of them
                self._use(candidate)
                (tokens, rows), = self._sample_all([p])
                samples.append(tokens)
                for name, weights in (("kl_served", self.served_weights), ("kl_base", base)):
                    self._use(weights)
                    kl[name] += kl_sum(rows, token_rows(tr.model, p["prompt_ids"], tokens,
                                                        chunk, self._unit))
        finally:
            self._use(candidate)
        positions = max(1, sum(len(s) for s in samples))
        cand = {**self.figures(probes, samples),
                **{k: round(v / positions, 6) for k, v in kl.items()}}
        return {"probes": len(probes), "positions": positions, "candidate": cand,
                "served": served, "refused": refusal(cand, served, self.t) if probes else None,
                "eval_s": round(time.perf_counter() - tic, 3), **tr.units}

    # ---- the verdict's consequences ----

    def check(self) -> dict:
        """Evaluate the candidate; publish it, or roll back. Its `eval` line."""
        tr = self.trainer
        try:
            result = self.evaluate()
        except Exception as e:  # never publish what could not be measured
            log.exception("the eval gate failed at step %d", tr.step)
            result = {"error": f"{type(e).__name__}: {e}",
                      "refused": f"the evaluation failed: {type(e).__name__}: {e}"}
        tr.stats["evals"] += 1
        line = {"kind": "eval", "step": tr.step, "candidate_version": tr.version,
                "served_version": self.served_version, "passed": result["refused"] is None,
                **result, "kl_on": "the candidate's probe samples", "time": time.time()}
        tr.writer.write(line)
        if line["passed"]:
            tr.publish()  # calls published(): this state is now the good one
            self.good_path = tr.try_save()
            log.info("eval gate: adapter v%d published (probe reward %s)", tr.version,
                     line["candidate"]["reward"])
        else:
            self.roll_back(line)
        return line

    good_path: Path | None = None  # the checkpoint of the good state, when one was saved

    def roll_back(self, evaluation: dict) -> dict:
        """Restore the good state, lower the learning rate, write the `rollback` line; pause
        training after max_rollbacks in a row. Nothing is published: the served adapter is
        the good one already."""
        tr, good, reason = self.trainer, self.good, evaluation["refused"]
        rejected = tr.version
        tr.load_state(good["adapter"], good["optimizer"], good["baseline"])
        tr.lr_scale *= self.t.rollback_lr_factor
        tr.step += 1  # a step number of its own, as an operator's rollback
        self.in_a_row += 1
        self.stepped(reset=True)
        tr.stats["gate_rollbacks"] += 1
        tr.stats["steps"] = tr.step
        line = {"kind": "rollback", "gate": True, "step": tr.step,
                "adapter_version": self.served_version, "rejected_version": rejected,
                "checkpoint": str(self.good_path) if self.good_path else None,
                "checkpoint_step": good["step"], "checkpoint_adapter_version": self.served_version,
                "reason": reason, "candidate": evaluation.get("candidate"),
                "served": evaluation.get("served"), "lr_scale": tr.lr_scale,
                "next_learning_rate": tr.learning_rate(), "in_a_row": self.in_a_row,
                "training": True, "time": time.time()}
        tr.writer.write(line)
        log.info("eval gate: candidate v%d refused (%s); rolled back to step %d's adapter "
                    "v%d, learning rate x%g", rejected, reason, good["step"],
                    self.served_version, tr.lr_scale)
        # saved: a restart neither trains the refused steps' turns again nor forgets the rate
        tr.try_save(protect=self.good_path)
        if self.in_a_row >= self.t.max_rollbacks:
            tr.paused = True
            tr.error = (f"training paused: {self.in_a_row} rollbacks in a row by the eval gate; "
                        f"the last: {reason}. Resume training (POST /v1/training/resume) to "
                        f"go on at {tr.lr_scale:g} x the learning rate")
            tr.writer.write({"kind": "pause", "step": tr.step, "reason": tr.error,
                             "time": time.time()})
            log.error(tr.error)
        return line


def make_gate(trainer, tokenizer=None) -> EvalGate:
    """The eval gate for TRAINER, with its reward functions and tokenizer (loaded from the
    model's directory when the caller has none at hand: config and tokenizer only)."""
    if tokenizer is None:
        import mlx_lm

        _, tokenizer = mlx_lm.load(resolve_model_path(trainer.settings.model)[0], lazy=True)
    names = trainer.t.eval_reward_functions or trainer.settings.scoring.reward_functions
    return EvalGate(trainer, tokenizer, load_reward_functions(names))
