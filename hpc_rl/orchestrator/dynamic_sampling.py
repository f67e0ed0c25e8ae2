"""DAPO's dynamic sampling on rank 0: generate a step's prompts, keep the groups whose rewards (the task's, without
the overlong penalty) differ, and generate more prompts (rounds of their own, deterministic in (seed, step, round))
until trainer.prompts_per_step groups are kept or algorithm.dynamic_sampling.max_gen_batches rounds are spent. The batch then holds exactly
prompts_per_step groups, so every shape downstream is as without it; a resume replays the same rounds."""

from __future__ import annotations

import logging
import math

from ..algos.shaping import groups_with_spread
from ..data.sampler import indices_for_step
from ..errors import TrainingError
from ..metrics import samples_sha1, server_token_stats
from ..rewards.base import combine_rewards
from . import seeds
from .batch import RolloutBatch

log = logging.getLogger("hpc_rl")

def round_prompts(n_rows: int, count: int, seed: int, step: int, round_: int, shuffle: bool) -> list[int]:
    """The prompts of extra round `round_` (>= 1) of `step`: a stream of their own, deterministic in its arguments."""
    return indices_for_step(n_rows, count, seeds.round_data_seed(seed, round_), step, shuffle)


def dynamic_batch(maker, step: int, idx: list[int]) -> RolloutBatch:
    """The batch of `step` with algorithm.dynamic_sampling; maker: the BatchMaker (its generate makes one round)."""
    cfg = maker.cfg
    a, ds_cfg = cfg.algorithm, cfg.algorithm.dynamic_sampling
    g, want = a.group_size, cfg.trainer.prompts_per_step
    rounds, kept, dropped = [], [], []  # kept/dropped: (round, group) in generation order
    prompts, consumed, task_sum = idx, 0, 0.0
    for r in range(ds_cfg.max_gen_batches):
        batch = maker.generate(step, prompts, r)
        rounds.append((prompts, batch))
        consumed += len(prompts)
        # The task's reward decides, not the overlong penalty (verl's filter_groups metric "acc"): a group whose
        # answers are all right or all wrong teaches nothing whatever their lengths.
        task = {name: v for name, v in batch.episodes().reward_parts.items() if name != "overlong"}
        rewards, _ = combine_rewards(task, cfg.reward)
        task_sum += float(rewards.sum())
        for j, spread in enumerate(groups_with_spread(rewards, g)):
            (kept if spread else dropped).append((r, j))
        missing = want - len(kept)
        if missing <= 0:
            break
        # Ask for what is missing, scaled by the share of groups kept so far (at most a full step's worth).
        share = max(len(kept) / consumed, 1 / want)
        prompts = round_prompts(len(maker.dataset), min(want, math.ceil(missing / share)), cfg.seed, step, r + 1,
                                cfg.data.shuffle)
    n_kept = len(kept)
    if n_kept < want:
        msg = (f"step {step + 1}: dynamic sampling kept {n_kept} of {want} groups with a reward spread after "
               f"{len(rounds)} round(s) ({consumed} prompts)")
        if ds_cfg.on_exhausted == "error":
            raise TrainingError(f"{msg}; raise algorithm.dynamic_sampling.max_gen_batches, or set "
                                "algorithm.dynamic_sampling.on_exhausted: warn to train on what there is")
        log.warning("%s; the batch is filled with %d group(s) without one (zero advantage: they add no policy "
                    "gradient)", msg, want - n_kept)
    chosen = (kept + dropped)[:want]
    pieces, order = [], []  # order: the chosen groups' prompts, as the pieces hold them
    for r, (prompts_r, batch) in enumerate(rounds):
        groups = [j for rr, j in chosen if rr == r]
        if groups:
            of_group: dict[int, list[int]] = {}  # an agent's episode may have several samples
            for i, gid in enumerate(batch.group_ids):
                of_group.setdefault(gid, []).append(i)
            pieces.append(batch.select([i for j in groups for i in of_group[j]]))
            order += [prompts_r[j] for j in groups]
    out = RolloutBatch.concat(pieces)
    stats = dict(rounds[0][1].stats)
    ds = maker.dataset
    tokens = sum(b.stats["gen_tokens_per_s"] * b.stats["gen_seconds"] for _, b in rounds)
    gen_s = sum(b.stats["gen_seconds"] for _, b in rounds)
    for key in [k for k in stats if k.startswith(("server_tokens/", "server_share/"))]:
        del stats[key]
    served: dict = {}  # server index -> tokens, over all rounds
    for _, b in rounds:
        for k, v in b.stats.items():
            if k.startswith("server_tokens/"):
                index = int(k.split("/", 1)[1])
                served[index] = served.get(index, 0.0) + v
    stats.update(server_token_stats(served))
    stats.update({
        "response_len": sum(map(len, out.responses)) / len(out),
        "truncated_frac": sum(out.truncated) / len(out),
        "gen_seconds": gen_s, "reward_seconds": sum(b.stats["reward_seconds"] for _, b in rounds),
        "gen_tokens_per_s": tokens / gen_s if gen_s > 0 else 0.0,
        "prompt_ids": [int(ds.rows[i]["id"]) for i in order],
        "samples_sha1": samples_sha1(out.responses),
        "groups_kept_frac": n_kept / (len(kept) + len(dropped)), "gen_batches": float(len(rounds)),
        # Share of the trained groups that have a reward spread (1 unless the rounds ran out).
        "groups_with_spread_frac": min(n_kept, want) / want,
        "prompts_consumed": float(consumed),
        # The task reward of every sample generated (all rounds: random prompts): how the policy does. The trained
        # batch's reward_mean is of groups chosen for their spread, so it stays near the middle as the policy learns.
        "generated_reward_mean": task_sum / (consumed * g),
    })
    out.stats = stats
    return out
