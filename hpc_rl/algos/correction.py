"""Off-policy correction between the rollout engine's policy and the trainer's (truncated importance sampling)."""

from __future__ import annotations

import torch

from .utils import LOG_RATIO_CLAMP, masked_mean


def truncated_is_weights(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
                         cap: float) -> tuple[torch.Tensor, dict]:
    """Per-token w = min(exp(proximal - behaviour), cap), 0 on padding; no gradient flows through w.

    `behaviour` is the policy that sampled the tokens (the rollout engine's log-probs, possibly some versions
    old and in another precision), `proximal` the trainer's recomputed log-probs of its current weights, which
    is also the PPO ratio's denominator ("decoupled PPO"): the clipped surrogate keeps updates near the
    proximal policy while w corrects for sampling from the behaviour policy. Truncation at `cap` bounds the
    variance (TIS).
    Decoupled PPO: Fu et al. 2025 (AReaL), https://arxiv.org/abs/2505.24298; TIS: Yao et al. 2025,
    https://fengyao.notion.site/off-policy-rl; verl's rollout correction,
    https://github.com/volcengine/verl/blob/main/docs/algo/rollout_corr.md.
    stats: tis_weight_mean / tis_weight_max (before truncation, over valid tokens), tis_truncated_frac.
    """
    m = mask.to(torch.bool)
    with torch.no_grad():
        log_w = torch.where(m, proximal_logprobs - behaviour_logprobs, torch.zeros_like(proximal_logprobs))
        raw = torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        w = torch.where(m, raw.clamp(max=cap), torch.zeros_like(raw))
        valid = raw[m]
        stats = {
            "tis_weight_mean": float(valid.mean()) if valid.numel() else 1.0,
            "tis_weight_max": float(valid.max()) if valid.numel() else 1.0,
            "tis_truncated_frac": float(masked_mean((raw > cap).to(raw.dtype), mask)),
        }
    return w, stats
