"""The algorithms hpc-rl trains with, and what each needs: one entry each, read by config validation and by
the trainer. Adding an algorithm is one estimator function in estimators.py and one entry here.

No torch here: the config (and so every CLI command) reads this table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Algorithm:
    """What the trainer and the config need to know of one RL algorithm."""

    name: str
    # The function of hpc_rl.algos.estimators that turns rewards (and values) into per-token advantages.
    estimator: str
    # A critic (value model) is built and trained: its values feed the estimator.
    needs_critic: bool = False
    # Where the KL penalty goes by default: into the per-token rewards (True) or into the loss (False).
    # algorithm.kl.in_reward overrides it where the estimator reads per-token rewards.
    kl_in_reward: bool = False
    # Advantages compare the samples of one prompt: group_size >= 2, computed over whole groups; the
    # estimator reads sequence scores only, so the KL penalty can only be a loss term.
    group_baseline: bool = False
    # What algorithm.norm_adv_by_std and algorithm.loss_agg are when the job does not set them.
    norm_adv_by_std: bool = True
    loss_agg: str = "token_mean"
    # Paper / reference implementation of the estimator.
    source: str = ""


ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (
    Algorithm("ppo", "gae_advantages", needs_critic=True, kl_in_reward=True,
              source="https://arxiv.org/abs/1506.02438 (GAE); https://arxiv.org/abs/1707.06347 (PPO)"),
    Algorithm("grpo", "group_normalized_advantages", group_baseline=True,
              source="https://arxiv.org/abs/2402.03300 (GRPO, DeepSeekMath); https://arxiv.org/abs/2503.20783 (Dr. GRPO)"),
    # Dr. GRPO (Liu et al. 2025): GRPO without either normalization that biases it: the group's std in the
    # advantage, and the response length in the loss (a token sum over a constant instead of a token mean).
    Algorithm("dr_grpo", "group_normalized_advantages", group_baseline=True, norm_adv_by_std=False,
              loss_agg="seq_mean_token_sum_norm", source="https://arxiv.org/abs/2503.20783 (Dr. GRPO, section 3.1)"),
    Algorithm("rloo", "leave_one_out_advantages", group_baseline=True,
              source="https://arxiv.org/abs/2402.14740 (RLOO, Ahmadian et al. 2024)"),
    Algorithm("reinforce_pp", "reinforce_pp_token_advantages", kl_in_reward=True,
              source="https://arxiv.org/abs/2501.03262 (REINFORCE++)"),
)}


def algorithm(name: str) -> Algorithm:
    """The registry entry of `name` (config validation has already checked that it exists)."""
    return ALGORITHMS[name]


@dataclass(frozen=True)
class PolicyLoss:
    """What the config needs to know of one policy loss (losses.py registers its function under the same name)."""

    name: str
    # algorithm.clip_ratio 1.0 is allowed and means no lower bound (CISPO's importance weight); otherwise the lower
    # clip must stay below 1 (a ratio clipped at 0 would make PPO's surrogate meaningless).
    clip_ratio_1_is_none: bool = False
    source: str = ""


POLICY_LOSSES: dict[str, PolicyLoss] = {p.name: p for p in (
    PolicyLoss("ppo", source="https://arxiv.org/abs/1707.06347"),
    PolicyLoss("cispo", clip_ratio_1_is_none=True, source="https://arxiv.org/abs/2506.13585 (MiniMax-M1)"),
)}


# How token losses become one number (algorithm.loss_agg), verl's loss_agg_mode names beside ours.
LOSS_AGGREGATIONS: dict[str, str] = {
    "token_mean": "token-mean",
    "seq_mean": "seq-mean-token-mean",
    "token_sum": "token-sum",
    "seq_mean_token_sum": "seq-mean-token-sum",
    "seq_mean_token_sum_norm": "seq-mean-token-sum-norm",
}

# Per-token KL estimators (algorithm.kl.estimator), verl's kl_penalty names beside ours; a trailing "+" (k1+, k2+,
# k3+, abs+) keeps the estimator's value and takes k2's gradient (verl's straight-through form).
KL_ESTIMATORS: dict[str, str] = {"k1": "kl", "k2": "mse", "k3": "low_var_kl", "abs": "abs"}
KL_ESTIMATOR_NAMES = tuple(KL_ESTIMATORS) + tuple(f"{k}+" for k in KL_ESTIMATORS)
# verl's clamp of the k3 estimate (low_var_kl): a log-ratio of 5 would otherwise put ~143 on one token.
KL_CLAMP_DEFAULT = 10.0
