"""Unit tests for hpc_rl.algos against hand-computed values (arithmetic in the comments)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_rl.algos.advantages import (
    broadcast_sequence_advantage,
    discounted_returns,
    gae,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from hpc_rl.algos.kl import AdaptiveKLController, FixedKLController, apply_kl_to_rewards, kl_estimate, make_kl_controller
from hpc_rl.algos.losses import aggregate, entropy_from_logits, logprobs_from_logits, policy_loss, value_loss
from hpc_rl.algos.utils import masked_mean, masked_sum, masked_var, masked_whiten
from hpc_rl.config import KLConfig

T = torch.tensor


def close(a, b, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                               atol=tol, rtol=tol)


# ---------------------------------------------------------------- masked reductions

X = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # valid values: 1, 2, 4


def test_masked_sum_and_mean():
    close(masked_sum(X, M), 7.0)                       # 1 + 2 + 4
    close(masked_mean(X, M), 7.0 / 3)                  # 7 / 3 tokens
    close(masked_mean(X, M, dim=-1), [1.5, 4.0])       # (1+2)/2, 4/1
    close(masked_mean(X, M.bool()), 7.0 / 3)           # bool masks work the same


def test_masked_mean_all_masked_row_is_zero_and_ignores_padding_garbage():
    x = T([[1.0, float("nan")], [float("-inf"), float("inf")]])
    m = T([[1.0, 0.0], [0.0, 0.0]])
    close(masked_mean(x, m, dim=-1), [1.0, 0.0])
    close(masked_mean(x, m), 1.0)
    close(masked_mean(x, torch.zeros_like(m)), 0.0)


def test_masked_var():
    # mean 7/3; deviations -4/3, -1/3, 5/3; squares 16/9 + 1/9 + 25/9 = 42/9
    close(masked_var(X, M), (42 / 9) / 2)              # unbiased: / (3 - 1) = 7/3
    close(masked_var(X, M, unbiased=False), (42 / 9) / 3)  # biased: 14/9


def test_masked_whiten_by_hand():
    out = masked_whiten(X, M)
    std = math.sqrt(7 / 3 + 1e-8)                      # unbiased var 7/3 (above) + eps
    close(out, [[(1 - 7 / 3) / std, (2 - 7 / 3) / std, 0.0], [(4 - 7 / 3) / std, 0.0, 0.0]])
    out = masked_whiten(X, M, shift_mean=False)        # rescaled, mean kept: (x - m)/s + m
    close(out, [[(1 - 7 / 3) / std + 7 / 3, (2 - 7 / 3) / std + 7 / 3, 0.0], [(4 - 7 / 3) / std + 7 / 3, 0.0, 0.0]])


def test_masked_whiten_distributed_flag_without_process_group_is_local():
    close(masked_whiten(X, M, distributed=True), masked_whiten(X, M))


def test_masked_whiten_single_token_and_empty():
    # One valid value: x - mean = 0 and var = 0 (no spread), so the result is 0, not NaN.
    close(masked_whiten(T([[3.0, 9.0]]), T([[1.0, 0.0]])), [[0.0, 0.0]])
    close(masked_whiten(T([[3.0, 9.0]]), T([[0.0, 0.0]])), [[0.0, 0.0]])


# ---------------------------------------------------------------- advantages

def test_gae_three_tokens_by_hand():
    # gamma=0.9, lam=0.8, rewards [0, 0, 1], values [0.5, 0.6, 0.7]; value after the end = 0
    # t=2: delta = 1 + 0.9*0 - 0.7 = 0.3                 A2 = 0.3
    # t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03              A1 = 0.03 + 0.72*0.3 = 0.246
    # t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04              A0 = 0.04 + 0.72*0.246 = 0.21712
    # returns = A + V = [0.71712, 0.846, 1.0]
    # Row 2 is right-padded after one token (padding holds garbage): A0 = 2 - 0.5 = 1.5, R0 = 2.0
    rewards = T([[0.0, 0.0, 1.0], [2.0, 7.0, float("nan")]])
    values = T([[0.5, 0.6, 0.7], [0.5, 9.0, 9.0]])
    mask = T([[1, 1, 1], [1, 0, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [[0.21712, 0.246, 0.3], [1.5, 0.0, 0.0]])
    close(ret, [[0.71712, 0.846, 1.0], [2.0, 0.0, 0.0]])


def test_gae_has_no_gradient_to_values():
    values = T([[0.5, 0.6]], requires_grad=True)
    adv, ret = gae(T([[0.0, 1.0]]), values, T([[1, 1]]), 1.0, 1.0)
    assert not adv.requires_grad and not ret.requires_grad


def test_grpo_by_hand():
    # Group [1, 0, 0]: mean 1/3, deviations 2/3, -1/3, -1/3; unbiased var (4/9+1/9+1/9)/2 = 1/3
    # std = sqrt(1/3) = 0.57735 -> advantages [1.1547, -0.57735, -0.57735] (eps 1e-6 negligible)
    # Group [0.1, 0.1, 0.1]: identical -> exactly 0
    scores = T([1.0, 0.0, 0.0, 0.1, 0.1, 0.1])
    s = math.sqrt(1 / 3) + 1e-6
    adv = grpo_advantages(scores, group_size=3)
    close(adv, [2 / 3 / s, -1 / 3 / s, -1 / 3 / s, 0, 0, 0])
    assert (adv[3:] == 0).all()
    close(grpo_advantages(scores, 3, norm_by_std=False), [2 / 3, -1 / 3, -1 / 3, 0, 0, 0])


def test_grpo_group_of_one_keeps_score_and_bad_batch_raises():
    close(grpo_advantages(T([0.3, -2.0]), 1), [0.3, -2.0])
    with pytest.raises(ValueError, match="whole number of groups"):
        grpo_advantages(T([1.0, 2.0, 3.0]), 2)


def test_rloo_by_hand():
    # [1, 0, 0]: 1 - (0+0)/2 = 1; 0 - (1+0)/2 = -0.5; -0.5.   [3, 1]: 3 - 1 = 2; 1 - 3 = -2
    close(rloo_advantages(T([1.0, 0.0, 0.0]), 3), [1.0, -0.5, -0.5])
    close(rloo_advantages(T([3.0, 1.0]), 2), [2.0, -2.0])
    assert (rloo_advantages(T([0.1, 0.1, 0.1, 0.7, 0.7, 0.7]), 3) == 0).all()
    with pytest.raises(ValueError, match="group_size >= 2"):
        rloo_advantages(T([1.0]), 1)


def test_reinforce_pp_by_hand():
    # gamma 0.5; row 0 rewards [0, 0, 1] -> returns-to-go [0.25, 0.5, 1]; row 1 [0, 2 | pad] -> [1, 2]
    # valid returns 0.25, 0.5, 1, 1, 2: mean 4.75/5 = 0.95
    # deviations -0.7, -0.45, 0.05, 0.05, 1.05; squares sum 0.49+0.2025+0.0025+0.0025+1.1025 = 1.8
    # unbiased var 1.8/4 = 0.45
    rewards = T([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    close(discounted_returns(rewards, mask, 0.5), [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    s = math.sqrt(0.45 + 1e-8)
    close(reinforce_pp_advantages(rewards, mask, 0.5),
          [[(0.25 - 0.95) / s, (0.5 - 0.95) / s, (1 - 0.95) / s], [(1 - 0.95) / s, (2 - 0.95) / s, 0.0]])


def test_broadcast_sequence_advantage():
    close(broadcast_sequence_advantage(T([2.0, -1.0]), T([[1, 1, 0], [1, 0, 0]])), [[2, 2, 0], [-1, 0, 0]])


# ---------------------------------------------------------------- losses

def test_aggregate_modes():
    loss = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = T([[1, 1, 0], [1, 0, 0], [0, 0, 0]])        # third row empty
    close(aggregate(loss, mask, "token_mean"), 7 / 3)  # (1+2+4)/3
    close(aggregate(loss, mask, "seq_mean"), 2.75)     # ((1+2)/2 + 4/1) / 2 rows with tokens
    with pytest.raises(ValueError, match="seq_mean"):
        aggregate(loss, mask, "sum")


def _policy_case():
    # Valid tokens [[t1, t2], [t3, t4]] plus a padded third column holding garbage.
    # t1: A=+1, r=1.5 -> max(-1.5, -1.2) = -1.2 (clipped high side)
    # t2: A=+1, r=0.5 -> max(-0.5, -0.8) = -0.5
    # t3: A=-1, r=0.5 -> max( 0.5,  0.8) =  0.8 (clipped low side)
    # t4: A=-1, r=1.5 -> max( 1.5,  1.2) =  1.5
    old = torch.zeros(2, 3)
    new = T([[math.log(1.5), math.log(0.5), float("-inf")], [math.log(0.5), math.log(1.5), 3.0]],
            requires_grad=True)
    adv = T([[1.0, 1.0, float("nan")], [-1.0, -1.0, 5.0]])
    mask = T([[1, 1, 0], [1, 1, 0]])
    return new, old, adv, mask


def test_policy_loss_by_hand_both_clip_sides():
    new, old, adv, mask = _policy_case()
    loss, stats = policy_loss(new, old, adv, mask, clip_ratio=0.2)
    close(loss, (-1.2 - 0.5 + 0.8 + 1.5) / 4)          # 0.15
    assert stats["clipfrac"] == pytest.approx(0.5)     # t1 and t3
    assert stats["ratio_mean"] == pytest.approx(1.0)   # (1.5+0.5+0.5+1.5)/4
    # k3 = (r-1) - ln r: r=1.5 -> 0.5 - 0.405465 = 0.094535; r=0.5 -> -0.5 + 0.693147 = 0.193147
    assert stats["approx_kl"] == pytest.approx((2 * 0.094535 + 2 * 0.193147) / 4, abs=1e-5)
    assert all(isinstance(v, float) for v in stats.values())
    loss.backward()
    # d/dlogp of -A*r is -A*r (per token, / 4 tokens); clipped tokens and padding get 0
    close(new.grad, [[0.0, -0.5 / 4, 0.0], [0.0, 1.5 / 4, 0.0]])


def test_policy_loss_clip_higher_and_seq_mean():
    new, old, adv, mask = _policy_case()
    loss, _ = policy_loss(new, old, adv, mask, clip_ratio=0.2, clip_ratio_high=0.3)
    close(loss, (-1.3 - 0.5 + 0.8 + 1.5) / 4)          # t1 now clipped at 1.3
    loss, _ = policy_loss(new, old, adv, mask, clip_ratio=0.2, agg="seq_mean")
    close(loss, ((-1.2 - 0.5) / 2 + (0.8 + 1.5) / 2) / 2)


def test_value_loss_by_hand():
    # old = 1 everywhere, clip 0.2 -> clipped values within [0.8, 1.2]
    # v=1.5 R=2: (0.5)^2=0.25 vs (1.2-2)^2=0.64 -> 0.64 (clip counts)
    # v=1.1 R=0: 1.21 vs 1.21 (inside the clip range) -> 1.21
    # v=0.5 R=0: 0.25 vs (0.8-0)^2=0.64 -> 0.64 (clip counts, low side)
    # v=0.5 R=2: 2.25 vs (0.8-2)^2=1.44 -> 2.25
    values = T([[1.5, 1.1, 0.0], [0.5, 0.5, 0.0]], requires_grad=True)
    old = T([[1.0, 1.0, float("nan")], [1.0, 1.0, 1.0]])
    ret = T([[2.0, 0.0, float("inf")], [0.0, 2.0, 3.0]])
    mask = T([[1, 1, 0], [1, 1, 0]])
    loss, stats = value_loss(values, old, ret, mask, clip=0.2)
    close(loss, 0.5 * (0.64 + 1.21 + 0.64 + 2.25) / 4)  # 0.5925
    assert stats["vf_clipfrac"] == pytest.approx(0.5)
    assert stats["value_mean"] == pytest.approx((1.5 + 1.1 + 0.5 + 0.5) / 4)
    loss.backward()
    assert torch.isfinite(values.grad).all()
    # Unclipped: 0.5 * (0.25 + 1.21 + 0.25 + 2.25) / 4 = 0.495
    loss, stats = value_loss(values, old, ret, mask, clip=None)
    close(loss, 0.495)
    assert stats["vf_clipfrac"] == 0.0


def test_entropy_from_logits():
    # p = (0.25, 0.75): H = 0.25 ln 4 + 0.75 ln(4/3) = 0.346574 + 0.215762 = 0.562335
    logits = T([[[0.0, math.log(3.0)], [1000.0, 1000.0]]])   # second token: uniform, huge logits
    close(entropy_from_logits(logits), [[0.562335, math.log(2)]])
    z = T([[[0.0, 0.0, float("-inf")]]], requires_grad=True)  # banned vocab entry
    h = entropy_from_logits(z)
    close(h, [[math.log(2)]])
    h.sum().backward()
    assert torch.isfinite(z.grad).all()


def test_logprobs_from_logits():
    # softmax(0, ln 3) = (0.25, 0.75)
    logits = T([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    close(logprobs_from_logits(logits, T([[1, 0]])), [[math.log(0.75), math.log(0.25)]])
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 5, 11, generator=g) * 4
    labels = torch.randint(0, 11, (3, 5), generator=g)
    ref = torch.log_softmax(z, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    close(logprobs_from_logits(z, labels), ref)
    # bf16 logits go through the row-wise float32 path (the bf16 rounding of z is the only error)
    zb = z.bfloat16()
    close(logprobs_from_logits(zb, labels), torch.log_softmax(zb.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1))


# ---------------------------------------------------------------- KL

def test_kl_estimators_by_hand():
    # logp = ln 0.5, ref = ln 0.25: k1 = ln 2 = 0.693147; k2 = 0.5 * ln(2)^2 = 0.240227
    # k3 = exp(ln .25 - ln .5) - (ln .25 - ln .5) - 1 = 0.5 + 0.693147 - 1 = 0.193147
    # logp = ln 0.25, ref = ln 0.5: k1 = -0.693147; k3 = 2 - 0.693147 - 1 = 0.306853
    lp = T([math.log(0.5), math.log(0.25)])
    ref = T([math.log(0.25), math.log(0.5)])
    close(kl_estimate(lp, ref, "k1"), [0.693147, -0.693147])
    close(kl_estimate(lp, ref, "k2"), [0.240227, 0.240227])
    close(kl_estimate(lp, ref, "k3"), [0.193147, 0.306853])
    assert torch.isfinite(kl_estimate(T([0.0]), T([-1e4]), "k3")).all()   # clamped, no overflow
    with pytest.raises(ValueError, match="k3"):
        kl_estimate(lp, ref, "k4")


def test_adaptive_kl_controller_by_hand():
    c = AdaptiveKLController(init_coef=0.1, target=0.1, horizon=100)
    c.update(0.2, 10)    # error 0.2/0.1 - 1 = 1 -> clipped 0.2; mult 1 + 0.2*10/100 = 1.02
    assert c.value == pytest.approx(0.102)
    c.update(0.05, 10)   # error -0.5 -> clipped -0.2; mult 0.98
    assert c.value == pytest.approx(0.102 * 0.98)
    c.update(0.11, 100)  # error 0.1 (inside the clip); mult 1 + 0.1*100/100 = 1.1
    assert c.value == pytest.approx(0.102 * 0.98 * 1.1)
    d = AdaptiveKLController(0.5, 0.1, 100)
    d.load_state_dict(c.state_dict())
    assert d.value == c.value


def test_fixed_controller_and_factory():
    f = FixedKLController(0.05)
    f.update(10.0, 100)
    assert f.value == 0.05
    g = FixedKLController(0.0)
    g.load_state_dict(f.state_dict())
    assert g.value == 0.05
    assert isinstance(make_kl_controller(KLConfig(coef=0.05)), FixedKLController)
    a = make_kl_controller(KLConfig(coef=0.05, adaptive=True, target=1.0, horizon=50))
    assert isinstance(a, AdaptiveKLController) and (a.value, a.target, a.horizon) == (0.05, 1.0, 50)


def test_apply_kl_to_rewards_by_hand():
    # coef 0.5: row 0 -> [-0.05, -0.1, -0.15 + 1 = 0.85]; row 1 (one token) -> [-0.2 - 1 = -1.2, 0, 0]
    # row 2 has no valid token -> all 0 (its score has nowhere to go)
    kl = T([[0.1, 0.2, 0.3], [0.4, float("inf"), float("nan")], [1.0, 1.0, 1.0]])
    mask = T([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    out = apply_kl_to_rewards(T([1.0, -1.0, 5.0]), kl, mask, coef=0.5)
    close(out, [[-0.05, -0.1, 0.85], [-1.2, 0.0, 0.0], [0.0, 0.0, 0.0]])


# ---------------------------------------------------------------- properties

floats = st.floats(-100, 100, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 6), st.lists(st.lists(floats, min_size=6, max_size=6), min_size=1, max_size=4))
def test_group_advantages_have_zero_mean_per_group(g, groups):
    scores = T([row[:g] for row in groups], dtype=torch.float64).reshape(-1)
    for adv in (grpo_advantages(scores, g), rloo_advantages(scores, g)):
        assert adv.reshape(-1, g).sum(dim=1).abs().max() < 1e-6 * max(1.0, scores.abs().max().item())


@settings(max_examples=60, deadline=None)
@given(st.lists(floats, min_size=2, max_size=30), st.data())
def test_whiten_gives_zero_mean_unit_variance(values, data):
    x = T(values, dtype=torch.float64).unsqueeze(0)
    mask = T(data.draw(st.lists(st.booleans(), min_size=len(values), max_size=len(values)))).unsqueeze(0)
    valid = x[mask]
    if valid.numel() < 2 or valid.var() < 1e-3:
        # Too little spread: var + eps (1e-8) is not var to the 1e-4 asserted below. (The old guard, a range
        # under 1e-3, let through variances near 1e-7, where eps alone moves the result by 1e-2.)
        return
    w = masked_whiten(x, mask)
    assert abs(masked_mean(w, mask).item()) < 1e-6
    assert masked_var(w, mask).item() == pytest.approx(1.0, abs=1e-4)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(floats, floats), min_size=1, max_size=20))
def test_k3_is_nonnegative(pairs):
    lp, ref = T(pairs, dtype=torch.float64).unbind(-1)
    assert (kl_estimate(lp, ref, "k3") >= 0).all()


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.floats(0.0, 1.0), st.data())
def test_gae_with_lambda_one_is_returns_minus_values(t_len, gamma, data):
    # With lam = 1 the deltas telescope: A_t = (discounted return-to-go) - V_t.
    r = T(data.draw(st.lists(floats, min_size=t_len, max_size=t_len)), dtype=torch.float64).unsqueeze(0)
    v = T(data.draw(st.lists(floats, min_size=t_len, max_size=t_len)), dtype=torch.float64).unsqueeze(0)
    mask = torch.ones_like(r)
    adv, ret = gae(r, v, mask, gamma=gamma, lam=1.0)
    close(adv, discounted_returns(r, mask, gamma) - v, tol=1e-6)
    close(ret, discounted_returns(r, mask, gamma), tol=1e-6)


# --------------------------------------------------------------------------- the registry


def test_every_registered_algorithm_has_an_estimator_with_its_source():
    from hpc_rl.algos import estimators
    from hpc_rl.algos.registry import ALGORITHMS

    assert set(ALGORITHMS) == {"ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp"}
    for name, algo in ALGORITHMS.items():
        fn = getattr(estimators, algo.estimator)
        assert callable(fn) and "https://" in fn.__doc__, name
        assert algo.source.startswith("https://"), name
    from hpc_rl.config import AlgorithmConfig

    assert AlgorithmConfig(name="ppo").uses_critic and not AlgorithmConfig(name="grpo").uses_critic
    assert AlgorithmConfig(name="reinforce_pp").kl_in_reward and not AlgorithmConfig(name="rloo").kl_in_reward


def test_group_estimators_on_shards_equal_the_whole_batch():
    """Each rank computes group baselines from all of the step's scores and keeps its rows: 2 shards of a batch
    of 2 groups x 3 give exactly the whole-batch GRPO/RLOO advantages."""
    from hpc_rl.algos.estimators import AdvantageInputs, compute_advantages
    from hpc_rl.config import AlgorithmConfig

    scores = T([1.0, 0.0, 0.5, 0.2, 0.2, 0.8])
    mask = T([[1.0, 1.0, 0.0]] * 3)
    for name, whole in (("grpo", grpo_advantages(scores, 3)), ("rloo", rloo_advantages(scores, 3))):
        a = AlgorithmConfig(name=name, group_size=3)
        for rows in (slice(0, 3), slice(3, 6)):
            adv, returns = compute_advantages(AdvantageInputs(scores, rows, torch.zeros(3, 3), None, mask), a)
            assert returns is None
            close(adv, whole[rows].unsqueeze(1) * mask)


def test_gae_and_reinforce_pp_through_the_registry():
    from hpc_rl.algos.estimators import AdvantageInputs, compute_advantages
    from hpc_rl.config import AlgorithmConfig

    r, v, m = T([[0.0, 0.0, 1.0]]), T([[0.5, 0.5, 0.5]]), T([[1.0, 1.0, 1.0]])
    x = AdvantageInputs(T([1.0]), slice(0, 1), r, v, m)
    adv, ret = compute_advantages(x, AlgorithmConfig(name="ppo", gamma=1.0, lam=1.0, whiten_advantages=False))
    want_adv, want_ret = gae(r, v, m, 1.0, 1.0)
    close(adv, want_adv)
    close(ret, want_ret)
    adv, ret = compute_advantages(x, AlgorithmConfig(name="reinforce_pp", gamma=1.0))
    close(adv, reinforce_pp_advantages(r, m, 1.0))
    assert ret is None


def test_actor_loss_uses_clip_ratio_high_entropy_and_kl_from_the_config():
    """algorithm.clip_ratio_high (DAPO) reaches the loss: token 1 (r = 1.5, A > 0) is clipped at 1.3 instead of
    1.2 -> (-1.3 - 0.5 + 0.8 + 1.5) / 4 = 0.125 (the by-hand case above gives 0.15 without it)."""
    from hpc_rl.algos.losses import actor_loss
    from hpc_rl.config import load_dict

    new, old, adv, mask = _policy_case()
    ent = torch.zeros_like(new)
    a = load_dict({"model": {"path": "m"}, "algorithm": {"clip_ratio": 0.2}}).algorithm
    close(actor_loss(new, ent, old, None, adv, mask, a, 0.0)[0], 0.15)
    a = load_dict({"model": {"path": "m"}, "algorithm": {"clip_ratio": 0.2, "clip_ratio_high": 0.3}}).algorithm
    loss, stats = actor_loss(new, ent, old, None, adv, mask, a, 0.0)
    close(loss, 0.125)
    assert stats["policy_loss"] == pytest.approx(0.125) and "kl_loss" not in stats
    # entropy bonus: mean entropy 2 over the 4 valid tokens, coef 0.1 -> -0.2
    a = load_dict({"model": {"path": "m"}, "algorithm": {"clip_ratio": 0.2, "entropy_coef": 0.1}}).algorithm
    close(actor_loss(new, torch.full_like(new, 2.0), old, None, adv, mask, a, 0.0)[0], 0.15 - 0.2)
    # KL as a loss term: k1 with ref = logp - 0.5 -> KL 0.5 per token, coef 0.1 -> +0.05
    a = load_dict({"model": {"path": "m"}, "algorithm": {"clip_ratio": 0.2, "kl": {"coef": 0.1, "estimator": "k1"}}}).algorithm
    loss, stats = actor_loss(new, ent, old, new.detach() - 0.5, adv, mask, a, 0.1)
    close(loss, 0.15 + 0.05)
    assert stats["kl_loss"] == pytest.approx(0.5)


def test_clip_ratio_high_and_kl_in_reward_are_validated():
    from hpc_rl.config import load_dict
    from hpc_rl.errors import ConfigError

    for bad in (0, -0.1, 10):
        with pytest.raises(ConfigError, match="algorithm.clip_ratio_high must be in"):
            load_dict({"model": {"path": "m"}, "algorithm": {"clip_ratio_high": bad}})
    with pytest.raises(ConfigError, match="algorithm.kl.in_reward: grpo computes advantages from whole-sequence"):
        load_dict({"model": {"path": "m"}, "algorithm": {"name": "grpo", "kl": {"in_reward": True}}})
    with pytest.raises(ConfigError, match="algorithm.name: 'gpro' is not valid.*did you mean 'grpo'"):
        load_dict({"model": {"path": "m"}, "algorithm": {"name": "gpro"}})


def test_truncated_is_weights_by_hand():
    from hpc_rl.algos.correction import truncated_is_weights

    # exp(prox - behaviour): t1 e^0 = 1, t2 e^ln3 = 3 -> truncated to 2, t3 e^ln0.5 = 0.5; padding -> 0
    prox = T([[0.0, math.log(3.0), 7.0], [math.log(0.5), 0.0, 0.0]])
    behaviour = T([[0.0, 0.0, -50.0], [0.0, 0.0, float("nan")]])
    mask = T([[1, 1, 0], [1, 0, 0]])
    w, stats = truncated_is_weights(prox, behaviour, mask, cap=2.0)
    close(w, [[1.0, 2.0, 0.0], [0.5, 0.0, 0.0]])
    assert stats["tis_weight_mean"] == pytest.approx((1 + 3 + 0.5) / 3)
    assert stats["tis_weight_max"] == pytest.approx(3.0)
    assert stats["tis_truncated_frac"] == pytest.approx(1 / 3)
    assert not w.requires_grad


def test_policy_loss_with_importance_weights_by_hand():
    new, old, adv, mask = _policy_case()
    w = T([[2.0, 0.5, 9.0], [1.0, 0.0, 9.0]])
    loss, _ = policy_loss(new, old, adv, mask, clip_ratio=0.2, is_weights=w)
    close(loss, (2.0 * -1.2 + 0.5 * -0.5 + 1.0 * 0.8 + 0.0 * 1.5) / 4)
    loss.backward()
    close(new.grad, [[0.0, 0.5 * -0.5 / 4, 0.0], [0.0, 0.0, 0.0]])


def test_async_steps_and_rollout_correction_config():
    from hpc_rl.config import load_dict
    from hpc_rl.errors import ConfigError

    cfg = load_dict({"model": {"path": "m"}, "rollout": {"async_steps": 2}})
    assert cfg.algorithm.correction(cfg.rollout.async_steps) == "tis"
    assert cfg.algorithm.correction(0) == "none"
    cfg = load_dict({"model": {"path": "m"}, "rollout": {"async_steps": 1}, "algorithm": {"rollout_correction": "none"}})
    assert cfg.algorithm.correction(1) == "none"
    with pytest.raises(ConfigError, match=r"rollout.async_steps must be in \[0, 16\]"):
        load_dict({"model": {"path": "m"}, "rollout": {"async_steps": -1}})
    with pytest.raises(ConfigError, match="algorithm.tis_cap must be >= 1"):
        load_dict({"model": {"path": "m"}, "algorithm": {"tis_cap": 0.5}})
    with pytest.raises(ConfigError, match="rollout.max_policy_lag: replaced by rollout.async_steps"):
        load_dict({"model": {"path": "m"}, "rollout": {"max_policy_lag": 1}})
    with pytest.raises(ConfigError, match=r"trainer.local_cpus must be a list of CPU core numbers"):
        load_dict({"model": {"path": "m"}, "trainer": {"local_cpus": ["a"]}})


def test_the_sum_aggregations_by_hand():
    """verl's token-sum, seq-mean-token-sum and seq-mean-token-sum-norm (Dr. GRPO), and that micro-batch weights
    rebuild each one from parts."""
    from hpc_rl.algos.losses import AGG_MODES, aggregate_count, micro_batch_weight

    loss = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = T([[1, 1, 1], [1, 0, 0], [0, 0, 0]])        # third row empty: not a sequence of any seq_ mode
    close(aggregate(loss, mask, "token_mean"), 2.5)               # (1+2+3+4) / 4 tokens
    close(aggregate(loss, mask, "seq_mean"), 3.0)                 # (6/3 + 4/1) / 2 rows
    close(aggregate(loss, mask, "token_sum"), 10.0)               # 1+2+3+4
    close(aggregate(loss, mask, "seq_mean_token_sum"), 5.0)       # (6 + 4) / 2 rows
    close(aggregate(loss, mask, "seq_mean_token_sum_norm", 4.0), 1.25)   # (6/4 + 4/4) / 2 rows
    with pytest.raises(ValueError, match="positive constant norm"):
        aggregate(loss, mask, "seq_mean_token_sum_norm")
    # A long and a short answer with the same per-token loss: the token mean of each row weighs them alike, the
    # constant divisor weighs the long one by its length (Dr. GRPO's point).
    same = T([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    lengths = T([[1, 1, 1, 1], [1, 0, 0, 0]])
    close(aggregate(same, lengths, "seq_mean"), 1.0)
    close(aggregate(same, lengths, "seq_mean_token_sum_norm", 4.0), (4 / 4 + 1 / 4) / 2)
    for mode in AGG_MODES:
        parts = [(slice(0, 1)), (slice(1, 3))]
        rebuilt = sum(float(aggregate(loss[p], mask[p], mode, 4.0)) * micro_batch_weight(mask[p], aggregate_count(mask, mode), mode)
                      for p in parts)
        assert rebuilt == pytest.approx(float(aggregate(loss, mask, mode, 4.0))), mode


def test_dual_clip_by_hand():
    """Dual-clip PPO, clip 0.2, clip_ratio_c 3: A = -1 and r = 5 -> max(5, 1.2) = 5, bounded at 3 with no gradient;
    A = -1 and r = 2 -> 2 (under the bound); A = +1 and r = 5 -> max(-5, -1.2) = -1.2 (the bound is for A < 0)."""
    from hpc_rl.algos.losses import ppo_clip_loss

    log_ratio = torch.log(T([5.0, 2.0, 5.0])).requires_grad_()
    adv = T([-1.0, -1.0, 1.0])
    loss, clipped = ppo_clip_loss(log_ratio, log_ratio, adv, 0.2, 0.2, 3.0)
    close(loss, [3.0, 2.0, -1.2])
    assert clipped.tolist() == [True, False, True]
    loss.sum().backward()
    close(log_ratio.grad, [0.0, 2.0, 0.0])   # d(-A r)/d log r = -A r = 2 for the middle token only
    close(ppo_clip_loss(torch.log(T([5.0])), None, T([-1.0]), 0.2, 0.2, None)[0], [5.0])  # off: unbounded
    # Through the config (off unless set; verl's 3.0 here) and policy_loss: mean of (3 + 2 - 1.2) over 3 tokens.
    from hpc_rl.config import load_dict

    assert load_dict({"model": {"path": "m"}}).algorithm.clip_ratio_c is None
    a = load_dict({"model": {"path": "m"}, "algorithm": {"clip_ratio_c": 3.0}}).algorithm
    out, stats = policy_loss(torch.log(T([[5.0, 2.0, 5.0]])), torch.zeros(1, 3), T([[-1.0, -1.0, 1.0]]), T([[1, 1, 1]]),
                             0.2, clip_ratio_c=a.clip_ratio_c)
    close(out, (3.0 + 2.0 - 1.2) / 3)
    assert stats["clipfrac"] == pytest.approx(2 / 3)


def test_kl_clamp_abs_and_straight_through_by_hand():
    """logp - ref = -5: k3 = e^5 - 5 - 1 = 142.41, clamped at 10 (verl's low_var_kl); abs = 5; k3+ has k3's value
    and k2's gradient d/dlogp 0.5 (logp - ref)^2 = logp - ref = -5; k2+ is k2."""
    lp = T([-6.0]).requires_grad_()
    ref = T([-1.0])
    close(kl_estimate(lp, ref, "k3", clamp=None), [math.exp(5) - 6])
    close(kl_estimate(lp, ref, "k3"), [10.0])
    close(kl_estimate(lp, ref, "abs"), [5.0])
    st3 = kl_estimate(lp, ref, "k3+")
    close(st3, [10.0])
    st3.sum().backward()
    close(lp.grad, [-5.0])
    lp.grad = None
    kl_estimate(lp, ref, "k3").sum().backward()
    close(lp.grad, [0.0])   # the clamped k3 itself passes no gradient there
    close(kl_estimate(lp, ref, "k2+"), kl_estimate(lp, ref, "k2"))
    close(kl_estimate(lp, ref, "k1+"), [-5.0])


def test_dr_grpo_means_both_normalizations_off():
    """algorithm.name: dr_grpo: advantages r - group mean (no std), the loss a token sum per sequence over a
    constant (the response budget: the toy's max_new_tokens), as the paper's eq. and verl's
    norm_adv_by_std_in_grpo: false + loss_agg_mode: seq-mean-token-sum-norm; the keys still override."""
    from hpc_rl.algos.estimators import AdvantageInputs, compute_advantages
    from hpc_rl.config import load_dict

    spec = {"model": {"path": "m"}, "rollout": {"max_new_tokens": 6}, "trainer": {"mini_batch_size": 16},
            "algorithm": {"name": "dr_grpo", "group_size": 2}}
    a = load_dict(spec).algorithm
    assert (a.norm_adv_by_std, a.loss_agg, a.loss_agg_norm) == (False, "seq_mean_token_sum_norm", 6.0)
    scores, mask = T([1.0, 0.0, 0.25, 0.75]), torch.ones(4, 2)
    adv, _ = compute_advantages(AdvantageInputs(scores, slice(0, 4), torch.zeros(4, 2), None, mask), a)
    close(adv[:, 0], [0.5, -0.5, -0.25, 0.25])
    grpo = load_dict({**spec, "algorithm": {"name": "grpo", "group_size": 2}}).algorithm
    assert (grpo.norm_adv_by_std, grpo.loss_agg, grpo.loss_agg_norm) == (True, "token_mean", None)
    gspo = load_dict({**spec, "algorithm": {"ratio": "sequence"}}).algorithm
    assert gspo.loss_agg == "seq_mean"   # GSPO's paper and verl average per sequence
    mine = load_dict({**spec, "algorithm": {"name": "dr_grpo", "loss_agg": "token_mean", "norm_adv_by_std": True}}).algorithm
    assert (mine.norm_adv_by_std, mine.loss_agg) == (True, "token_mean")


def test_new_algorithm_keys_are_validated():
    from hpc_rl.config import load_dict
    from hpc_rl.errors import ConfigError

    for key, bad, msg in (("clip_ratio_c", 1.0, "algorithm.clip_ratio_c must be > 1"),
                          ("loss_agg_norm", 0, "algorithm.loss_agg_norm must be > 0"),
                          ("loss_agg", "seq-mean-token-sum", "algorithm.loss_agg: 'seq-mean-token-sum' is not valid")):
        with pytest.raises(ConfigError, match=msg):
            load_dict({"model": {"path": "m"}, "algorithm": {key: bad}})
    with pytest.raises(ConfigError, match="algorithm.kl.clamp must be > 0"):
        load_dict({"model": {"path": "m"}, "algorithm": {"kl": {"clamp": -1}}})


def test_group_estimators_compare_episodes_when_an_episode_has_several_samples():
    """An agent's episode of two conversations counts once in its group's baseline and gives both samples its
    advantage; padding rows (-1) get 0. Groups of 2 episodes with rewards (1, 0) and (0.5, 0.5): GRPO gives
    +-(0.5 / (std 0.7071 + 1e-6)) in the first group, 0 in the second (equal rewards); RLOO +-1, 0."""
    from hpc_rl.algos.estimators import AdvantageInputs, compute_advantages
    from hpc_rl.config import AlgorithmConfig

    episodes = torch.tensor([0, 0, 1, 2, 3, 3, -1, -1])  # episode 0 and 3: two samples each; two fillers
    scores = T([1.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.0, 0.0])
    mask = T([[1.0, 1.0]] * 8)
    g = 0.5 / (math.sqrt(0.5) + 1e-6)
    for name, want in (("grpo", [g, g, -g, 0, 0, 0, 0, 0]), ("rloo", [1, 1, -1, 0, 0, 0, 0, 0])):
        a = AlgorithmConfig(name=name, group_size=2)
        for rows in (torch.arange(0, 4), torch.arange(4, 8)):
            adv, _ = compute_advantages(AdvantageInputs(scores, rows, torch.zeros(4, 2), None, mask[:4], episodes), a)
            close(adv, T(want)[rows].unsqueeze(1) * mask[:4])
