"""Metrics of one evaluation from per-sample scores: pass@k (unbiased), mean@k, reward mean.

pass@k is the unbiased estimator of Chen et al. 2021, "Evaluating Large Language Models Trained on Code"
(https://arxiv.org/abs/2107.03374, section 2.1): with n samples of a prompt of which c pass,
pass@k = 1 - C(n - c, k) / C(n, k), the chance that k of the n samples drawn without replacement hold a pass,
averaged over prompts. It is computed as a product (their numpy form) so that large n does not overflow.
"""

from __future__ import annotations

import numpy as np

from ..config import pass_k_values


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with `n` samples of which `c` pass (Chen et al. 2021, eq. 1)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def k_values(n: int) -> list[int]:
    """The k reported for n samples per prompt: 1, 2, 4, ... up to n, and n itself (config.pass_k_values: the
    config validates checkpoint.keep_best against the same names)."""
    return pass_k_values(n)


def eval_metrics(scores: list[list[float]], threshold: float) -> dict:
    """eval/ metrics of per-prompt sample scores (every prompt has the same number n of samples): reward_mean over
    all samples, mean@n (the mean of the prompts' sample means: reward_mean when n is equal), pass@k for k in
    k_values(n), a sample passing when its score >= threshold."""
    if not scores or not scores[0]:
        raise ValueError("eval_metrics needs at least one prompt with one sample")
    n = len(scores[0])
    if any(len(s) != n for s in scores):
        raise ValueError("eval_metrics: every prompt needs the same number of samples")
    arr = np.asarray(scores, dtype=np.float64)
    passed = (arr >= threshold).sum(axis=1)
    out = {"eval/reward_mean": float(arr.mean()), f"eval/mean@{n}": float(arr.mean(axis=1).mean())}
    for k in k_values(n):
        out[f"eval/pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in passed]))
    return out
