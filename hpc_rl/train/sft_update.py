"""The SFT update on one trainer rank: next-token cross-entropy on the target tokens its mask marks, over the same
engines, mini-batches and token-budget micro-batches as the PPO update (update.py), and the held-out loss.

The loss of a mini-batch is aggregated over all ranks (micro_batch_weight: token_mean divides by the mini-batch's
trained tokens on every rank), so a step is the same at any number of ranks, as verl's SFT trainer counts tokens
globally.
"""

from __future__ import annotations

import math

import torch

from ..algos.losses import aggregate, aggregate_count, micro_batch_weight
from .distributed import all_reduce_scalar
from .experience import Batch, pack, policy_forward


def pack_examples(examples, pad_id: int) -> Batch:
    """SFT examples (data/sft.py: prompt, target, mask) as a Batch: the prompt left-padded, the target as the
    response with its loss mask."""
    return pack([e.prompt for e in examples], [e.target for e in examples], pad_id, [e.mask for e in examples])


def sft_update(t, step: int, batch: Batch, per_rank_mini_batch: int) -> dict:
    """One optimizer step per mini-batch of this rank's rows (in order) on the learner `t`; the step's statistics
    (loss: the trained tokens' mean negative log-likelihood over all ranks, before each optimizer step)."""
    mode = t.cfg.algorithm.loss_agg
    world = t.dist.world_size
    nll_sum = tokens = 0.0
    skipped, grad_norms, opt_step = 0, [], 0
    t.actor.train()
    for start in range(0, batch.size, per_rank_mini_batch):
        opt_step += 1
        poison = (step + 1, opt_step) in t.inject_nan  # the NaN-guard tests' fault injection (update.py)
        rows = torch.arange(start, min(start + per_rank_mini_batch, batch.size), device=batch.input_ids.device)
        whole = all_reduce_scalar(aggregate_count(batch.response_mask[rows], mode))
        mbs = t.micro_batches(batch, rows)
        for j, mb in enumerate(mbs):
            t.actor.set_gradient_accumulation_boundary(j == len(mbs) - 1)
            mask = mb.batch.response_mask
            logp, _ = policy_forward(t.actor, mb.batch)
            loss = aggregate(-logp, mask, mode)
            if poison and j == 0:
                loss = loss * float("nan")
            t.actor.backward(loss * micro_batch_weight(mask, whole, mode, world), scale_wrt_gas=False)
            t.actor.step()
            nll_sum += float((-logp.detach() * mask).sum())
            tokens += float(mask.sum())
        skipped += 0 if t.actor.was_step_applied() else 1
        t.skipped_in_a_row = 0 if t.actor.was_step_applied() else t.skipped_in_a_row + 1
        gn = t.actor.get_global_grad_norm()
        if gn is not None:
            grad_norms.append(float(gn))
    nll_sum, tokens = all_reduce_scalar(nll_sum), all_reduce_scalar(tokens)
    return {"loss": nll_sum / tokens if tokens else math.nan, "trained_tokens": tokens,
            "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else math.nan,
            "grad_norm_max": max((g if math.isfinite(g) else math.inf for g in grad_norms), default=math.nan),
            "skipped_updates": float(skipped), "lr": float(t.actor.get_lr()[0])}


@torch.no_grad()
def held_out_loss(t, batch: Batch) -> tuple[float, float]:
    """(mean negative log-likelihood of the trained tokens, their count) of this rank's held-out rows, summed over
    all ranks (collective: every rank runs as many micro-batches)."""
    t.actor.eval()
    nll_sum = tokens = 0.0
    for mb in t.micro_batches(batch, torch.arange(batch.size)):
        logp, _ = policy_forward(t.actor, mb.batch)
        nll_sum += float((-logp * mb.batch.response_mask).sum())
        tokens += float(mb.batch.response_mask.sum())
    nll_sum, tokens = all_reduce_scalar(nll_sum), all_reduce_scalar(tokens)
    return (nll_sum / tokens if tokens else math.nan), tokens
