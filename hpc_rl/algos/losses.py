"""Policy/value losses, loss aggregation, and log-prob/entropy helpers over logits."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..config import AlgorithmConfig
from .kl import k3, kl_estimate
from .registry import LOSS_AGGREGATIONS
from .utils import LOG_RATIO_CLAMP, masked_mean

AGG_MODES = tuple(LOSS_AGGREGATIONS)
# Modes that count each sequence once (their micro-batch share is a share of rows, not of tokens).
_PER_SEQUENCE = tuple(m for m in AGG_MODES if m.startswith("seq_"))


def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token_mean", norm: float | None = None) -> torch.Tensor:
    """Reduce a [B, T] loss to a scalar (verl's agg_loss; names in algos/registry.py LOSS_AGGREGATIONS).

    token_mean: sum over all valid tokens / their count (DAPO, https://arxiv.org/abs/2503.14476). token_sum: the sum
    over valid tokens. The seq_ modes reduce each row, then take the mean over rows that have at least one valid
    token (empty rows are skipped, not counted as 0): seq_mean, each row's token mean; seq_mean_token_sum, each row's
    token sum; seq_mean_token_sum_norm, each row's token sum / `norm`, a constant (Dr. GRPO's "divide by the
    generation budget", https://arxiv.org/abs/2503.20783: no bias toward long or short answers).
    """
    m = mask.to(loss_mat.dtype)
    if mode == "token_mean":
        return masked_mean(loss_mat, mask)
    if mode == "token_sum":
        return (loss_mat * m).sum()
    if mode in _PER_SEQUENCE:
        if mode == "seq_mean":
            per_seq = masked_mean(loss_mat, mask, dim=-1)
        else:
            per_seq = (loss_mat * m).sum(-1)
            if mode == "seq_mean_token_sum_norm":
                if norm is None or norm <= 0:
                    raise ValueError(f"loss aggregation {mode} needs a positive constant norm; got {norm!r}")
                per_seq = per_seq / norm
        has_tokens = (m != 0).any(dim=-1).to(loss_mat.dtype)
        return masked_mean(per_seq, has_tokens)
    raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGG_MODES}")


def aggregate_count(mask: torch.Tensor, mode: str) -> float:
    """What a loss aggregation divides by: valid tokens (token_mean), rows with tokens (the per-sequence modes),
    nothing (token_sum: 0)."""
    if mode == "token_mean":
        return float(mask.sum())
    if mode in _PER_SEQUENCE:
        return float((mask != 0).any(-1).sum())
    if mode == "token_sum":
        return 0.0
    raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGG_MODES}")


def micro_batch_weight(micro_mask: torch.Tensor, whole: float, mode: str = "token_mean", ranks: int = 1) -> float:
    """The factor that turns a micro-batch's aggregate into its share of the mini-batch's aggregate over all ranks.

    `whole`: the mini-batch's aggregate_count summed over the `ranks` data-parallel ranks. token_mean: ranks x its
    valid tokens / whole; the per-sequence modes: ranks x its rows with tokens / whole; token_sum: ranks. DeepSpeed
    averages the ranks' gradients, hence the factor `ranks`. The weighted micro-batch losses of all ranks then sum to
    the loss of the whole mini-batch however it is cut over ranks and micro-batches (as verl's loss_scale_factor
    with dynamic batch sizes and its global token count), instead of a mean of per-rank or per-micro-batch means:
    a run takes the same optimizer steps at any number of ranks.
    """
    if mode == "token_sum":
        return float(ranks)
    return ranks * aggregate_count(micro_mask, mode) / whole if whole > 0 else 0.0


def _float(x: torch.Tensor) -> float:
    return float(x.detach().float().item())


# The policy losses algorithm.policy_loss names: fn(log_ratio, logprobs, advantages, clip_low, clip_high, clip_c) ->
# (per-token loss, tokens whose ratio was clipped), as verl's POLICY_LOSS_REGISTRY without its config coupling.
POLICY_LOSSES: dict[str, Callable] = {}


def register_policy_loss(name: str) -> Callable:
    """Register a policy loss under `name` (algorithm.policy_loss)."""

    def deco(fn: Callable) -> Callable:
        POLICY_LOSSES[name] = fn
        return fn

    return deco


def dual_clip(loss: torch.Tensor, advantages: torch.Tensor, clip_c: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dual-clip PPO: where A < 0, the per-token loss is at most -A * clip_c, so a token whose ratio has grown far
    (r > clip_c) while its advantage is negative stops pushing (Ye et al. 2020, https://arxiv.org/abs/1912.09729;
    verl's clip_ratio_c). Returns the loss and the tokens where the bound holds it (None: no bound)."""
    if clip_c is None:
        return loss, torch.zeros_like(loss, dtype=torch.bool)
    bound = -advantages * clip_c
    held = (advantages < 0) & (loss > bound)
    return torch.where(held, bound, loss), held


@register_policy_loss("ppo")
def ppo_clip_loss(log_ratio: torch.Tensor, logprobs: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                  clip_high: float, clip_c: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate max(-A*r, -A*clip(r, 1-clip_low, 1+clip_high)) per token; r = exp(log_ratio); with
    clip_c, dual-clipped for A < 0 (dual_clip). Schulman et al. 2017, https://arxiv.org/abs/1707.06347; clip-higher:
    DAPO, https://arxiv.org/abs/2503.14476."""
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss, held = dual_clip(torch.maximum(unclipped, clipped), advantages, clip_c)
    return loss, (clipped > unclipped) | held


@register_policy_loss("cispo")
def cispo_loss(log_ratio: torch.Tensor, logprobs: torch.Tensor, advantages: torch.Tensor, clip_low: float,
               clip_high: float, clip_c: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO: -sg(clip(r, 1-clip_low, 1+clip_high)) * A * log pi per token: the importance weight is clipped, not the
    update, so every token keeps its gradient (at r = 1 it is PPO's); clip_c does not apply (the weight is bounded
    already). MiniMax-M1 eq. 4, https://arxiv.org/abs/2506.13585; as verl's compute_policy_loss_cispo
    (https://github.com/volcengine/verl/blob/main/verl/trainer/ppo/core_algos.py)."""
    ratio = torch.exp(log_ratio).detach()
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return -weight * advantages * logprobs, (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)


def importance_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor,
                         level: str = "token") -> torch.Tensor:
    """log(pi / pi_old) per valid token (0 on padding), clamped. level "sequence": GSPO's length-normalized sequence
    ratio in its GSPO-token form, log s_i + log pi - sg(log pi): every token of a sequence has the value of
    log s_i = mean_t log(pi / pi_old) and the gradient of its own log-prob (Zheng et al. 2025, eq. 13,
    https://arxiv.org/abs/2507.18071; as verl's compute_policy_loss_gspo)."""
    m = mask.to(torch.bool)
    log_ratio = torch.where(m, logprobs - old_logprobs, torch.zeros_like(logprobs))
    if level == "sequence":
        per_seq = log_ratio.sum(-1) / m.sum(-1).clamp(min=1)
        log_ratio = logprobs - logprobs.detach() + per_seq.detach().unsqueeze(-1)
        log_ratio = torch.where(m, log_ratio, torch.zeros_like(log_ratio))
    elif level != "token":
        raise ValueError(f"unknown ratio level {level!r}; expected token or sequence")
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio: float,
    agg: str = "token_mean",
    clip_ratio_high: float | None = None,
    is_weights: torch.Tensor | None = None,
    loss: str = "ppo",
    ratio_level: str = "token",
    clip_ratio_c: float | None = None,
    agg_norm: float | None = None,
) -> tuple[torch.Tensor, dict]:
    """The policy loss `loss` (POLICY_LOSSES: ppo, cispo) on the `ratio_level` importance ratio (token, or GSPO's
    sequence ratio), times per-token off-policy weights w (algos.correction.truncated_is_weights; 1 when None),
    aggregated by `agg` (aggregate; agg_norm: the constant of seq_mean_token_sum_norm). clip_ratio_high (DAPO
    "clip-higher") defaults to clip_ratio; clip_ratio_c: dual-clip bound for negative advantages (None: off).

    stats: clipfrac (share of valid tokens whose ratio was clipped: for ppo, where the clipped term is the larger
    one or the dual clip holds it, i.e. the gradient is cut), approx_kl (k3 estimator of KL(old || new) from the token ratios: mean of
    (r - 1) - log r, always >= 0, as CleanRL's ppo.py), ratio_mean (mean ratio used over valid tokens).
    """
    hi = clip_ratio if clip_ratio_high is None else clip_ratio_high
    m = mask.to(torch.bool)
    log_ratio = importance_log_ratio(logprobs, old_logprobs, mask, ratio_level)
    # Zero padding advantages: a NaN there would otherwise turn into NaN gradients through where().
    advantages = torch.where(m, advantages, torch.zeros_like(advantages))
    per_token, was_clipped = POLICY_LOSSES[loss](log_ratio, logprobs, advantages, clip_ratio, hi, clip_ratio_c)
    if is_weights is not None:
        per_token = per_token * is_weights
    out = aggregate(per_token, mask, agg, agg_norm)
    with torch.no_grad():
        token_lr = log_ratio if ratio_level == "token" else importance_log_ratio(logprobs, old_logprobs, mask)
        stats = {
            "clipfrac": _float(masked_mean(was_clipped.to(logprobs.dtype), mask)),
            "approx_kl": _float(masked_mean(k3(token_lr), mask)),
            "ratio_mean": _float(masked_mean(torch.exp(log_ratio), mask)),
        }
    return out, stats


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
    """The actor's loss on one micro-batch: policy_loss (algorithm.policy_loss on the algorithm.ratio level, clip_ratio,
    clip_ratio_high) - entropy_coef * entropy
    + kl_coef * KL(policy || reference) when ref_logprobs is given (the KL as a loss term, as GRPO does:
    https://arxiv.org/abs/2402.03300), each aggregated by algorithm.loss_agg; is_weights go to policy_loss.
    stats: policy_loss, entropy, kl_loss (with a reference), and policy_loss's."""
    pg, stats = policy_loss(logprobs, old_logprobs, advantages, mask, a.clip_ratio, a.loss_agg, a.clip_ratio_high,
                            is_weights, a.policy_loss, a.ratio, a.clip_ratio_c, a.loss_agg_norm)
    loss = pg
    ent = aggregate(entropy, mask, a.loss_agg, a.loss_agg_norm)
    if a.entropy_coef:
        loss = loss - a.entropy_coef * ent
    if ref_logprobs is not None:
        kl_loss = aggregate(kl_estimate(logprobs, ref_logprobs, a.kl.estimator, a.kl.clamp), mask, a.loss_agg,
                            a.loss_agg_norm)
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
    agg_norm: float | None = None,
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
    loss = 0.5 * aggregate(torch.maximum(err, err_clipped), mask, agg, agg_norm)
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
    """log softmax(logits)[labels] per token; [B, T, V], [B, T] -> [B, T] (or labels [B, T, C] -> [B, T, C]: C
    tokens per position).

    Computed as z[label] - logsumexp(z), which never materializes the full [B, T, V] log-softmax.
    Half-precision logits are upcast to float32 one row at a time to bound the extra memory.
    """
    several = labels.dim() == logits.dim()
    idx = labels.long() if several else labels.long().unsqueeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        out = logits.gather(-1, idx) - torch.logsumexp(logits, dim=-1, keepdim=True)
    else:
        rows = []
        for row_logits, row_idx in zip(logits, idx):
            z = row_logits.float()
            rows.append(z.gather(-1, row_idx) - torch.logsumexp(z, dim=-1, keepdim=True))
        out = torch.stack(rows)
    return out if several else out.squeeze(-1)
