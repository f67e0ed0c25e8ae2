"""The trainer's optimizer: AdamW, with the gradient-norm guard DeepSpeed lacks at ZeRO stage 0 in float32.

At stage 0 without bf16/fp16 DeepSpeed steps the client optimizer as it is: it neither checks the gradients for
inf/NaN (`was_step_applied()` stays true) nor reports their norm (`get_global_grad_norm()` is None), so one
non-finite gradient turns every weight into NaN. GuardedAdamW computes the global norm itself (the gradients are
already averaged over the ranks when DeepSpeed steps, so every rank decides alike), skips a non-finite step, clips,
and exposes `overflow` and `_global_grad_norm`, the attributes DeepSpeed's engine reads after `optimizer.step()`
(`engine._take_model_step`): a skipped step then counts in `skipped_steps`, leaves the LR schedule where it was,
and `was_step_applied()` is False, exactly as at stages 1-3.
"""

from __future__ import annotations

import math

import torch

from ..config import JobConfig


def guards_itself(cfg: JobConfig) -> bool:
    """Whether the optimizer must check and clip the gradient norm itself (stage 0, float32; DeepSpeed's fp16/bf16
    optimizers and its ZeRO 1-3 optimizers check it)."""
    return cfg.trainer.zero_stage == 0 and cfg.model.dtype == "float32"


class GuardedAdamW(torch.optim.AdamW):
    """AdamW that skips a step whose global gradient norm is not finite and clips the others to max_norm."""

    def __init__(self, params, max_norm: float, **kwargs):
        super().__init__(params, **kwargs)
        self.max_norm = max_norm
        self.overflow = False
        self._global_grad_norm: float | None = None

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not params:
            self.overflow, self._global_grad_norm = False, 0.0
            return super().step(closure)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad, dtype=torch.float32)
                                                     for p in params]))
        value = float(norm)
        self._global_grad_norm = value
        self.overflow = not math.isfinite(value)
        if self.overflow:
            return None  # DeepSpeed zeroes the gradients next and counts the step as skipped
        if self.max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.max_norm, norm)
        return super().step(closure)


def make_optimizer(model, lr: float, cfg: JobConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (trainer.betas, trainer.weight_decay); guarded where guards_itself."""
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = {"lr": lr, "betas": tuple(cfg.trainer.betas), "weight_decay": cfg.trainer.weight_decay}
    if guards_itself(cfg):
        return GuardedAdamW(params, max_norm=cfg.trainer.grad_clip, **kwargs)
    return torch.optim.AdamW(params, **kwargs)
