"""The reasoning-RL recipes' pieces against hand-computed values: CISPO, GSPO's sequence ratio, DAPO's overlong
penalty and the reward-spread test of its dynamic sampling (with their edge cases), and dynamic sampling's
selection of groups, rounds and data order."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_rl.algos.losses import POLICY_LOSSES, aggregate, importance_log_ratio, policy_loss
from hpc_rl.algos.shaping import groups_with_spread, overlong_penalty

T = torch.tensor
L15, L05 = math.log(1.5), math.log(0.5)


def close(a, b, tol=1e-5):
    assert torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32),
                          atol=tol), (a, b)


def _case():
    """Two samples of two tokens (+ padding): ratios 1.5, 0.5 with A = 1 and 0.5, 1.5 with A = -1."""
    new = T([[L15, L05, float("-inf")], [L05, L15, 3.0]], requires_grad=True)
    old = torch.zeros(2, 3)
    adv = T([[1.0, 1.0, float("nan")], [-1.0, -1.0, 5.0]])
    mask = T([[1, 1, 0], [1, 1, 0]])
    return new, old, adv, mask


def test_registry_names_the_config_choices():
    assert set(POLICY_LOSSES) == {"ppo", "cispo"}


def test_cispo_by_hand_keeps_every_tokens_gradient():
    new, old, adv, mask = _case()
    loss, stats = policy_loss(new, old, adv, mask, clip_ratio=0.2, loss="cispo")
    # weights clip(r, 0.8, 1.2) = [1.2, 0.8], [0.8, 1.2]; per token -w * A * log pi:
    # -1.2*ln1.5, -0.8*ln0.5, 0.8*ln0.5, 1.2*ln1.5 -> they cancel
    close(loss, (-1.2 * L15 - 0.8 * L05 + 0.8 * L05 + 1.2 * L15) / 4)
    assert stats["clipfrac"] == pytest.approx(1.0)  # every ratio is outside [0.8, 1.2]
    loss.backward()
    # -w * A / 4 on every valid token: PPO would give 0 on the clipped ones; padding gets 0
    close(new.grad, [[-1.2 / 4, -0.8 / 4, 0.0], [0.8 / 4, 1.2 / 4, 0.0]])


def test_cispo_with_no_lower_bound_and_a_high_one():
    new, old, adv, mask = _case()
    loss, _ = policy_loss(new, old, adv, mask, clip_ratio=1.0, clip_ratio_high=0.28, loss="cispo")
    close(loss, (-1.28 * L15 - 0.5 * L05 + 0.5 * L05 + 1.28 * L15) / 4)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(-3, 3), min_size=6, max_size=6), st.lists(st.floats(-2, 2), min_size=6, max_size=6))
def test_on_policy_cispo_and_ppo_have_the_same_gradient(lp, adv):
    """At ratio 1 (the first update of a step) CISPO's gradient is PPO's: -A * grad log pi."""
    grads = []
    for name in ("ppo", "cispo"):
        new = T(lp, requires_grad=True).view(2, 3)
        new.retain_grad()
        loss, _ = policy_loss(new, new.detach().clone(), T(adv).view(2, 3), torch.ones(2, 3), 0.2, loss=name)
        loss.backward()
        grads.append(new.grad)
    close(grads[0], grads[1])


def test_gspo_sequence_ratio_by_hand():
    new, old, adv, mask = _case()
    s = math.exp((L15 + L05) / 2)  # sqrt(0.75) = 0.866: each sequence's length-normalized ratio
    loss, stats = policy_loss(new, old, adv, mask, clip_ratio=0.2, ratio_level="sequence")
    close(loss, (-s - s + s + s) / 4)
    assert stats["clipfrac"] == 0.0 and stats["ratio_mean"] == pytest.approx(s, abs=1e-6)
    loss.backward()
    # GSPO-token: d/dlog pi_t = -A * s_i (the sequence's value, the token's own gradient)
    close(new.grad, [[-s / 4, -s / 4, 0.0], [s / 4, s / 4, 0.0]])


def test_gspo_clips_whole_sequences():
    new, old, adv, mask = _case()
    s = math.exp((L15 + L05) / 2)
    loss, stats = policy_loss(new, old, adv, mask, clip_ratio=0.1, ratio_level="sequence")
    # [0.9, 1.1]: sample 0 (A = 1) keeps -s (the larger); sample 1 (A = -1) takes the clipped 0.9, both tokens
    close(loss, (-s - s + 0.9 + 0.9) / 4)
    assert stats["clipfrac"] == pytest.approx(0.5)
    loss.backward()
    close(new.grad, [[-s / 4, -s / 4, 0.0], [0.0, 0.0, 0.0]])


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(-3, 3), min_size=4, max_size=4), st.lists(st.floats(-0.5, 0.5), min_size=4, max_size=4),
       st.lists(st.floats(-2, 2), min_size=4, max_size=4), st.sampled_from(["ppo", "cispo"]))
def test_gspo_with_one_token_per_sequence_is_the_token_ratio(old, delta, adv, name):
    old_t = T(old).view(4, 1)
    out = []
    for level in ("token", "sequence"):
        new = (old_t + T(delta).view(4, 1)).requires_grad_(True)
        loss, _ = policy_loss(new, old_t, T(adv).view(4, 1), torch.ones(4, 1), 0.2, loss=name, ratio_level=level)
        loss.backward()
        out.append((loss.detach(), new.grad))
    close(out[0][0], out[1][0])
    close(out[0][1], out[1][1])


def test_zero_length_responses_and_a_fully_masked_batch_stay_finite():
    new, old, adv, _ = _case()
    mask = T([[1, 1, 0], [0, 0, 0]])  # the second response is empty
    for level in ("token", "sequence"):
        loss, _ = policy_loss(new, old, adv, mask, 0.2, ratio_level=level)
        assert torch.isfinite(loss)
    # every sample truncated and masked (algorithm.mask_truncated): no token is trained on, nothing is NaN
    x = torch.ones(2, 3, requires_grad=True)
    loss = aggregate(x * 2, torch.zeros(2, 3))
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.all(x.grad == 0)
    lr = importance_log_ratio(new, old, torch.zeros(2, 3), "sequence")
    assert torch.all(lr == 0)


def test_overlong_penalty_by_hand():
    # budget 20, buffer 4: no penalty up to 16 tokens, then -(L - 16) / 4, -1 from 20 on
    got = overlong_penalty([0, 10, 16, 17, 18, 20, 25], budget=20, buffer_tokens=4)
    np.testing.assert_allclose(got, [0, 0, 0, -0.25, -0.5, -1.0, -1.0])
    np.testing.assert_allclose(overlong_penalty([18], 20, 4, penalty=0.5), [-0.25])
    np.testing.assert_allclose(overlong_penalty([30, 5], 20, 0), [0, 0])  # buffer 0: off
    np.testing.assert_allclose(overlong_penalty([6, 6], 6, 6), [-1.0, -1.0])  # the whole budget as buffer


def test_groups_with_spread():
    np.testing.assert_array_equal(groups_with_spread([1, 1, 0, 1, 0.5, 0.5], 2), [False, True, False])
    np.testing.assert_array_equal(groups_with_spread([0.0, 1.0, 2.0], 1), [False, False, False])  # a group of one
    np.testing.assert_array_equal(groups_with_spread([0, 0, 0, 0], 4), [False])  # all equal


class _Rounds:
    """Stands in for BatchMaker's generation only (dynamic_batch's selection is under test): prompt i's group of 2
    has a reward spread iff i % 3 == 0, its samples are the prompt id twice."""

    def __init__(self, prompts_per_step=4, max_gen_batches=4, on_exhausted="warn", n_rows=30):
        from hpc_rl import config

        self.cfg = config.load_dict({"name": "t", "model": {"path": "x"}, "data": {"source": "toy:repeat_digit"},
                                     "algorithm": {"group_size": 2, "dynamic_sampling": {
                                         "enabled": True, "max_gen_batches": max_gen_batches,
                                         "on_exhausted": on_exhausted}},
                                     "trainer": {"prompts_per_step": prompts_per_step, "mini_batch_size": 8}})
        self.dataset = type("D", (), {"rows": [{"id": 100 + i} for i in range(n_rows)],
                                      "__len__": lambda s: n_rows})()
        self.calls = []

    def generate(self, step, idx, round_):
        from hpc_rl.orchestrator.batch import RolloutBatch

        self.calls.append((round_, list(idx)))
        rewards = [v for i in idx for v in ((1.0, 0.0) if i % 3 == 0 else (0.5, 0.5))]
        n = len(rewards)
        return RolloutBatch(step=step, prompts=[[i] for i in idx for _ in range(2)],
                            responses=[[i, i] for i in idx for _ in range(2)], loss_masks=[[1, 1]] * n,
                            rollout_logprobs=[[0.0, 0.0]] * n, versions=[step] * n, truncated=[False] * n,
                            group_ids=[j // 2 for j in range(n)], prompt_ids=[100 + i for i in idx for _ in range(2)],
                            reward_parts={"function": rewards},
                            stats={"gen_seconds": 1.0, "gen_tokens_per_s": 10.0, "reward_seconds": 0.1,
                                   "server_tokens/0": 2.0 * n})


def test_dynamic_sampling_keeps_only_groups_with_a_spread_deterministically():
    from hpc_rl.data.sampler import indices_for_step
    from hpc_rl.orchestrator.dynamic_sampling import dynamic_batch

    m = _Rounds()
    idx = indices_for_step(30, 4, m.cfg.seed, 5)
    b = dynamic_batch(m, 5, idx)
    groups = [b.responses[k][0] for k in range(0, len(b), 2)]
    assert len(groups) == 4 and all(i % 3 == 0 for i in groups)  # only groups with a spread, exactly 4 of them
    assert np.all(groups_with_spread(b.reward_parts["function"], 2))
    assert b.stats["prompt_ids"] == [100 + i for i in groups] == b.prompt_ids[::2]
    assert b.group_ids == [j // 2 for j in range(8)]  # the chosen groups, numbered apart across rounds
    assert b.stats["gen_batches"] == len(m.calls) > 1
    assert b.stats["prompts_consumed"] == sum(len(c[1]) for c in m.calls)
    assert b.stats["groups_kept_frac"] == pytest.approx(
        sum(i % 3 == 0 for _, c in m.calls for i in c) / b.stats["prompts_consumed"])
    assert b.stats["server_tokens/0"] == 2.0 * 2 * b.stats["prompts_consumed"]
    # every generated sample's task reward: 0.5 everywhere (a spread group: 1 and 0; the others 0.5 and 0.5)
    assert b.stats["generated_reward_mean"] == pytest.approx(0.5)
    # A resume replays the same rounds: same prompts, same groups, same order.
    again = _Rounds()
    assert dynamic_batch(again, 5, idx).responses == b.responses and again.calls == m.calls


def test_dynamic_sampling_out_of_rounds_warns_or_stops(caplog):
    from hpc_rl.errors import TrainingError
    from hpc_rl.orchestrator.dynamic_sampling import dynamic_batch

    idx = [1, 2, 4, 3]  # one group with a spread (3)
    b = dynamic_batch(_Rounds(max_gen_batches=1), 0, idx)
    assert [b.responses[k][0] for k in range(0, 8, 2)] == [3, 1, 2, 4]  # kept first, then filled
    assert b.stats["groups_kept_frac"] == 0.25 and "kept 1 of 4 groups" in caplog.text
    with pytest.raises(TrainingError, match=r"kept 1 of 4 groups with a reward spread after 1 round\(s\) \(4 prompts\)"
                       r"; raise algorithm.dynamic_sampling.max_gen_batches"):
        dynamic_batch(_Rounds(max_gen_batches=1, on_exhausted="error"), 0, idx)


@pytest.mark.parametrize("completion,truth,score", [
    ("... so the sum is 12.\nAnswer: 12", "12", 1.0),
    ("Answer: $\\boxed{\\frac{3}{4}}$.", "\\frac{3}{4}", 1.0),
    ("Answer: \\dfrac{3}{4}", "\\frac{3}{4}", 1.0),
    ("Answer: 1,000 dollars", "1000", 1.0),
    ("Answer: 72.0", "72", 1.0),
    ("Answer: 7\nwait, no.\nAnswer: 8", "8", 1.0),  # the last one counts
    ("Answer: 13", "12", -1.0),
    ("the answer is 12", "12", -1.0),  # no `Answer:` line
    ("", "12", -1.0),
])
def test_dapo_math_reward_by_hand(completion, truth, score):
    from hpc_rl.rewards.dapo_math import compute_score

    assert compute_score("p", completion, truth) == score


def test_mask_truncated_zeroes_only_the_truncated_samples():
    from hpc_rl.train.experience import without_truncated

    responses = [[5, 6, 7], [5, 2], [9]]
    assert without_truncated(responses, [True, False, False]) == [[0, 0, 0], [1, 1], [1]]
    # multi-turn masks (observations 0) are kept for the samples that are not truncated
    assert without_truncated(responses, [False, True, False], [[1, 0, 1], [1, 1], [0]]) == [[1, 0, 1], [0, 0], [0]]
    assert without_truncated(responses, [True, True, True]) == [[0, 0, 0], [0, 0], [0]]  # all truncated


def test_every_policy_loss_of_the_config_is_implemented():
    """The config's choices (algos/registry.py, no torch) and the implementations (algos/losses.py) are one set."""
    from hpc_rl.algos import losses, registry

    assert set(registry.POLICY_LOSSES) == set(losses.POLICY_LOSSES) == {"ppo", "cispo"}
