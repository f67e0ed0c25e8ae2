"""pass@k and the other evaluation metrics against hand-computed values and brute force."""

from __future__ import annotations

import itertools
import math

import pytest

from hpc_rl.eval.pass_at_k import eval_metrics, k_values, pass_at_k


def test_pass_at_k_by_hand():
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    # k=1 is the fraction of passing samples
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    # every draw of 4 from 5 holds one of the 2 passes
    assert pass_at_k(5, 2, 4) == 1.0
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6])
def test_pass_at_k_is_the_expectation_over_every_subset_of_k_samples(n):
    for c in range(n + 1):
        samples = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            brute = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_stays_finite_for_large_n():
    v = pass_at_k(1000, 1, 500)
    assert v == pytest.approx(0.5) and math.isfinite(v)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_k_values():
    assert k_values(1) == [1]
    assert k_values(4) == [1, 2, 4]
    assert k_values(6) == [1, 2, 4, 6]


def test_eval_metrics_by_hand():
    # two prompts, 4 samples each; threshold 1.0: prompt A passes 2 of 4, prompt B none (0.5 < 1.0)
    m = eval_metrics([[1.0, 0.0, 1.0, 0.0], [0.5, 0.5, 0.0, 0.0]], 1.0)
    assert m["eval/reward_mean"] == pytest.approx(3.0 / 8)
    assert m["eval/mean@4"] == pytest.approx((0.5 + 0.25) / 2)
    assert m["eval/pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert m["eval/pass@2"] == pytest.approx((1 - 1 / 6 + 0.0) / 2)  # 1 - C(2,2)/C(4,2)
    assert m["eval/pass@4"] == pytest.approx(0.5)
    assert set(m) == {"eval/reward_mean", "eval/mean@4", "eval/pass@1", "eval/pass@2", "eval/pass@4"}
    # a lower threshold lets 0.5 pass
    assert eval_metrics([[0.5]], 0.5)["eval/pass@1"] == 1.0
