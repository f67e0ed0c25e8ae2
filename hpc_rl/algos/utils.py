"""Masked reductions over [B, T] tensors, and whitening with optional data-parallel statistics."""

from __future__ import annotations

import torch
import torch.distributed as dist

# Log-ratios are clamped before exp() so one wild token cannot overflow a ratio or k3 (verl does the same).
LOG_RATIO_CLAMP = 20.0


def _weights(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (x with masked positions zeroed, mask as x's dtype).

    Masked positions are replaced rather than multiplied by 0, so a -inf or NaN in padding
    (e.g. log-probs of pad tokens) cannot poison the sums.
    """
    m = mask.to(x.dtype)
    return torch.where(m != 0, x, torch.zeros((), dtype=x.dtype, device=x.device)), m


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of x weighted by mask (over all elements, or along dim)."""
    xz, m = _weights(x, mask)
    return (xz * m).sum() if dim is None else (xz * m).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over positions where mask != 0; 0 where nothing is unmasked (no NaN)."""
    xz, m = _weights(x, mask)
    s = (xz * m).sum() if dim is None else (xz * m).sum(dim)
    n = m.sum() if dim is None else m.sum(dim)
    # clamp only keeps the division finite; torch.where then returns 0 for empty rows.
    return torch.where(n > 0, s / n.clamp_min(torch.finfo(x.dtype).tiny), torch.zeros_like(s))


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of x over unmasked positions (Bessel-corrected by default, as verl does)."""
    s, n, ss = _moments(x, mask)
    return _var_from_moments(s, n, ss, unbiased).to(x.dtype)


def _moments(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum, count, sum of squares) over unmasked positions, in float64 for stable variance."""
    xz, m = _weights(x.detach().double(), mask)
    return (xz * m).sum(), m.sum(), (xz * xz * m).sum()


def _var_from_moments(s: torch.Tensor, n: torch.Tensor, ss: torch.Tensor, unbiased: bool) -> torch.Tensor:
    mean = s / n.clamp_min(1e-12)
    denom = n - 1 if unbiased else n
    # Fewer than two samples: no spread to measure, report 0 instead of dividing by <= 0.
    var = torch.where(denom > 0, (ss - n * mean * mean) / denom.clamp_min(1e-12), torch.zeros_like(s))
    return var.clamp_min(0.0)  # sumsq - n*mean^2 can dip a hair below 0 in float


def _use_distributed(distributed: bool) -> bool:
    return distributed and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    distributed: bool = False,
    group=None,
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over unmasked positions; masked positions come out 0.

    var is the unbiased (Bessel) variance, as in verl. With distributed=True and torch.distributed
    initialized, sum/count/sumsq are all-reduced over `group`, so every rank whitens with the
    statistics of the global batch. shift_mean=False rescales but adds the mean back.
    Statistics are treated as constants (no gradient flows through them).
    """
    s, n, ss = _moments(x, mask)
    if _use_distributed(distributed):
        stats = torch.stack([s, n, ss])
        # gloo and NCCL both reduce float64; keep it on x's device (NCCL needs CUDA tensors).
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
        s, n, ss = stats.unbind(0)
    mean = torch.where(n > 0, s / n.clamp_min(1e-12), torch.zeros_like(s))
    var = _var_from_moments(s, n, ss, unbiased=True)
    rstd = torch.rsqrt(var + eps)
    mean, rstd = mean.to(x.dtype), rstd.to(x.dtype)
    out = (x - mean) * rstd
    if not shift_mean:
        out = out + mean
    m = mask.to(torch.bool) if mask.dtype == torch.bool else mask != 0
    return torch.where(m, out, torch.zeros((), dtype=out.dtype, device=out.device))
