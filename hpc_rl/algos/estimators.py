"""Advantage estimators, one per entry of registry.ALGORITHMS, all with one signature:
`fn(x: AdvantageInputs, a: AlgorithmConfig) -> (advantages [B, T], returns [B, T] or None)`.

Each rank calls its estimator on its own shard of the step's samples; group baselines read the whole step's
scores (every rank has them), and whitening uses the global batch's statistics (an all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import AlgorithmConfig
from .advantages import broadcast_sequence_advantage, gae, grpo_advantages, reinforce_pp_advantages, rloo_advantages
from .registry import algorithm
from .utils import masked_whiten


@dataclass
class AdvantageInputs:
    """What an estimator may read, for this rank's shard of B samples with T response tokens."""

    all_scores: torch.Tensor  # [N] every sample's score this step, group by group (prompt i: rows i*G .. i*G+G-1)
    rows: torch.Tensor | slice  # this shard's rows of all_scores
    token_rewards: torch.Tensor  # [B, T] the score on the last response token, minus the KL penalty if in the reward
    values: torch.Tensor | None  # [B, T] the critic's values (algorithms with needs_critic)
    mask: torch.Tensor  # [B, T] 1 on response tokens
    # [N] the episode of each of the step's samples (0, 1, ... group by group; -1: a row that trains nothing), when an
    # agent's episode has several samples: group baselines compare episodes. None: each sample is an episode.
    episodes: torch.Tensor | None = None


def per_episode(fn, x: AdvantageInputs, group_size: int) -> torch.Tensor:
    """The sequence advantages [B] of this shard from `fn(scores [E], group_size)` over the step's episodes (each
    sample gets its episode's; the samples of an episode share its score), or over the samples themselves."""
    if x.episodes is None:
        return fn(x.all_scores, group_size)[x.rows]
    real = x.episodes >= 0
    scores = torch.zeros(int(x.episodes.max()) + 1, dtype=x.all_scores.dtype)
    scores[x.episodes[real]] = x.all_scores[real]
    adv = fn(scores, group_size)[x.episodes.clamp(min=0)]
    return torch.where(real, adv, torch.zeros_like(adv))[x.rows]


def gae_advantages(x: AdvantageInputs, a: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO: generalized advantage estimation over the critic's values (see advantages.gae for the formula),
    whitened over the global batch when algorithm.whiten_advantages. Schulman et al. 2015,
    https://arxiv.org/abs/1506.02438; verl's compute_gae_advantage_return
    (https://github.com/volcengine/verl/blob/main/verl/trainer/ppo/core_algos.py)."""
    adv, returns = gae(x.token_rewards, x.values, x.mask, a.gamma, a.lam)
    if a.whiten_advantages:
        adv = masked_whiten(adv, x.mask, distributed=True)
    return adv, returns


def group_normalized_advantages(x: AdvantageInputs, a: AlgorithmConfig) -> tuple[torch.Tensor, None]:
    """GRPO: A_i = (r_i - mean(group)) / (std(group) + eps) on every response token (norm_adv_by_std=false:
    r_i - mean, Dr. GRPO). Shao et al. 2024, https://arxiv.org/abs/2402.03300; Liu et al. 2025,
    https://arxiv.org/abs/2503.20783; verl's compute_grpo_outcome_advantage."""
    seq = per_episode(lambda s, g: grpo_advantages(s, g, a.norm_adv_by_std), x, a.group_size)
    return broadcast_sequence_advantage(seq.to(x.mask.device), x.mask), None


def leave_one_out_advantages(x: AdvantageInputs, a: AlgorithmConfig) -> tuple[torch.Tensor, None]:
    """RLOO: A_i = r_i - mean of the other G-1 samples of its group, on every response token. Ahmadian et al.
    2024, https://arxiv.org/abs/2402.14740; verl's compute_rloo_outcome_advantage."""
    seq = per_episode(rloo_advantages, x, a.group_size)
    return broadcast_sequence_advantage(seq.to(x.mask.device), x.mask), None


def reinforce_pp_token_advantages(x: AdvantageInputs, a: AlgorithmConfig) -> tuple[torch.Tensor, None]:
    """REINFORCE++: discounted returns-to-go of the per-token rewards, whitened over the global batch. Hu 2025,
    https://arxiv.org/abs/2501.03262; OpenRLHF's REINFORCE++ advantage."""
    return reinforce_pp_advantages(x.token_rewards, x.mask, a.gamma, distributed=True), None


def compute_advantages(x: AdvantageInputs, a: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The advantages (and returns, for a critic) of algorithm.name, through the registry."""
    return globals()[algorithm(a.name).estimator](x, a)
