"""Reward shaping and sample selection of the reasoning-RL recipes: DAPO's soft overlong punishment and the
reward-spread test of its dynamic sampling."""

from __future__ import annotations

import numpy as np


def overlong_penalty(lengths, budget: int, buffer_tokens: int, penalty: float = 1.0) -> np.ndarray:
    """DAPO's soft overlong punishment per sample: 0 up to budget - buffer_tokens tokens, then falling linearly to
    -penalty at `budget` tokens, -penalty beyond. Yu et al. 2025, eq. 13, https://arxiv.org/abs/2503.14476; as verl's
    overlong_buffer (https://github.com/volcengine/verl/blob/main/verl/workers/reward_manager/dapo.py)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    if buffer_tokens <= 0:
        return np.zeros_like(lengths)
    start = budget - buffer_tokens
    ramp = (start - lengths) / buffer_tokens  # 0 at start, -1 at the budget
    return penalty * np.where(lengths <= start, 0.0, np.maximum(ramp, -1.0))


def groups_with_spread(rewards, group_size: int, tol: float = 1e-9) -> np.ndarray:
    """For each group of `group_size` consecutive samples: whether its rewards differ (max - min > tol). A group
    whose rewards are all equal has zero advantage under GRPO/RLOO: DAPO's dynamic sampling drops it
    (Yu et al. 2025, eq. 11, https://arxiv.org/abs/2503.14476; verl's algorithm.filter_groups)."""
    r = np.asarray(rewards, dtype=np.float64).reshape(-1, group_size)
    return (r.max(axis=1) - r.min(axis=1)) > tol
