"""The algorithm section: the advantage estimator and the losses, each a registry entry of hpc_rl/algos."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ..algos.registry import ALGORITHMS, KL_CLAMP_DEFAULT, KL_ESTIMATOR_NAMES, LOSS_AGGREGATIONS, POLICY_LOSSES, algorithm
from ..rollout.wire.protocol import MAX_TOP_K

if TYPE_CHECKING:
    from .job import JobConfig


@dataclass
class KLConfig:
    """The KL(policy || reference) penalty; a reference model is built only when coef > 0 or adaptive."""

    # KL coefficient beta (the initial one when adaptive).
    coef: float = 0.0
    # Per-token estimator (Schulman's k1/k2/k3, http://joschu.net/blog/kl-approx.html, and abs = |k1|; verl's kl, mse,
    # low_var_kl, abs). A trailing "+" (k3+): the estimator's value with k2's gradient, the unbiased one (verl's).
    estimator: KLEstimatorName = "k3"
    # k3's per-token value is at most this (verl clamps low_var_kl at 10); null: no clamp.
    clamp: float | None = KL_CLAMP_DEFAULT
    # Put the KL into the per-token rewards (true) or add it to the loss (false); null: the algorithm's
    # default (PPO and REINFORCE++: rewards; GRPO and RLOO: loss, the only place they allow).
    in_reward: bool | None = None
    # Steer coef toward `target` KL (Ziegler et al. 2019, https://arxiv.org/abs/1909.08593).
    adaptive: bool = False
    # KL the adaptive controller aims for.
    target: float = 0.1
    # Samples over which the adaptive controller moves coef by at most 20%.
    horizon: int = 10000


@dataclass
class DynamicSamplingConfig:
    """DAPO's dynamic sampling (https://arxiv.org/abs/2503.14476, verl's algorithm.filter_groups): groups whose
    rewards (the task's, without reward.overlong's penalty) are all equal teach nothing and are dropped; more
    prompts are generated until the step has trainer.prompts_per_step groups with a reward spread."""

    # Drop groups without a reward spread and generate more.
    enabled: bool = False
    # Generation rounds per step at most (the first included); each round asks for as many prompts as are missing.
    max_gen_batches: int = 4
    # When the rounds run out short of groups: warn (train on the groups there are, padded with dropped ones to
    # keep the batch size) or error (stop with a checkpoint).
    on_exhausted: Literal["warn", "error"] = "warn"


@dataclass
class DistillConfig:
    """On-policy distillation (https://thinkingmachines.ai/blog/on-policy-distillation/, verl's docs/algo/opd.md):
    the teacher (services.teacher) scores every sampled response token; the per-token reverse KL
    log pi_student - log pi_teacher, negated and times coef, is a per-token advantage (hpc_rl/algos/distill.py)."""

    # Weight of the distillation advantage; 0: off.
    coef: float = 0.0
    # The distillation advantage alone (the task reward is still computed and logged, e.g. as a monitor); false: it is
    # added to the algorithm's task-reward advantage.
    only: bool = False
    # What is subtracted from each token's reverse KL before it becomes an advantage. none: nothing (the sources'
    # formulation). position: the mean reverse KL of the other samples at the same response position (a leave-one-
    # out baseline per position, over the rank's samples): the expected gradient is unchanged and its variance
    # lower, since a wrong token's large reverse KL no longer dwarfs the right tokens' (the toy reaches its
    # criterion in 20 steps instead of 29). Suits answers whose positions line up across samples; on free-form text
    # it still reduces variance, less.
    baseline: Literal["none", "position"] = "none"
    # Also match the teacher's top k tokens at every sampled position (0: off; at most 64): the teacher returns its k
    # likeliest tokens and their log-probs there, and coef times the forward KL from that top-k distribution
    # (renormalized) to the student's log-probs of the same tokens is added to the loss (NeMo-RL's top-k
    # distillation). A dense signal: each position teaches k tokens' worth instead of the one sampled (the toy
    # reaches its criterion in 17 steps instead of 20 at the same lr, 13 at lr 2e-3, which it tolerates). Costs k ids
    # and log-probs per token on the wire and k extra log-probs of the output layer in the update.
    top_k: int = 0


KLEstimatorName = Literal[KL_ESTIMATOR_NAMES]  # noqa: PYI047 (checked at load)
LossAggName = Literal[tuple(LOSS_AGGREGATIONS)]  # noqa: PYI047 (checked at load)
# Supervised fine-tuning: next-token cross-entropy on a dataset's completions; no rollouts, no estimator.
SFT = "sft"
AlgorithmName = Literal[(*ALGORITHMS, SFT)]  # noqa: PYI047 (the registry's names and sft, checked at load)
PolicyLossName = Literal[tuple(POLICY_LOSSES)]  # noqa: PYI047 (the registry's names, checked at load)


@dataclass
class AlgorithmConfig:
    """The RL algorithm (see hpc_rl/algos/registry.py) and its loss settings."""

    # Advantage estimator and what it needs: ppo (GAE + critic), grpo, dr_grpo (GRPO without the std and the length
    # normalizations), rloo, reinforce_pp; or sft: supervised fine-tuning on data.source's completions (no rollout
    # servers; the keys below but loss_agg and loss_agg_norm do not apply).
    name: AlgorithmName = "grpo"
    # Samples generated per prompt (GRPO/RLOO compare them with each other).
    group_size: int = 8
    # Discount over response tokens (GAE, REINFORCE++).
    gamma: float = 1.0
    # GAE's lambda (PPO).
    lam: float = 0.95
    # PPO clip: the ratio is clipped to [1 - clip_ratio, 1 + clip_ratio].
    clip_ratio: float = 0.2
    # DAPO's decoupled upper clip (https://arxiv.org/abs/2503.14476): the ratio is clipped to
    # [1 - clip_ratio, 1 + clip_ratio_high]; null: the same as clip_ratio.
    clip_ratio_high: float | None = None
    # Dual-clip PPO (https://arxiv.org/abs/1912.09729, verl's clip_ratio_c): for a negative advantage the token's loss
    # is at most -A * clip_ratio_c, so a ratio far above 1 cannot push without bound; null: off. Policy loss ppo only.
    # verl applies 3.0 always; here it is off unless set, so that a job keeps its results across versions (3.0 changes
    # the LoRA toy's samples from its second step).
    clip_ratio_c: float | None = None
    # Clip of the critic's value change per update (PPO); null: no clipping.
    value_clip: float | None = 0.2
    # Weight of the value loss (PPO).
    value_coef: float = 0.5
    # Weight of the entropy bonus (0: none).
    entropy_coef: float = 0.0
    # How token losses become one number (verl's loss_agg_mode): token_mean (all valid tokens; DAPO), seq_mean (each
    # sequence's token mean, then the mean over sequences; verl's seq-mean-token-mean), token_sum,
    # seq_mean_token_sum, seq_mean_token_sum_norm (each sequence's token sum / loss_agg_norm, then the mean over
    # sequences: Dr. GRPO). null: the algorithm's (dr_grpo: seq_mean_token_sum_norm), seq_mean with ratio: sequence
    # (GSPO's), else token_mean.
    loss_agg: LossAggName | None = None
    # The constant that seq_mean_token_sum_norm divides each sequence's token sum by; null: the job's response budget
    # (rollout.max_new_tokens, or a multi-turn trajectory's), so the divisor never changes during the run.
    loss_agg_norm: float | None = None
    # GRPO: divide by the group's std; null: the algorithm's (dr_grpo: false, https://arxiv.org/abs/2503.20783).
    norm_adv_by_std: bool | None = None
    # PPO: whiten the GAE advantages over the whole batch.
    whiten_advantages: bool = True
    # Passes over the step's samples (each pass: all mini-batches).
    ppo_epochs: int = 1
    # Off-policy correction between the rollout engine's log-probs and the trainer's (algos/correction.py):
    # tis multiplies each token's policy loss by min(exp(trainer - engine), tis_cap); auto: tis when
    # rollout.async_steps > 0 (samples from older policies), else none.
    rollout_correction: Literal["auto", "none", "tis"] = "auto"
    # The truncation cap C of the importance weight (tis).
    tis_cap: float = 2.0
    # The KL penalty to the reference model.
    kl: KLConfig = field(default_factory=KLConfig)
    # The policy loss (algos/losses.py POLICY_LOSSES): ppo, the clipped surrogate; cispo, MiniMax-M1's clipped
    # importance-sampling weight (stop-gradient) x advantage x log-prob: every token keeps its gradient
    # (https://arxiv.org/abs/2506.13585). Its weight is clipped to [1 - clip_ratio, 1 + clip_ratio_high]; MiniMax-M1
    # sets no lower bound (clip_ratio: 1.0) and tunes the upper one only.
    policy_loss: PolicyLossName = "ppo"
    # The importance ratio: per token, or GSPO's length-normalized sequence ratio (https://arxiv.org/abs/2507.18071,
    # its GSPO-token form: every token's ratio has the sequence's value and its own gradient). GSPO's clip ranges
    # are about 1000x smaller than PPO's (the paper: clip_ratio 3e-4, clip_ratio_high 4e-4) and it averages per
    # sequence (loss_agg: seq_mean). Needs sequence-level advantages (grpo, rloo).
    ratio: Literal["token", "sequence"] = "token"
    # Leave truncated samples (no stop before the length budget) out of the loss (DAPO's overlong filtering, TRL's
    # mask_truncated_completions); they still count in their group's advantages.
    mask_truncated: bool = False
    # DAPO's dynamic sampling (groups with a reward spread only).
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    # On-policy distillation from services.teacher.
    distill: DistillConfig = field(default_factory=DistillConfig)

    def __post_init__(self):
        # The defaults that depend on the algorithm (the run's config.yaml then shows what ran).
        if self.name == SFT:
            self.loss_agg = self.loss_agg or "token_mean"
            return
        if self.name not in ALGORITHMS:  # the loader names the key; a direct construction keeps its value
            return
        entry = algorithm(self.name)
        if self.norm_adv_by_std is None:
            self.norm_adv_by_std = entry.norm_adv_by_std
        if self.loss_agg is None:
            self.loss_agg = "seq_mean" if self.ratio == "sequence" and entry.loss_agg == "token_mean" else entry.loss_agg

    @property
    def supervised(self) -> bool:
        """SFT: trained on the dataset's completions, nothing generated."""
        return self.name == SFT

    @property
    def uses_critic(self) -> bool:
        return not self.supervised and algorithm(self.name).needs_critic

    def correction(self, async_steps: int) -> str:
        """The rollout correction in effect ("none" or "tis"), resolving auto by the rollout mode."""
        if self.rollout_correction != "auto":
            return self.rollout_correction
        return "tis" if async_steps > 0 else "none"

    @property
    def kl_in_reward(self) -> bool:
        if self.kl.in_reward is not None:
            return self.kl.in_reward
        return not self.supervised and algorithm(self.name).kl_in_reward


def check(cfg: JobConfig, need) -> None:
    a = cfg.algorithm
    if a.supervised:
        check_sft(cfg, need)
        return
    if a.loss_agg == "seq_mean_token_sum_norm" and a.loss_agg_norm is None:
        a.loss_agg_norm = float(cfg.response_budget)  # a constant of the job, shown in the run's config.yaml
    need(a.group_size >= 1, "algorithm.group_size must be >= 1")
    if algorithm(a.name).group_baseline:
        need(a.group_size >= 2, f"algorithm.group_size must be >= 2 for {a.name} "
             f"(advantages compare samples of the same prompt); got {a.group_size}")
        need(a.kl.in_reward is not True, f"algorithm.kl.in_reward: {a.name} computes advantages from whole-sequence "
             "scores, so the KL penalty cannot go into per-token rewards; use algorithm.kl.in_reward: false (a loss term)")
    if POLICY_LOSSES[a.policy_loss].clip_ratio_1_is_none:  # 1.0: no lower bound on the importance weight
        need(0 < a.clip_ratio <= 1, f"algorithm.clip_ratio must be in (0, 1] with {a.policy_loss}; got {a.clip_ratio}")
    else:
        need(0 < a.clip_ratio < 1, f"algorithm.clip_ratio must be in (0, 1); got {a.clip_ratio}")
    if a.ratio == "sequence":
        need(algorithm(a.name).group_baseline,
             f"algorithm.ratio: sequence (GSPO) weighs whole sequences, so it needs one advantage per sequence (grpo, "
             f"rloo); {a.name} gives per-token advantages: use algorithm.ratio: token, or algorithm.name: grpo")
    ds = a.dynamic_sampling
    if ds.enabled:
        need(ds.max_gen_batches >= 1, f"algorithm.dynamic_sampling.max_gen_batches must be >= 1 (generation rounds per "
             f"step, the first included); got {ds.max_gen_batches}")
        need(a.group_size >= 2, "algorithm.dynamic_sampling needs groups: algorithm.group_size >= 2 (a group of one "
             f"never has a reward spread); got {a.group_size}")
        need(cfg.reward.model is None or cfg.reward.model.placement == "server",
             "algorithm.dynamic_sampling decides on rank 0 before the trainer ranks score: with a reward model use "
             "reward.model.placement: server")
    need(a.value_clip is None or a.value_clip > 0, f"algorithm.value_clip must be > 0 or null (no clipping); got {a.value_clip}")
    need(a.clip_ratio_high is None or 0 < a.clip_ratio_high < 10,
         f"algorithm.clip_ratio_high must be in (0, 10) (DAPO uses 0.28) or null; got {a.clip_ratio_high}")
    need(0 <= a.gamma <= 1, f"algorithm.gamma must be in [0, 1]; got {a.gamma}")
    need(0 <= a.lam <= 1, f"algorithm.lam must be in [0, 1]; got {a.lam}")
    need(a.ppo_epochs >= 1, "algorithm.ppo_epochs must be >= 1")
    need(a.kl.coef >= 0, f"algorithm.kl.coef must be >= 0; got {a.kl.coef}")
    need(a.kl.target > 0 and a.kl.horizon > 0, "algorithm.kl.target and algorithm.kl.horizon must be > 0")
    need(a.clip_ratio_c is None or a.clip_ratio_c > 1,
         f"algorithm.clip_ratio_c must be > 1 (dual-clip's bound on the ratio for negative advantages; verl uses 3.0) "
         f"or null (off); got {a.clip_ratio_c}")
    need(a.loss_agg_norm is None or a.loss_agg_norm > 0,
         f"algorithm.loss_agg_norm must be > 0 (the constant divisor of seq_mean_token_sum_norm) or null; got {a.loss_agg_norm}")
    need(a.kl.clamp is None or a.kl.clamp > 0, f"algorithm.kl.clamp must be > 0 or null (no clamp); got {a.kl.clamp}")
    need(a.distill.coef >= 0, f"algorithm.distill.coef must be >= 0 (0: off); got {a.distill.coef}")
    need(not a.distill.only or a.distill.coef > 0, "algorithm.distill.only needs algorithm.distill.coef > 0")
    need(a.distill.baseline in ("none", "position"),
         f"algorithm.distill.baseline must be none or position; got {a.distill.baseline!r}")
    need(isinstance(a.distill.top_k, int) and 0 <= a.distill.top_k <= MAX_TOP_K,
         f"algorithm.distill.top_k must be an integer from 0 (off) to {MAX_TOP_K}; got {a.distill.top_k!r}")
    need(not a.distill.top_k or a.distill.coef > 0, "algorithm.distill.top_k needs algorithm.distill.coef > 0")
    need(a.tis_cap >= 1, f"algorithm.tis_cap must be >= 1 (the importance weight's truncation); got {a.tis_cap}")


def check_sft(cfg: JobConfig, need) -> None:
    """SFT learns from data alone: what would start servers or needs samples is refused, naming the key."""
    a, r, rw = cfg.algorithm, cfg.rollout, cfg.reward
    fix = "SFT trains on data.source's completions without rollout servers"
    # The rollout section's defaults describe servers SFT does not start: the job's nodes are its trainer's (the run's
    # config.yaml shows rollout.nodes 0).
    r.nodes = 0
    need(rw.nodes == 0 and rw.model is None, f"reward.model: {fix} and uses no reward model; remove reward.model "
         "and reward.nodes")
    need(not r.env and not r.agent, f"rollout.env / rollout.agent: {fix}; remove them (the completions are the "
         "training targets)")
    need(r.async_steps == 0, f"rollout.async_steps: {fix}; remove it")
    need(a.kl.coef == 0 and not a.kl.adaptive, f"algorithm.kl: {fix} and has no reference model; set "
         "algorithm.kl.coef: 0")
    need(a.ppo_epochs == 1, f"algorithm.ppo_epochs: SFT passes over the data by trainer.steps; set it to 1 "
         f"(got {a.ppo_epochs})")
    need(not a.dynamic_sampling.enabled, "algorithm.dynamic_sampling: SFT generates nothing; remove it")
    need(not a.distill.coef and not cfg.services.roles(), "algorithm.distill / services: SFT trains on data, not on "
         "a teacher's scores; remove them")
    need(a.loss_agg in ("token_mean", "seq_mean", "token_sum"),
         f"algorithm.loss_agg: SFT averages over tokens (token_mean), sequences (seq_mean) or sums (token_sum); got "
         f"{a.loss_agg}")
    need(cfg.eval.every >= 0, f"eval.every must be >= 0 (0: only after the last step); got {cfg.eval.every}")
    need(cfg.data.max_completion_tokens >= 1,
         f"data.max_completion_tokens must be >= 1; got {cfg.data.max_completion_tokens}")
