"""Advantage estimators: GAE (PPO), group-normalized (GRPO), RLOO, REINFORCE++.

Per-token tensors are [B, T] over the response tokens, right-padded: mask is 1...1 0...0.
Advantages are computed without gradient; masked positions come out 0.
"""

from __future__ import annotations

import torch

from .utils import masked_whiten


def _zero_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.to(torch.bool), x, torch.zeros((), dtype=x.dtype, device=x.device))


@torch.no_grad()
def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation; returns (advantages, returns = advantages + values).

    delta_t = r_t + gamma * V_{t+1} - V_t, A_t = delta_t + gamma * lam * A_{t+1}; the value after
    the last valid token is 0 (the episode ends there). Not whitened: callers whiten (masked_whiten)
    when algorithm.whiten_advantages is set, so they can do it over the global batch.
    Schulman et al. 2015, https://arxiv.org/abs/1506.02438; as verl's compute_gae_advantage_return
    (https://github.com/volcengine/verl/blob/main/verl/trainer/ppo/core_algos.py).
    """
    r = _zero_masked(token_rewards, mask)
    v = _zero_masked(values, mask)
    m = mask.to(torch.bool)
    T = r.shape[1]
    adv = torch.zeros_like(r)
    last = torch.zeros_like(r[:, 0])
    next_v = torch.zeros_like(last)
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_v - v[:, t]
        # Masked tokens (padding; the observations inside a multi-turn sample) are skipped: the token before an
        # observation bootstraps from the next trained token's value, as verl's multi-turn GAE does.
        last = torch.where(m[:, t], delta + gamma * lam * last, last)
        next_v = torch.where(m[:, t], v[:, t], next_v)
        adv[:, t] = last
    adv = _zero_masked(adv, mask)
    return adv, _zero_masked(adv + v, mask)


def _groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D [B]; got shape {tuple(scores.shape)}")
    if group_size < 1 or scores.numel() % group_size != 0:
        raise ValueError(f"batch of {scores.numel()} scores is not a whole number of groups of {group_size}")
    return scores.reshape(-1, group_size)


@torch.no_grad()
def grpo_advantages(
    scores: torch.Tensor, group_size: int, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-normalized advantages: (r - group mean) / (group std + eps), per sample [B].

    Rows are laid out group by group (prompt i's samples at rows i*G..i*G+G-1). std is
    torch.std, i.e. unbiased (Bessel), as in verl. norm_by_std=False gives r - mean (Dr. GRPO).
    A group whose rewards are all equal gets exactly 0 (not float noise / eps); a group of
    one sample keeps its score (mean 0, std 1), as verl does.
    Shao et al. 2024 (DeepSeekMath), https://arxiv.org/abs/2402.03300; without std: Liu et al. 2025,
    https://arxiv.org/abs/2503.20783; verl's compute_grpo_outcome_advantage.
    """
    g = _groups(scores, group_size)
    if group_size == 1:
        return g.reshape(-1).clone()
    centered = g - g.mean(dim=1, keepdim=True)
    if norm_by_std:
        centered = centered / (g.std(dim=1, keepdim=True) + eps)
    same = (g.amax(dim=1, keepdim=True) == g.amin(dim=1, keepdim=True))
    return torch.where(same, torch.zeros_like(centered), centered).reshape(-1)


@torch.no_grad()
def rloo_advantages(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out: A_i = r_i - (sum_j r_j - r_i) / (G - 1) over its group, [B].

    Kool et al. 2019, https://openreview.net/forum?id=r1lgTGL5DE; Ahmadian et al. 2024,
    https://arxiv.org/abs/2402.14740; verl's compute_rloo_outcome_advantage.
    """
    if group_size < 2:
        raise ValueError(f"RLOO needs group_size >= 2 (a baseline from the other samples); got {group_size}")
    g = _groups(scores, group_size)
    others_mean = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    adv = g - others_mean
    same = (g.amax(dim=1, keepdim=True) == g.amin(dim=1, keepdim=True))
    return torch.where(same, torch.zeros_like(adv), adv).reshape(-1)


@torch.no_grad()
def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Returns-to-go G_t = r_t + gamma * G_{t+1} over the response tokens, [B, T] (Sutton & Barto, ch. 3:
    http://incompleteideas.net/book/the-book-2nd.html)."""
    r = _zero_masked(token_rewards, mask)
    m = mask.to(torch.bool)
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        running = torch.where(m[:, t], r[:, t] + gamma * running, running)  # observations are not steps
        out[:, t] = running
    return _zero_masked(out, mask)


@torch.no_grad()
def reinforce_pp_advantages(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    distributed: bool = False,
    group=None,
) -> torch.Tensor:
    """REINFORCE++: A_t = whiten(G_t), the discounted returns-to-go whitened over all valid tokens of the batch.

    Hu 2025, https://arxiv.org/abs/2501.03262; OpenRLHF's REINFORCE++ (https://github.com/OpenRLHF/OpenRLHF).

    distributed=True whitens with global-batch statistics across torch.distributed ranks.
    """
    returns = discounted_returns(token_rewards, mask, gamma)
    return masked_whiten(returns, mask, shift_mean=True, distributed=distributed, group=group)


def broadcast_sequence_advantage(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Give every response token of row i the sequence advantage adv[i]; [B] -> [B, T]."""
    return _zero_masked(adv.unsqueeze(1).expand(mask.shape).to(adv.dtype), mask)
