"""Pure tensor functions: advantages, policy/value losses, KL estimators and controllers."""

from .advantages import (
    broadcast_sequence_advantage,
    discounted_returns,
    gae,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from .kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_to_rewards,
    kl_estimate,
    make_kl_controller,
)
from .losses import aggregate, entropy_from_logits, logprobs_from_logits, policy_loss, value_loss
from .utils import masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "aggregate",
    "apply_kl_to_rewards",
    "broadcast_sequence_advantage",
    "discounted_returns",
    "entropy_from_logits",
    "gae",
    "grpo_advantages",
    "kl_estimate",
    "logprobs_from_logits",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "value_loss",
]
