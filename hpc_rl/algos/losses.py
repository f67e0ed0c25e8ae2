"""Policy/value losses, loss aggregation, and log-prob/entropy helpers over logits."""

from __future__ import annotations

import torch

from ..config import AlgorithmConfig
from .kl import kl_estimate
from .utils import LOG_RATIO_CLAMP, masked_mean

AGG_MODES = ("token_mean", "seq_mean")


def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token_mean") -> torch.Tensor:
    """Reduce a [B, T] loss to a scalar.

    token_mean: sum over all valid tokens / their count. seq_mean: each row's token mean, then the
    mean over rows that have at least one valid token (empty rows are skipped, not counted as 0).
    verl's agg_loss (token-mean / seq-mean-token-mean); why token_mean: DAPO, https://arxiv.org/abs/2503.14476.
    """
    if mode == "token_mean":
        return masked_mean(loss_mat, mask)
    if mode == "seq_mean":
        per_seq = masked_mean(loss_mat, mask, dim=-1)
        has_tokens = (mask.to(loss_mat.dtype) != 0).any(dim=-1).to(loss_mat.dtype)
        return masked_mean(per_seq, has_tokens)
    raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGG_MODES}")


def micro_batch_weight(micro_mask: torch.Tensor, mini_batch_mask: torch.Tensor, mode: str = "token_mean") -> float:
    """The factor that turns a micro-batch's aggregate into its share of the mini-batch's aggregate.

    token_mean: its valid tokens / the mini-batch's; seq_mean: its rows with tokens / the mini-batch's. The
    weighted micro-batch losses then sum to the loss of the whole mini-batch however it is cut (as verl's
    loss_scale_factor with dynamic batch sizes), instead of a mean of micro-batch means.
    """
    if mode == "token_mean":
        part, whole = micro_mask.sum(), mini_batch_mask.sum()
    elif mode == "seq_mean":
        part, whole = (micro_mask != 0).any(-1).sum(), (mini_batch_mask != 0).any(-1).sum()
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGG_MODES}")
    return float(part) / float(whole) if float(whole) > 0 else 0.0


def _float(x: torch.Tensor) -> float:
    return float(x.detach().float().item())


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio: float,
    agg: str = "token_mean",
    clip_ratio_high: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """PPO clipped surrogate: w * max(-A*r, -A*clip(r, 1-eps_lo, 1+eps_hi)) aggregated over valid tokens.

    r = exp(logprobs - old_logprobs). clip_ratio_high (DAPO "clip-higher") defaults to clip_ratio. w: per-token
    off-policy weights (algos.correction.truncated_is_weights), 1 when None.
    stats: clipfrac (share of valid tokens where the clipped term is the larger one, i.e. the
    gradient is cut), approx_kl (k3 estimator of KL(old || new): mean of (r - 1) - log r, always
    >= 0, as in CleanRL/SB3), ratio_mean (mean r over valid tokens).
    Schulman et al. 2017, https://arxiv.org/abs/1707.06347; clip-higher: Yu et al. 2025 (DAPO),
    https://arxiv.org/abs/2503.14476; approx_kl as CleanRL's ppo.py (https://github.com/vwxyzjn/cleanrl).
    """
    hi = clip_ratio if clip_ratio_high is None else clip_ratio_high
    m = mask.to(torch.bool)
    log_ratio = torch.where(m, logprobs - old_logprobs, torch.zeros_like(logprobs))
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    # Zero padding advantages: a NaN there would otherwise turn into NaN gradients through where().
    advantages = torch.where(m, advantages, torch.zeros_like(advantages))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + hi)
    per_token = torch.maximum(unclipped, clipped)
    if is_weights is not None:
        per_token = per_token * is_weights
    loss = aggregate(per_token, mask, agg)
    with torch.no_grad():
        stats = {
            "clipfrac": _float(masked_mean((clipped > unclipped).to(logprobs.dtype), mask)),
            "approx_kl": _float(masked_mean(ratio - 1.0 - log_ratio, mask)),
            "ratio_mean": _float(masked_mean(ratio, mask)),
        }
    return loss, stats


def actor_loss(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    a: AlgorithmConfig,
    kl_coef: float,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """The actor's loss on one micro-batch: policy_loss (clip_ratio, clip_ratio_high) - entropy_coef * entropy
    + kl_coef * KL(policy || reference) when ref_logprobs is given (the KL as a loss term, as GRPO does:
    https://arxiv.org/abs/2402.03300), each aggregated by algorithm.loss_agg; is_weights go to policy_loss.
    stats: policy_loss, entropy, kl_loss (with a reference), and policy_loss's."""
    pg, stats = policy_loss(logprobs, old_logprobs, advantages, mask, a.clip_ratio, a.loss_agg, a.clip_ratio_high,
                            is_weights)
    loss = pg
    ent = aggregate(entropy, mask, a.loss_agg)
    if a.entropy_coef:
        loss = loss - a.entropy_coef * ent
    if ref_logprobs is not None:
        kl_loss = aggregate(kl_estimate(logprobs, ref_logprobs, a.kl.estimator), mask, a.loss_agg)
        loss = loss + kl_coef * kl_loss
        stats["kl_loss"] = _float(kl_loss)
    stats.update({"policy_loss": _float(pg), "entropy": _float(ent)})
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None,
    agg: str = "token_mean",
) -> tuple[torch.Tensor, dict]:
    """Clipped value loss 0.5 * max((v - R)^2, (clip(v, old - c, old + c) - R)^2).

    clip=None disables clipping. stats: vf_clipfrac (share of valid tokens where the clipped
    error is larger), value_mean (mean predicted value over valid tokens).
    As verl's compute_value_loss (https://github.com/volcengine/verl/blob/main/verl/trainer/ppo/core_algos.py)
    and OpenAI baselines' PPO2 (https://github.com/openai/baselines/blob/master/baselines/ppo2/model.py).
    """
    m = mask.to(torch.bool)
    # Padding targets may hold anything; zero them so no NaN/inf reaches the gradient.
    returns = torch.where(m, returns, torch.zeros_like(returns))
    old_values = torch.where(m, old_values, torch.zeros_like(old_values))
    err = (values - returns) ** 2
    if clip is None:
        err_clipped = err
    else:
        v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        err_clipped = (v_clipped - returns) ** 2
    loss = 0.5 * aggregate(torch.maximum(err, err_clipped), mask, agg)
    with torch.no_grad():
        stats = {
            "vf_clipfrac": _float(masked_mean((err_clipped > err).to(values.dtype), mask)),
            "value_mean": _float(masked_mean(values, mask)),
        }
    return loss, stats


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) along the last dim: logsumexp(z) - sum(p * z); [B, T, V] -> [B, T].

    Max-shifted, so large logits neither overflow nor lose precision; vocab entries at -inf contribute 0.
    """
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    # Shift by the row max: lse and sum(p*z) are then O(1), so their difference keeps its precision.
    z = z - z.amax(dim=-1, keepdim=True).detach()
    lse = torch.logsumexp(z, dim=-1)
    p = torch.softmax(z, dim=-1)
    # Replace z (not p*z) where p == 0: p * (-inf) would give NaN in the forward or backward pass.
    z_safe = torch.where(p > 0, z, torch.zeros((), dtype=z.dtype, device=z.device))
    return lse - (p * z_safe).sum(dim=-1)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[labels] per token; [B, T, V], [B, T] -> [B, T].

    Computed as z[label] - logsumexp(z), which never materializes the full [B, T, V] log-softmax.
    Half-precision logits are upcast to float32 one row at a time to bound the extra memory.
    """
    idx = labels.long().unsqueeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        return logits.gather(-1, idx).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    rows = []
    for row_logits, row_idx in zip(logits, idx):
        z = row_logits.float()
        rows.append(z.gather(-1, row_idx).squeeze(-1) - torch.logsumexp(z, dim=-1))
    return torch.stack(rows)
