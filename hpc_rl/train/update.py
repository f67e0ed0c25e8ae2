"""The update of one RL step: PPO epochs over mini-batches, each cut into micro-batches (actor and critic optimizer
steps). A non-finite loss or gradient norm discards its optimizer step on every rank alike."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from ..algos.distill import topk_forward_kl
from ..algos.losses import actor_loss, aggregate, aggregate_count, micro_batch_weight, value_loss
from .distributed import all_reduce_scalar
from .experience import Batch, policy_forward, policy_forward_top, value_forward
from .micro_batches import MicroBatch

# Fault injection for tests: "STEP:K[,STEP:K...]" makes the loss of the K-th optimizer step of RL step STEP (both
# 1-based) NaN on every rank, as a numerical blow-up in one mini-batch would (a reward is validated before it
# could plant one).
INJECT_NAN_ENV = "HPC_RL_INJECT_NAN_LOSS"


def injected_nan_steps() -> set[tuple[int, int]]:
    raw = os.environ.get(INJECT_NAN_ENV, "")
    out = set()
    for part in filter(None, (p.strip() for p in raw.split(","))):
        step, _, k = part.partition(":")
        out.add((int(step), int(k)))
    return out


@dataclass
class Shard:
    """This rank's samples of the step, in the order its update takes them (mini_batch_rows)."""

    batch: Batch  # token ids and masks, on this rank's device
    rows: torch.Tensor  # [B] its rows among all the step's samples (int64)
    all_scores: torch.Tensor  # [N] every sample's (shaped) score, on CPU
    scores: torch.Tensor  # [B] this shard's scores, on this rank's device
    rollout_logprobs: torch.Tensor  # [B, R] the rollout engine's log-probs of the sampled tokens (behaviour policy)
    per_rank_mini_batch: int  # rows of each mini-batch on this rank
    # [N] every sample's episode (0, 1, ... group by group; -1: padding), on CPU; None: each sample is an episode
    episodes: torch.Tensor | None = None
    # [B, R] the teacher's log-probs of the sampled tokens (on-policy distillation); None: no teacher
    teacher_logprobs: torch.Tensor | None = None
    # [B, R, k] the teacher's k likeliest tokens at each response position and their log-probs (distill.top_k)
    teacher_top_ids: torch.Tensor | None = None
    teacher_top_logprobs: torch.Tensor | None = None


def mini_batch_rows(samples: int, mini_batch_size: int, world: int, rank: int, seed: int, step: int) -> torch.Tensor:
    """This rank's rows of the step's samples, in the order its first PPO epoch takes them: the samples shuffled once
    (the same permutation at any number of ranks), cut into mini-batches of trainer.mini_batch_size, and each
    mini-batch split evenly over the ranks. A mini-batch is then the same set of samples whatever the number of
    ranks: with the loss weighted over all ranks (micro_batch_weight), a run resumed on another number of trainer
    ranks takes the optimizer steps the uninterrupted run would, up to float summation order."""
    order = np.random.default_rng([seed, step]).permutation(samples)
    per_rank = mini_batch_size // world
    mine = [order[k + rank * per_rank:k + (rank + 1) * per_rank] for k in range(0, samples, mini_batch_size)]
    return torch.as_tensor(np.concatenate(mine), dtype=torch.long)


@dataclass
class Forwards:
    """No-grad forwards of the shard before the update."""

    # [B, T] the actor's, the PPO ratio's denominator; None when the update's own forward gives them (see
    # needs_old_logprobs_forward), which fills them in
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None  # [B, T] the frozen reference's (only when a KL term is used)
    values: torch.Tensor | None  # [B, T] the critic's (only for algorithms with a critic)
    # [B, T] the actor's at temperature 1, as the engines report theirs (only for tis at another temperature)
    raw_old_logprobs: torch.Tensor | None = None


def ppo_update(t, step: int, shard: Shard, fwd: Forwards, adv, returns, is_weights=None) -> tuple[dict, int]:
    """PPO epochs over mini-batches on the learner `t` (its engines, config, KL controller and micro-batch plan);
    returns the averaged statistics and the optimizer steps skipped in a row at the end.

    Each mini-batch is cut into micro-batches whose losses are weighted to sum to the mini-batch's loss; the
    optimizer steps after the last one. Without an old log-prob forward (one epoch, one optimizer step), the current
    log-probs are the old ones: they fill fwd.old_logprobs.
    """
    cfg, a, dist = t.cfg, t.cfg.algorithm, t.dist
    batch = shard.batch
    ref_lp, old_values = fwd.ref_logprobs, fwd.values
    old_lp = fwd.old_logprobs
    fill_old = old_lp is None
    if fill_old:
        old_lp = torch.zeros_like(batch.response_mask)
    per_rank_mb = shard.per_rank_mini_batch
    n = batch.size
    rng = np.random.default_rng([cfg.seed, step, dist.rank])
    sums: dict[str, float] = {}
    count = skipped = opt_step = 0
    in_a_row = t.skipped_in_a_row
    grad_norms = []
    t.actor.train()
    if t.critic is not None:
        t.critic.train()
    use_kl_loss = t.use_ref and not a.kl_in_reward
    for epoch in range(a.ppo_epochs):
        # The first epoch takes the shard's rows in order (mini_batch_rows made its mini-batches the same at any
        # number of ranks); later epochs reshuffle this rank's rows.
        order = torch.arange(n) if epoch == 0 else torch.as_tensor(rng.permutation(n))
        for mb_start in range(0, n, per_rank_mb):
            opt_step += 1
            poison = (step + 1, opt_step) in t.inject_nan
            rows = order[mb_start:mb_start + per_rank_mb].to(batch.input_ids.device)
            mini_mask = batch.response_mask[rows]
            whole = all_reduce_scalar(aggregate_count(mini_mask, a.loss_agg))  # over all ranks
            mbs: list[MicroBatch] = t.micro_batches(batch, rows)
            for j, mb in enumerate(mbs):
                # The optimizer steps after the last micro-batch, however many the token budget made.
                for engine in t.engines.values():
                    engine.set_gradient_accumulation_boundary(j == len(mbs) - 1)
                idx, w = mb.rows, mb.response_width
                mask = mb.batch.response_mask
                weight = micro_batch_weight(mask, whole, a.loss_agg, dist.world_size)
                if shard.teacher_top_ids is None:
                    logp, ent = policy_forward(t.actor, mb.batch, cfg.rollout.temperature, with_entropy=True)
                else:  # the same forward gives the student's log-probs of the teacher's top k tokens
                    logp, ent, student_top = policy_forward_top(t.actor, mb.batch, shard.teacher_top_ids[idx, :w],
                                                                cfg.rollout.temperature, with_entropy=True)
                if fill_old:  # before this mini-batch's (only) optimizer step: these are the old log-probs
                    old_lp[idx, :w] = logp.detach()
                    mb_is = t.is_weights(logp.detach(), fwd, shard.rollout_logprobs[idx, :w], mask)
                else:
                    mb_is = is_weights[idx, :w] if is_weights is not None else None
                loss, st = actor_loss(logp, ent, old_lp[idx, :w], ref_lp[idx, :w] if use_kl_loss else None,
                                      adv[idx, :w], mask, a, t.kl_ctl.value, mb_is)
                if shard.teacher_top_ids is not None:  # on-policy distillation's top-k term
                    top_kl = aggregate(topk_forward_kl(student_top, shard.teacher_top_logprobs[idx, :w],
                                                       cfg.rollout.temperature), mask, a.loss_agg, a.loss_agg_norm)
                    loss = loss + a.distill.coef * top_kl
                    st["distill/topk_kl"] = float(top_kl.detach())
                if poison and j == 0:
                    loss = loss * float("nan")
                # A non-finite loss still goes through backward: its NaN gradient norm makes the optimizer
                # discard the step on every rank alike (was_step_applied() is False; at stage 0 in float32
                # the guard is optimizer.GuardedAdamW's).
                t.actor.backward(loss * weight, scale_wrt_gas=False)
                t.actor.step()
                if t.critic is not None:
                    v = value_forward(t.critic, mb.batch)
                    vl, vst = value_loss(v, old_values[idx, :w], returns[idx, :w], mask, a.value_clip, a.loss_agg,
                                         a.loss_agg_norm)
                    t.critic.backward(a.value_coef * vl * weight, scale_wrt_gas=False)
                    t.critic.step()
                    st.update(vst)
                    st["value_loss"] = float(vl.detach())
                for k, val in st.items():
                    sums[k] = sums.get(k, 0.0) + (val if math.isfinite(val) else float("nan"))
                count += 1
            # The last micro-batch closed the accumulation window: the optimizer step happened (or was
            # discarded for a non-finite gradient norm).
            applied = t.actor.was_step_applied() and (t.critic is None or t.critic.was_step_applied())
            gn = t.actor.get_global_grad_norm()
            if gn is not None:
                grad_norms.append(float(gn))
            if not applied:
                skipped += 1
            in_a_row = 0 if applied else in_a_row + 1
    if fill_old:
        fwd.old_logprobs = old_lp
    out = {k: v / max(count, 1) for k, v in sums.items()}
    out["grad_norm"] = float(np.mean(grad_norms)) if grad_norms else float("nan")
    out["grad_norm_max"] = max((g if math.isfinite(g) else math.inf for g in grad_norms), default=math.nan)
    out["skipped_updates"] = float(skipped)
    out["lr"] = float(t.actor.get_lr()[0])
    return out, in_a_row
