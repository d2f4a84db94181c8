"""Training examples (training/examples.py) as Tinker Datums, and the loss configuration that
makes the service's step equal the local learner's. Pure functions.

Tinker's losses are sums over every position of a datum, with no mask; the local learner's are
sums over trained positions divided by the batch's trained tokens N (training/losses.py). So:
  - a datum is ids[:-1] in, ids[1:] as `target_tokens`, the recorded behaviour log-probs as
    `logprobs` and advantage / N as `advantages` (0 at prompt positions, which then add nothing
    to the ratio losses); cross_entropy gets mask / N as its token `weights`;
  - DRO's penalty beta/2 (logp - old)^2 is not 0 at a prompt position, so DRO datums also carry
    the 0/1 mask as `weights` (an rlproxy learner applies it to every loss; a service that
    ignores it trains the prompt positions' penalty too);
  - the clip bounds are ratios (1 - eps_low, 1 + eps_high), and DRO's beta is divided by N too.
"""

from __future__ import annotations

import numpy as np


def to_datums(examples: list[dict], loss_fn: str):
    """EXAMPLES as Datums, normalised by their trained tokens (see the module's docstring)."""
    from tinker import types
    n = max(1, sum(e["tokens"] for e in examples))
    out = []
    for e in examples:
        ids = e["ids"]
        mask = np.asarray(e["mask"][: len(ids) - 1], dtype=np.float32)
        inputs = {"target_tokens": np.asarray(ids[1:], dtype=np.int64)}
        if loss_fn in ("cross_entropy", "dro"):
            inputs["weights"] = mask / n if loss_fn == "cross_entropy" else mask
        if loss_fn != "cross_entropy":
            inputs["logprobs"] = np.asarray(e["old"][: len(ids) - 1], dtype=np.float32)
            inputs["advantages"] = np.asarray(e["adv"][: len(ids) - 1], dtype=np.float32) * mask / n
        out.append(types.Datum(model_input=types.ModelInput.from_ints(list(ids[:-1])),
                               loss_fn_inputs=inputs))
    return out


def loss_config(t, n_tokens: int) -> dict:
    """The loss_fn_config for trainer settings T over a batch of N_TOKENS trained tokens."""
    if t.loss_fn in ("ppo", "cispo"):
        return {"clip_low_threshold": 1.0 - t.eps_low, "clip_high_threshold": 1.0 + t.eps_high}
    if t.loss_fn == "dro":
        return {"beta": t.dro_beta / max(1, n_tokens)}
    return {}
