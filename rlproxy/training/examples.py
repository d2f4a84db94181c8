"""Training examples: one choice of a turn as the lists the gradient code takes, sessions packed
into one pass, and whether a batch of them can teach the policy anything. Pure functions.

An example is {"ids": prompt + completion token ids, "old": behaviour log-probs, "adv":
advantages, "mask": 1 at trained positions, per position t (which predicts ids[t + 1]); "uids":
the items' keys, "rewards", "tokens": trained positions}.

Not here: the items they come from (training/items.py), the gradient (training/chunked_grad.py),
which items are skipped and the running-mean baseline (training/loop.py).
"""

from __future__ import annotations

from rlproxy.settings import TrainerSettings

ZERO_ADVANTAGE = 1e-6  # |A_t| at most this is rounding, not signal (float32 log-probs)


def turn_example(turn: dict, advantages: list[float], reward, choice: int | None = None,
                 key: str | None = None, version: int | None = None) -> dict | None:
    """One choice of a turn (default: the one the conversation continued from) as a training
    example over ids = prompt + completion: position t predicts ids[t + 1], so the completion's
    targets start at len(prompt) - 1. Its `uids` hold KEY (default: the turn's uid), and its
    `staleness` how many adapter versions the oldest one that sampled it is behind VERSION, the
    one it trains (None: unknown). None without completion."""
    picked = turn["choices"][turn.get("chosen_choice", 0) if choice is None else choice]
    prompt, completion = turn["prompt_ids"], picked["completion_ids"]
    if not completion:
        return None
    pad = [0.0] * (len(prompt) - 1)
    return {"ids": prompt + completion, "old": pad + list(picked["logprobs"]),
            "adv": pad + list(advantages), "mask": pad + [1.0] * len(completion),
            "uids": [key or turn["uid"]], "rewards": [reward], "tokens": len(completion),
            "staleness": [staleness(picked, version)]}


def staleness(choice: dict, version: int | None) -> int | None:
    """Adapter versions from the oldest that sampled CHOICE to VERSION (0: on-policy)."""
    sampled = choice.get("adapter_versions")
    if version is None or not sampled:
        return None
    return max(0, version - min(sampled))


def pack(examples: list[dict]) -> list[dict]:
    """Session packing: an example whose ids are a token prefix of a longer one's (turn k's
    prompt + completion opening turn k + 1's prompt) is trained inside it, with its own
    positions' mask, old log-probs and advantages. Exact: causal attention makes the
    log-probs at those positions the same, and the losses are sums over positions."""
    out: list[dict] = []
    for ex in sorted(examples, key=lambda e: len(e["ids"]), reverse=True):
        n, lo = len(ex["ids"]), ex["mask"].index(1.0)
        host = next((h for h in out if h["ids"][:n] == ex["ids"]
                     and not any(h["mask"][lo:n - 1])), None)
        if host is None:
            out.append({**ex, "old": list(ex["old"]), "adv": list(ex["adv"]),
                        "mask": list(ex["mask"]), "uids": list(ex["uids"]),
                        "rewards": list(ex["rewards"]), "staleness": list(ex["staleness"])})
            continue
        for key in ("old", "adv", "mask"):
            host[key][lo:n - 1] = ex[key][lo:]
        host["uids"] += ex["uids"]
        host["rewards"] += ex["rewards"]
        host["staleness"] += ex["staleness"]
        host["tokens"] += ex["tokens"]
    return out


def no_signal(examples: list[dict], t: TrainerSettings) -> str | None:
    """Why a batch of EXAMPLES cannot teach the policy anything under trainer settings T, or
    None. Every trained token's advantage |A_t| <= ZERO_ADVANTAGE makes the policy gradient
    exactly 0 (checked per token: an OPD term keeps a group of equal rewards in training), and
    AdamW would still move the adapter on its momentum. DRO's penalty only holds the policy near
    the behaviour one: no reason to step either. A KL penalty or entropy bonus (kl_coef,
    entropy_coef > 0) is a term of its own, and cross_entropy ignores advantages: those batches
    always step."""
    if t.loss_fn == "cross_entropy" or t.kl_coef > 0 or t.entropy_coef > 0:
        return None
    trained = [a for e in examples for a, m in zip(e["adv"], e["mask"]) if m > 0]
    if any(abs(a) > ZERO_ADVANTAGE for a in trained):
        return None
    return (f"every advantage of its {sum(len(e['uids']) for e in examples)} turns is 0 (equal "
            "rewards, no teacher signal): no optimizer step, no new adapter version")


def shards(items: list, ranks: int, size) -> list[list]:
    """ITEMS in RANKS shards of about equal SIZE(item) (tokens): longest first, each to the
    lightest shard (the lowest rank on a tie), keeping the items' order within a shard. A
    packed session is one item, so it stays on one rank (training/distributed.py)."""
    load, owner = [0] * ranks, {}
    for i in sorted(range(len(items)), key=lambda i: -size(items[i])):
        r = min(range(ranks), key=lambda r: load[r])
        owner[i] = r
        load[r] += size(items[i])
    return [[x for i, x in enumerate(items) if owner[i] == r] for r in range(ranks)]
