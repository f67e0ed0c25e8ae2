"""KL estimators between the policy and the reference model, KL coefficient controllers, KL-in-reward."""

from __future__ import annotations

import torch

from .registry import KL_CLAMP_DEFAULT, KL_ESTIMATOR_NAMES
from .utils import LOG_RATIO_CLAMP

KL_KINDS = KL_ESTIMATOR_NAMES


def k3(x: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 term exp(x) - x - 1 of a log-ratio x, as expm1(x) - x: >= 0 also in floating point (exp(x) - 1
    rounds to a negative value for x ~ -1e-16)."""
    return (torch.expm1(x) - x).clamp(min=0.0)


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3",
                clamp: float | None = KL_CLAMP_DEFAULT) -> torch.Tensor:
    """Per-token estimate of KL(policy || ref) from samples of the policy (Schulman's k1/k2/k3, and |k1|).

    k1 = logp - ref (unbiased, can be negative); abs = |logp - ref|; k2 = 0.5 * (logp - ref)^2; k3 = exp(ref - logp)
    - (ref - logp) - 1 (unbiased, low variance, always >= 0), at most `clamp` (None: unclamped).
    http://joschu.net/blog/kl-approx.html. A trailing "+" (k3+): the value of the estimator with the gradient of
    k2, the one whose expected gradient is KL's (straight-through; Liu et al. 2025, https://arxiv.org/abs/2505.17508;
    as verl's kl_penalty, https://github.com/volcengine/verl/blob/main/verl/trainer/ppo/core_algos.py).
    """
    base = kind[:-1] if kind.endswith("+") else kind
    log_ratio = logprobs - ref_logprobs
    if base == "k1":
        value = log_ratio
    elif base == "abs":
        value = log_ratio.abs()
    elif base == "k2":
        value = 0.5 * log_ratio**2
    elif base == "k3":
        value = k3((-log_ratio).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        if clamp is not None:
            value = value.clamp(max=clamp)
    else:
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KL_KINDS}")
    if base == kind or base == "k2":
        return value
    k2 = 0.5 * log_ratio**2
    return k2 - k2.detach() + value.detach()


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, coef: float):
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient: steers the observed KL toward target (Ziegler et al. 2019,
    https://arxiv.org/abs/1909.08593; as TRL's and verl's AdaptiveKLController)."""

    def __init__(self, init_coef: float, target: float, horizon: int):
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """value *= 1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon."""
        err = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        # Only the coefficient is run state; target/horizon come from the (possibly edited) job spec.
        self.value = float(state["value"])


def make_kl_controller(kl_cfg) -> FixedKLController | AdaptiveKLController:
    """Controller for an hpc_rl.config.KLConfig: adaptive when kl_cfg.adaptive, else fixed at kl_cfg.coef."""
    if kl_cfg.adaptive:
        return AdaptiveKLController(kl_cfg.coef, kl_cfg.target, kl_cfg.horizon)
    return FixedKLController(kl_cfg.coef)


@torch.no_grad()
def apply_kl_to_rewards(
    scores: torch.Tensor, kl_per_token: torch.Tensor, mask: torch.Tensor, coef: float
) -> torch.Tensor:
    """PPO "KL in reward": -coef * kl on every response token, plus the sequence score on the last one.

    scores [B], kl_per_token/mask [B, T] -> token_rewards [B, T]. A row with no valid token gets no
    score (there is no token to put it on). Ziegler et al. 2019, https://arxiv.org/abs/1909.08593; as verl's
    apply_kl_penalty and OpenRLHF's compute_reward.
    """
    m = mask.to(torch.bool)
    rewards = torch.where(m, -coef * kl_per_token, torch.zeros_like(kl_per_token))
    T = m.shape[1]
    has_tokens = m.any(dim=1)
    # Index of the last True per row: flip, argmax finds the first True from the right.
    last = (T - 1) - torch.flip(m, dims=[1]).to(torch.int8).argmax(dim=1)
    rows = torch.nonzero(has_tokens).squeeze(1)
    rewards[rows, last[rows]] += scores[rows].to(rewards.dtype)
    return rewards
