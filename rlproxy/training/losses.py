"""Policy losses over completion tokens: pure functions of arrays, nothing else.

Every loss takes, per token (shape (T,) or (B, T)):
  logp   log-prob of the sampled token under the policy being trained (temperature 1)
  old    the recorded behaviour log-prob (the same temperature-1 quantity, from the engine)
  adv    the advantage A_t
  mask   1 for completion tokens to train on, 0 for prompt and padding
and returns the *sum* over masked tokens. The trainer divides by the number of completion tokens
in the whole optimizer batch (the normaliser N = sum of masks over the batch), so a long
completion weighs as many tokens as it has, and splitting a batch into micro-batches does not
change the gradient. With rho = exp(logp - old):

  importance_sampling  -sum rho * A
  ppo                  -sum min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)
  cispo                -sum sg(clip(rho, 1 - eps_low, 1 + eps_high)) * A * logp
                       (MiniMax-M1: the clipped weight carries no gradient, every token keeps
                       its logp gradient)
  dro                  -sum (logp * A - beta / 2 * (logp - old)^2)
  cross_entropy        -sum logp            (plain SFT on the completion; A is ignored)
Off-policy turns (`--off-policy decoupled`, the default, for ppo and cispo; decoupled PPO,
Hilton et al. 2021, as AReaL uses it for asynchronous RL): a turn sampled by an adapter some
versions behind the one being trained has rho far from 1, and ppo's clip then drops its signal.
Decoupled, the clip is taken against the proximal policy `prox` (the weights at the start of the
step, no gradient) and the turn is weighted by the truncated behaviour weight
w = min(exp(prox - old), cap):
  ppo (decoupled)      -sum w * min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A),  r = exp(logp - prox)
  cispo (decoupled)    -sum w * sg(clip(r, ...)) * A * logp
With one optimizer step per batch prox is logp itself (r = 1 with the gradient of logp), so the
step is w * A * grad(logp): on-policy (w = 1) the same step as coupled ppo.
  kl (penalty, added)  coef * sum (exp(ref - logp) - (ref - logp) - 1)   (k3 estimator, >= 0)
  entropy (bonus, subtracted)  coef * sum_t H_t,  H_t = -sum_v p_t(v) log p_t(v)
                       (p_t = softmax of the policy's logits at position t, temperature 1: the
                       full distribution, not only the sampled token; it pushes against the
                       collapse of the output onto a few tokens)

Not here: the log-probs themselves (serving/logprobs.py), the gradient (training/chunked_grad.py).
"""

from __future__ import annotations

import mlx.core as mx

from rlproxy.serving.logprobs import log_softmax
from rlproxy.settings import LOSSES  # the names, where the CLI reads them without MLX


def ratio(logp: mx.array, old: mx.array, mask: mx.array) -> mx.array:
    # Masked positions get rho = 1, so a huge logp - old there can never make inf * 0 = NaN.
    return mx.exp(mx.where(mask > 0, logp - old, 0.0))


def importance_sampling(logp, old, adv, mask, **_):
    return -(ratio(logp, old, mask) * adv * mask).sum()


def ppo(logp, old, adv, mask, eps_low: float = 0.2, eps_high: float = 0.28, **_):
    rho = ratio(logp, old, mask)
    clipped = mx.clip(rho, 1 - eps_low, 1 + eps_high)
    return -(mx.minimum(rho * adv, clipped * adv) * mask).sum()


def cispo(logp, old, adv, mask, eps_low: float = 0.2, eps_high: float = 0.28, **_):
    weight = mx.stop_gradient(mx.clip(ratio(logp, old, mask), 1 - eps_low, 1 + eps_high))
    return -(weight * adv * logp * mask).sum()


def dro(logp, old, adv, mask, beta: float = 0.1, **_):
    return -((logp * adv - 0.5 * beta * (logp - old) ** 2) * mask).sum()


def cross_entropy(logp, old, adv, mask, **_):
    return -(logp * mask).sum()


def kl_penalty(logp, ref, mask) -> mx.array:
    """Summed k3 estimate of KL(policy || reference); unbiased and never negative."""
    d = ref - logp
    return ((mx.exp(d) - d - 1) * mask).sum()


def entropy(logits: mx.array, mask: mx.array) -> mx.array:
    """Summed entropy of the policy at masked positions. logits: (B, T, V), mask: (B, T)."""
    logp = log_softmax(logits)
    return (-(mx.exp(logp) * logp).sum(axis=-1) * mask).sum()


def behaviour_weight(prox, old, mask, cap: float) -> mx.array:
    """min(pi_prox / pi_behaviour, cap) per token, no gradient; 1 at masked positions."""
    return mx.stop_gradient(mx.minimum(ratio(prox, old, mask), cap))


def decoupled_ppo(logp, old, adv, mask, eps_low: float = 0.2, eps_high: float = 0.28,
                  weight_cap: float = 5.0, prox=None, **_):
    prox = mx.stop_gradient(logp) if prox is None else prox  # one step per batch: prox = logp
    w = behaviour_weight(prox, old, mask, weight_cap)  # w >= 0: min(w r A, w c A) = w min(..)
    return ppo(logp, prox, w * adv, mask, eps_low, eps_high)


def decoupled_cispo(logp, old, adv, mask, eps_low: float = 0.2, eps_high: float = 0.28,
                    weight_cap: float = 5.0, prox=None, **_):
    prox = mx.stop_gradient(logp) if prox is None else prox
    w = behaviour_weight(prox, old, mask, weight_cap)
    return cispo(logp, prox, w * adv, mask, eps_low, eps_high)


def trainer_loss(name: str, off_policy: str):
    """The local trainer's loss: NAME, decoupled from the behaviour policy where it clips."""
    if off_policy == "decoupled" and name in DECOUPLED:
        return {"ppo": decoupled_ppo, "cispo": decoupled_cispo}[name]
    return policy_loss(name)


DECOUPLED = ("ppo", "cispo")  # the losses that clip a ratio; the others are unchanged


def policy_loss(name: str):
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; choose one of {', '.join(LOSSES)}")
    return {"ppo": ppo, "importance_sampling": importance_sampling, "cispo": cispo,
            "dro": dro, "cross_entropy": cross_entropy}[name]
