"""Degeneracy: whether a set of replies shows a policy collapsing, as pure figures and a verdict.

The eval gate (training/gate.py) computes `figures` over the probe replies of the candidate adapter
and of the served one (the same probes, the same seeds) and refuses a candidate that
`degenerate` names. On SmolLM2-135M-Instruct a learning rate of 2e-4 collapsed the replies to
whitespace within ~8 steps; other collapses end in one token or a few, repeated. Each figure is
pooled over the replies (the end token left out):

  repeat_rate     share of the token 3-grams that already occurred earlier in the same reply
                  (a loop of any period shorter than the reply)
  empty_rate      share of replies with no character but whitespace (an end token first: '')
  blank_share     share of the replies' characters that are whitespace (a collapse to newlines
                  and spaces that still lets a word through now and then)
  distinct_share  the replies' distinct tokens (counted per reply) over their tokens (a collapse
                  onto a few tokens drawn in any order, which repeat_rate can miss)

A candidate is degenerate on a figure past its limit (LIMITS) and worse than the served
adapter's on the same probes: a served adapter that already writes so is not held against the
candidate. Normal replies of the real model (12 of 32 tokens at temperature 1, to 6 prompts,
code among them) measured repeat 0 to 0.1, blank 0.11 to 0.19, distinct 0.66 to 1.0.

Not here: sampling the replies, the reward and KL checks, rolling back (training/gate.py).
"""

from __future__ import annotations

REPEAT_N = 3
# figure -> (limit, +1: degenerate above it, -1: below it)
LIMITS = {"repeat_rate": (0.5, 1), "empty_rate": (0.5, 1), "blank_share": (0.5, 1),
          "distinct_share": (0.3, -1)}


def repeat_rate(replies: list[list[int]], n: int = REPEAT_N) -> float:
    """Share of the replies' n-grams that already occurred earlier in the same reply."""
    seen_total = repeats = 0
    for ids in replies:
        seen = set()
        for i in range(len(ids) - n + 1):
            gram = tuple(ids[i:i + n])
            repeats += gram in seen
            seen.add(gram)
            seen_total += 1
    return repeats / seen_total if seen_total else 0.0


def empty_rate(texts: list[str]) -> float:
    """Share of replies with nothing but whitespace (an end token first gives '')."""
    return sum(not t.strip() for t in texts) / len(texts) if texts else 0.0


def blank_share(texts: list[str]) -> float:
    """Share of all the replies' characters that are whitespace (0 with no character)."""
    chars = sum(len(t) for t in texts)
    return sum(c.isspace() for t in texts for c in t) / chars if chars else 0.0


def distinct_share(replies: list[list[int]]) -> float:
    """Sum over replies of their distinct tokens, over their tokens (1 with no token)."""
    tokens = sum(len(ids) for ids in replies)
    return sum(len(set(ids)) for ids in replies) / tokens if tokens else 1.0


def figures(texts: list[str], replies: list[list[int]]) -> dict:
    """Every figure of LIMITS over one set of replies (TEXTS: REPLIES decoded)."""
    return {"repeat_rate": round(repeat_rate(replies), 4),
            "empty_rate": round(empty_rate(texts), 4),
            "blank_share": round(blank_share(texts), 4),
            "distinct_share": round(distinct_share(replies), 4)}


def degenerate(cand: dict, served: dict) -> list[str]:
    """The reasons the candidate's figures (CAND) are degenerate next to the served adapter's
    (SERVED) on the same probes; [] when they are not."""
    reasons = []
    for name, (limit, sign) in LIMITS.items():
        if sign * cand[name] > sign * limit and sign * cand[name] > sign * served[name]:
            reasons.append(f"degenerate: {name.replace('_', ' ')} {cand[name]:.2f} "
                           f"{'>' if sign > 0 else '<'} {limit} (served: {served[name]:.2f})")
    return reasons
