"""The policy losses against numbers worked out by hand with `math`, token by token.

Each expected value is written from the formula in rlproxy/training/losses.py's docstring, never by calling
the loss (or an array copy of it). Gradients are taken with mx.grad w.r.t. logp."""

from __future__ import annotations

import math

import rlproxy  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
import pytest

from rlproxy.serving.logprobs import token_logprobs
from rlproxy.training import losses

TOL = 1e-5
POLICY_LOSSES = [losses.ppo, losses.importance_sampling, losses.cispo, losses.dro,
                 losses.cross_entropy]


def arr(xs) -> mx.array:
    return mx.array(xs, dtype=mx.float32)


def value_and_grad(fn, logp, old, adv, mask, **kw):
    """(loss, d loss / d logp as a list) for one loss call."""
    f = lambda lp: fn(lp, old, adv, mask, **kw)  # noqa: E731
    return f(logp).item(), mx.grad(f)(logp).tolist()


def approx(xs):
    return pytest.approx(xs, abs=TOL)


def tokens(rhos, olds):
    """logp such that exp(logp - old) is exactly the wanted ratio (up to float32)."""
    return [o + math.log(r) for r, o in zip(rhos, olds)]


# ---- ppo ----

# One token per case, defaults eps_low=0.2, eps_high=0.28 (clip range [0.8, 1.28]):
#   rho   A    rho*A   clip*A   min     clipped?
#   1.5  +2    3.0     2.56     2.56    yes: too far up on a good token
#   0.5  -1   -0.5    -0.8     -0.8     yes: too far down on a bad token
#   1.5  -1   -1.5    -1.28    -1.5     no: min keeps the more pessimistic unclipped term
#   0.5  +2    1.0     1.6      1.0     no
#   1.1  +1    1.1     1.1      1.1     no: inside the range
PPO_RHO = [1.5, 0.5, 1.5, 0.5, 1.1]
PPO_ADV = [2.0, -1.0, -1.0, 2.0, 1.0]
PPO_OLD = [-0.7, -2.0, -0.3, -1.2, -0.5]


def test_ppo_clips_on_both_sides_with_default_eps():
    logp = arr(tokens(PPO_RHO, PPO_OLD))
    loss, grad = value_and_grad(losses.ppo, logp, arr(PPO_OLD), arr(PPO_ADV), arr([1.0] * 5))
    assert loss == pytest.approx(-(2.56 - 0.8 - 1.5 + 1.0 + 1.1), abs=TOL)
    # Clipped tokens get no gradient; unclipped ones get d(-rho*A)/dlogp = -rho*A.
    assert grad == approx([0.0, 0.0, 1.5, -1.0, -1.1])


def test_ppo_eps_are_parameters():
    # eps_low=eps_high=0.1: range [0.9, 1.1]. Token 1 clips at 1.1*2, token 2 at 0.9*-1,
    # token 5 (rho 1.1) sits on the edge: both terms equal 1.1.
    logp = arr(tokens(PPO_RHO, PPO_OLD))
    loss = losses.ppo(logp, arr(PPO_OLD), arr(PPO_ADV), arr([1.0] * 5),
                      eps_low=0.1, eps_high=0.1).item()
    assert loss == pytest.approx(-(2.2 - 0.9 - 1.5 + 1.0 + 1.1), abs=TOL)


def test_ppo_on_policy_is_minus_sum_of_advantages():
    # rho = 1 everywhere: no clipping, loss = -sum A, gradient = -A.
    lp = arr([-0.5, -1.5, -3.0])
    loss, grad = value_and_grad(losses.ppo, lp, lp, arr([0.5, -2.0, 1.0]), arr([1.0] * 3))
    assert loss == pytest.approx(0.5, abs=TOL)
    assert grad == approx([-0.5, 2.0, -1.0])


# ---- importance sampling ----


def test_importance_sampling_value_and_gradient():
    rho, adv, old = [1.5, 0.5, 2.0], [1.0, -3.0, 0.25], [-1.0, -0.2, -2.5]
    logp = arr(tokens(rho, old))
    loss, grad = value_and_grad(losses.importance_sampling, logp, arr(old), arr(adv),
                                arr([1.0] * 3))
    assert loss == pytest.approx(-(1.5 * 1.0 + 0.5 * -3.0 + 2.0 * 0.25), abs=TOL)
    assert grad == approx([-1.5, 1.5, -0.5])  # -rho * A, no clipping


# ---- cispo ----


def test_cispo_value_and_stop_gradient_weight():
    # Defaults clip rho to [0.8, 1.28]; weights 1.28, 0.8, 1.0 for rho 1.5, 0.5, 1.0.
    rho, adv, old = [1.5, 0.5, 1.0], [2.0, -1.0, 0.5], [-0.7, -2.0, -1.4]
    logp_py = tokens(rho, old)
    loss, grad = value_and_grad(losses.cispo, arr(logp_py), arr(old), arr(adv), arr([1.0] * 3))
    w = [1.28, 0.8, 1.0]
    assert loss == pytest.approx(-sum(wi * a * lp for wi, a, lp in zip(w, adv, logp_py)),
                                 abs=TOL)
    # The weight carries no gradient: d/dlogp = -clip(rho) * A, not -(clip(rho)*(1+logp))*A.
    assert grad == approx([-1.28 * 2.0, 0.8, -0.5])


def test_clipped_token_keeps_its_gradient_in_cispo_but_not_in_ppo():
    # rho = 1.5 > 1.28 with A > 0: ppo drops the token, cispo still pushes it at weight 1.28.
    old, adv, mask = arr([-1.0]), arr([2.0]), arr([1.0])
    logp = arr([-1.0 + math.log(1.5)])
    _, g_ppo = value_and_grad(losses.ppo, logp, old, adv, mask)
    _, g_cispo = value_and_grad(losses.cispo, logp, old, adv, mask)
    assert g_ppo == [0.0]
    assert g_cispo == approx([-2.56])


# ---- decoupled (off-policy) ----

# The PPO cases above, read as turns sampled by an older adapter: the weights at the step's
# start (prox = logp) are rho away from the behaviour policy. The ratio the clip sees is
# exp(logp - prox) = 1, so no token is clipped; each is weighted by w = min(rho, cap).

def test_decoupled_ppo_keeps_the_stale_tokens_that_coupled_ppo_clips():
    logp = arr(tokens(PPO_RHO, PPO_OLD))
    loss, grad = value_and_grad(losses.decoupled_ppo, logp, arr(PPO_OLD), arr(PPO_ADV),
                                arr([1.0] * 5), weight_cap=2.0)
    w = [min(r, 2.0) for r in PPO_RHO]
    assert loss == pytest.approx(-sum(wi * a for wi, a in zip(w, PPO_ADV)), abs=TOL)
    assert grad == approx([-wi * a for wi, a in zip(w, PPO_ADV)])  # d(-w r A)/dlogp at r = 1
    _, coupled = value_and_grad(losses.ppo, logp, arr(PPO_OLD), arr(PPO_ADV), arr([1.0] * 5))
    assert coupled[0] == 0.0 and coupled[1] == 0.0  # what coupled ppo threw away


def test_decoupled_weight_is_truncated_at_the_cap():
    old, adv, mask = arr([-3.0, -1.0]), arr([1.0, 1.0]), arr([1.0, 1.0])
    logp = arr([-3.0 + math.log(10.0), -1.0 + math.log(0.1)])  # w = 10 -> cap, 0.1
    _, grad = value_and_grad(losses.decoupled_ppo, logp, old, adv, mask, weight_cap=1.5)
    assert grad == approx([-1.5, -0.1])


def test_decoupled_on_policy_is_coupled_ppo():
    # behaviour = the step's weights (on-policy): the same loss value and gradient as ppo.
    lp = arr([-0.4, -2.2, -1.1])
    adv, mask = arr([0.5, -2.0, 1.0]), arr([1.0, 1.0, 0.0])
    for coupled, decoupled in ((losses.ppo, losses.decoupled_ppo),
                               (losses.cispo, losses.decoupled_cispo)):
        a = value_and_grad(coupled, lp, lp, adv, mask)
        b = value_and_grad(decoupled, lp, lp, adv, mask)
        assert a[0] == pytest.approx(b[0], abs=TOL) and b[1] == approx(a[1])


def test_decoupled_with_a_fixed_proximal_clips_against_it():
    # a later epoch: prox is the first epoch's log-probs, logp has moved 1.5x above it on a
    # good token: clipped (no gradient) whatever the behaviour weight.
    old, adv, mask = arr([-2.0]), arr([2.0]), arr([1.0])
    prox = arr([-1.0])
    logp = arr([-1.0 + math.log(1.5)])
    _, grad = value_and_grad(losses.decoupled_ppo, logp, old, adv, mask, prox=prox)
    assert grad == [0.0]
    _, grad = value_and_grad(losses.decoupled_ppo, arr([-1.0 + math.log(1.1)]), old, adv,
                             mask, prox=prox, weight_cap=2.0)
    assert grad == approx([-2.0 * 1.1 * 2.0])  # w = min(e^1, 2) = 2, r = 1.1, A = 2


def test_the_trainer_loss_is_decoupled_only_where_a_ratio_is_clipped():
    assert losses.trainer_loss("ppo", "decoupled") is losses.decoupled_ppo
    assert losses.trainer_loss("cispo", "decoupled") is losses.decoupled_cispo
    assert losses.trainer_loss("ppo", "coupled") is losses.ppo
    assert losses.trainer_loss("dro", "decoupled") is losses.dro


# ---- dro ----


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dro_value_and_gradient(beta):
    logp_py, old, adv = [-0.5, -2.0, -1.0], [-1.5, -1.0, -1.0], [1.0, -2.0, 3.0]
    kw = {} if beta == 0.1 else {"beta": beta}  # 0.1 is the default
    loss, grad = value_and_grad(losses.dro, arr(logp_py), arr(old), arr(adv), arr([1.0] * 3),
                                **kw)
    # per token: logp*A - beta/2 * (logp-old)^2, with logp-old = 1, -1, 0
    expected = -((-0.5 * 1.0 - beta / 2 * 1.0) + (-2.0 * -2.0 - beta / 2 * 1.0) + (-1.0 * 3.0))
    assert loss == pytest.approx(expected, abs=TOL)
    # d/dlogp = -(A - beta * (logp - old))
    assert grad == approx([-(1.0 - beta), -(-2.0 + beta), -3.0])


# ---- cross entropy ----


def test_cross_entropy_is_minus_sum_of_masked_logp_and_ignores_advantages():
    logp = arr([-0.5, -2.0, -1.25, -4.0])
    mask = arr([0.0, 1.0, 1.0, 1.0])
    loss, grad = value_and_grad(losses.cross_entropy, logp, arr([0.0] * 4),
                                arr([1.0, 2.0, -3.0, 0.0]), mask)
    assert loss == pytest.approx(2.0 + 1.25 + 4.0, abs=TOL)
    assert grad == [0.0, -1.0, -1.0, -1.0]
    other, _ = value_and_grad(losses.cross_entropy, logp, arr([-9.0, 3.0, 1.0, -1.0]),
                              arr([-5.0, 0.0, 7.0, -1.0]), mask)
    assert other == pytest.approx(loss, abs=TOL)


# ---- kl penalty ----


def test_kl_penalty_is_k3_and_its_gradient():
    logp_py, ref = [-1.0, -0.5, -2.0, -3.0], [-1.5, -0.5, -1.0, 5.0]
    mask = [1.0, 1.0, 1.0, 0.0]
    f = lambda lp: losses.kl_penalty(lp, arr(ref), arr(mask))  # noqa: E731
    d = [r - lp for r, lp in zip(ref, logp_py)]  # -0.5, 0, 1 (and 8, masked)
    expected = sum((math.exp(di) - di - 1) * m for di, m in zip(d, mask))
    assert f(arr(logp_py)).item() == pytest.approx(expected, abs=TOL)
    # d/dlogp (exp(ref - logp) - (ref - logp) - 1) = 1 - exp(ref - logp)
    assert mx.grad(f)(arr(logp_py)).tolist() == approx(
        [1 - math.exp(-0.5), 0.0, 1 - math.e, 0.0])


def test_kl_penalty_is_zero_at_the_reference_and_positive_away_from_it():
    logp = arr([-0.3, -1.7, -4.0])
    mask = arr([1.0, 1.0, 1.0])
    assert losses.kl_penalty(logp, logp, mask).item() == 0.0
    for shift in (-0.5, -1e-2, 1e-2, 0.5):
        one = losses.kl_penalty(arr([-1.0]), arr([-1.0 + shift]), arr([1.0])).item()
        assert one == pytest.approx(math.exp(shift) - shift - 1, abs=TOL)
        assert one > 0


# ---- entropy bonus ----

# Two positions over a vocabulary of 3 (one sequence), worked out by hand:
#   logits (0, 0, 0)            p = (1/3, 1/3, 1/3)    H = ln 3                      = 1.0986123
#   logits (0, ln 2, 0)         p = (1/4, 1/2, 1/4)    H = 2 * 1/4 ln 4 + 1/2 ln 2   = 1.0397208
# dH/dlogit_i = -p_i (log p_i + H): at the second position
#   (-1/4 (ln 1/4 + H), -1/2 (ln 1/2 + H), -1/4 (ln 1/4 + H)) = (0.0866434, -0.1732868, 0.0866434)
ENT_LOGITS = [[[0.0, 0.0, 0.0], [0.0, math.log(2.0), 0.0]]]


def test_entropy_is_the_masked_sum_of_the_per_position_entropy():
    logits = arr(ENT_LOGITS)
    assert losses.entropy(logits, arr([[1.0, 1.0]])).item() == pytest.approx(
        1.0986123 + 1.0397208, abs=TOL)
    assert losses.entropy(logits, arr([[1.0, 0.0]])).item() == pytest.approx(1.0986123, abs=TOL)
    # shifting a position's logits changes nothing; sharpening it lowers the entropy
    assert losses.entropy(logits + 5.0, arr([[1.0, 1.0]])).item() == pytest.approx(
        1.0986123 + 1.0397208, abs=TOL)
    assert losses.entropy(3 * logits, arr([[0.0, 1.0]])).item() < 1.0397208


def test_entropy_gradient_by_hand_and_the_bonus_flattens():
    grad = mx.grad(lambda lg: losses.entropy(lg, arr([[0.0, 1.0]])))(arr(ENT_LOGITS))
    assert grad.tolist()[0][0] == approx([0.0, 0.0, 0.0])  # masked
    assert grad.tolist()[0][1] == approx([0.0866434, -0.1732868, 0.0866434])
    # gradient descent on -coef * H (the bonus as the trainer adds it) moves towards uniform
    lg = arr(ENT_LOGITS) + 0.1 * grad
    assert losses.entropy(lg, arr([[0.0, 1.0]])).item() > 1.0397208


# ---- every loss: advantage sign, masking, sums ----


@pytest.mark.parametrize("fn", [losses.ppo, losses.importance_sampling, losses.cispo, losses.dro])
def test_positive_advantage_raises_logp_under_gradient_descent(fn):
    # rho = 1 (on policy), logp away from 0 so cispo's -A*logp term is not degenerate.
    logp = arr([-1.2, -1.2])
    _, grad = value_and_grad(fn, logp, logp, arr([1.0, -1.0]), arr([1.0, 1.0]))
    step = [lp - 0.1 * g for lp, g in zip(logp.tolist(), grad)]
    assert step[0] > -1.2  # good token: more likely
    assert step[1] < -1.2  # bad token: less likely


@pytest.mark.parametrize("fn", POLICY_LOSSES)
def test_masked_tokens_contribute_neither_loss_nor_gradient(fn):
    mask = arr([0.0, 1.0, 0.0, 1.0, 1.0])
    logp = [-0.9, -1.1, -0.4, -2.0, -0.7]
    old = [-1.0, -1.3, -0.8, -1.6, -0.7]
    adv = [0.5, 1.0, -1.0, -0.5, 2.0]
    # Wild but finite values on the masked (prompt) positions 0 and 2.
    wild_logp, wild_old, wild_adv = list(logp), list(old), list(adv)
    wild_logp[0], wild_old[0], wild_adv[0] = -30.0, -1.0, 1e4
    wild_logp[2], wild_old[2], wild_adv[2] = -0.01, -25.0, -1e4
    loss, grad = value_and_grad(fn, arr(logp), arr(old), arr(adv), mask)
    wild, wild_grad = value_and_grad(fn, arr(wild_logp), arr(wild_old), arr(wild_adv), mask)
    assert wild == pytest.approx(loss, abs=TOL)
    assert [wild_grad[i] for i in (1, 3, 4)] == approx([grad[i] for i in (1, 3, 4)])
    assert [grad[0], grad[2], wild_grad[0], wild_grad[2]] == [0.0, 0.0, 0.0, 0.0]
    assert any(abs(grad[i]) > 1e-3 for i in (1, 3, 4))  # the unmasked ones do move


def test_masked_ppo_sums_only_completion_tokens():
    # The ppo cases above, with a prompt token in front carrying a huge clipped-looking term.
    logp = arr([5.0] + tokens(PPO_RHO, PPO_OLD))
    old, adv = arr([0.0] + PPO_OLD), arr([-100.0] + PPO_ADV)
    loss = losses.ppo(logp, old, adv, arr([0.0] + [1.0] * 5)).item()
    assert loss == pytest.approx(-(2.56 - 0.8 - 1.5 + 1.0 + 1.1), abs=TOL)


@pytest.mark.parametrize("fn", POLICY_LOSSES)
def test_losses_are_sums_so_micro_batches_add_up(fn):
    # Two sequences of different completion lengths, right-padded to T=4.
    logp = [[-0.3, -1.2, -0.8, -2.0], [-1.5, -0.6, -0.2, -0.9]]
    old = [[-0.5, -1.0, -1.1, -1.0], [-1.0, -0.9, -0.2, -3.0]]
    adv = [[1.0, 1.0, 1.0, 0.0], [-0.5, 2.0, 0.0, 0.0]]
    mask = [[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]]
    whole, g_whole = value_and_grad(fn, arr(logp), arr(old), arr(adv), arr(mask))
    parts = [value_and_grad(fn, arr([logp[b]]), arr([old[b]]), arr([adv[b]]), arr([mask[b]]))
             for b in range(2)]
    assert whole == pytest.approx(parts[0][0] + parts[1][0], abs=TOL)
    assert g_whole == [approx(parts[0][1][0]), approx(parts[1][1][0])]
    # ...and on the two completions laid end to end as one (T,) row.
    flat = lambda rows: arr(rows[0] + rows[1])  # noqa: E731
    concat = fn(flat(logp), flat(old), flat(adv), flat(mask)).item()
    assert concat == pytest.approx(whole, abs=TOL)


@pytest.mark.parametrize("fn", POLICY_LOSSES)
def test_a_longer_completion_weighs_as_many_tokens_as_it_has(fn):
    one = [arr([-0.7]), arr([-0.9]), arr([1.5]), arr([1.0])]
    four = [mx.repeat(x, 4) for x in one]
    assert fn(*four).item() == pytest.approx(4 * fn(*one).item(), abs=TOL)
    assert abs(fn(*one).item()) > 1e-3


# ---- choosing a loss ----


def test_policy_loss_returns_the_named_function():
    assert [losses.policy_loss(n) for n in losses.LOSSES] == POLICY_LOSSES
    assert losses.LOSSES == ("ppo", "importance_sampling", "cispo", "dro", "cross_entropy")


def test_unknown_loss_is_a_value_error_naming_the_choices():
    with pytest.raises(ValueError) as err:
        losses.policy_loss("nope")
    assert "'nope'" in str(err.value)
    for name in losses.LOSSES:
        assert name in str(err.value)


# ---- token_logprobs (serving/logprobs.py: the log-probs the losses take) ----

# vocab 7, width 2; fixed weights so the log-softmax can be worked out by hand.
EMB = [[0.5, -1.0], [1.0, 0.0], [0.0, 1.0], [-0.5, 0.5], [2.0, -0.5], [0.25, 0.25], [-1.0, -1.0]]
W = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.5], [0.5, -2.0], [0.0, 0.0], [2.0, 1.0]]
B = [0.1, -0.2, 0.0, 0.3, 0.0, -0.1, 0.05]


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 2)
        self.out = nn.Linear(2, 7)
        self.embed.weight = arr(EMB)
        self.out.weight = arr(W)  # (out, in)
        self.out.bias = arr(B)

    def __call__(self, ids):
        return self.out(self.embed(ids))


def hand_logprob(token_in: int, target: int) -> float:
    e = EMB[token_in]
    logits = [W[v][0] * e[0] + W[v][1] * e[1] + B[v] for v in range(7)]
    return logits[target] - math.log(sum(math.exp(z) for z in logits))


def test_token_logprobs_is_log_softmax_of_the_target():
    ids = [[0, 4, 2], [6, 6, 1]]
    targets = [[4, 2, 6], [6, 0, 3]]
    got = token_logprobs(Tiny(), mx.array(ids), mx.array(targets))
    assert got.shape == (2, 3) and got.dtype == mx.float32
    want = [[hand_logprob(i, t) for i, t in zip(ri, rt)] for ri, rt in zip(ids, targets)]
    assert got.tolist() == [approx(row) for row in want]
    # Spot check one by hand: token 4 -> e=(2,-0.5), logit of target 2 = 1.5.
    assert want[0][1] == pytest.approx(1.5 - math.log(sum(
        math.exp(z) for z in (2.1, -0.7, 1.5, -1.95, 2.0, -0.1, 3.55))), abs=1e-12)


def test_token_logprobs_of_all_targets_sum_to_one():
    ids = mx.array([[3, 5]])
    probs = [sum(math.exp(token_logprobs(Tiny(), ids, mx.array([[v, v]]))[0, t].item())
                 for v in range(7)) for t in range(2)]
    assert probs == approx([1.0, 1.0])
