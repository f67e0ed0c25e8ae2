"""The learner: one trainer rank's engines and what the RL step (hpc_rl/loop.py) asks of them, all collective (SPMD).

Every rank holds its ZeRO shards of the actor, the critic, the reference and the reward model; for each RolloutBatch
it takes its contiguous share of the samples, runs the no-grad forwards, computes advantages with the algorithm's
registered estimator, runs the PPO update (update.py), checks the updated policy, gathers it for the weight push,
and writes checkpoints. It knows RolloutBatch, not how the samples were made: that is the orchestrator's.
"""

from __future__ import annotations

import logging
import math
import os
import resource
import time
from pathlib import Path

import torch

from .. import checkpoints
from ..algos.correction import truncated_is_weights
from ..algos.distill import distill_advantages, reverse_kl, without_unknown_tokens
from ..algos.estimators import AdvantageInputs, compute_advantages
from ..algos.kl import apply_kl_to_rewards, kl_estimate, make_kl_controller
from ..algos.utils import masked_mean
from ..config import JobConfig
from ..errors import TrainingError
from ..models.loading import load_tokenizer
from ..models.vision import RowPixels, VisionSpec
from ..orchestrator.batch import RolloutBatch
from ..rewards.model import HeadTap, forwards_needed, score_sequences
from ..rundir import RunDir
from . import checkpoint
from .distributed import DistInfo, all_gather_floats, broadcast_object, resolve_device_kind, seed_everything
from .ds_config import batch_sizes
from .engines import (
    adapter_state_dict,
    build_actor,
    build_critic,
    build_reference,
    build_reward_model,
    gather_state_dict,
    parameter_counts,
    params_finite,
    policy_state_dict,
)
from .experience import Batch, forward_micro_batches, pack, pad_rows, pad_top_rows, policy_forward, value_forward, without_truncated
from .gathered_forward import GatheredPolicy, can_stand_in
from .micro_batches import MicroBatch, plan, token_counts
from .update import Forwards, Shard, injected_nan_steps, mini_batch_rows, ppo_update

log = logging.getLogger("hpc_rl")
debug = os.environ.get("HPC_RL_DEBUG") == "1"


class PolicyNotFinite(Exception):
    """Raised on every rank at once when the policy is not finite after this step's update; nothing of it was pushed
    or checkpointed."""


def needs_old_logprobs_forward(cfg: JobConfig, use_ref: bool, correction: str, model_config) -> bool:
    """Whether the old log-probs need a forward of their own before the update.

    With one PPO epoch and one optimizer step per RL step, the update's forward runs on the same weights as that
    forward would, so its log-probs (detached) are the old ones: the ratio is 1 with its gradient intact, as
    verl and TRL do. It is still needed when the old log-probs are used before the update (a KL penalty in the
    per-token rewards; importance weights at a sampling temperature other than 1, which need a second,
    temperature-1 forward) and when the model has dropout (train and eval mode would differ).
    """
    a = cfg.algorithm
    one_step = a.ppo_epochs == 1 and cfg.trainer.mini_batch_size == cfg.samples_per_step
    kl_before = use_ref and a.kl_in_reward
    tis_other_temperature = correction == "tis" and cfg.rollout.temperature != 1.0
    dropout = any(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                  for k, v in vars(model_config).items() if "dropout" in k)
    dropout = dropout or (cfg.model.lora is not None and cfg.model.lora.dropout > 0)
    return not one_step or kl_before or tis_other_temperature or dropout


class Trainer:
    """The engines of one rank and the learning half of the RL step."""

    def __init__(self, cfg: JobConfig, run: RunDir, dist: DistInfo):
        self.cfg, self.run, self.dist = cfg, run, dist
        self.device_kind = resolve_device_kind(cfg)
        t0 = time.time()
        # Weights created at load (the critic's value head, any missing head) come from the global RNGs:
        # seeded alike on every rank, a run is reproducible and a resumed PPO run builds the same critic.
        seed_everything(cfg.seed)
        self.tokenizer = load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)
        # A vision-language policy's image processing (the prompts' images become pixel inputs); None: text.
        self.vision = VisionSpec.for_job(cfg, self.tokenizer)
        self.actor = build_actor(cfg, dist.world_size, self.device_kind)
        self.critic = build_critic(cfg, dist.world_size, self.device_kind) if cfg.algorithm.uses_critic else None
        a = cfg.algorithm
        self.use_ref = a.kl.coef > 0 or a.kl.adaptive
        # Under LoRA the reference is the actor with its adapters off: no second copy of the weights.
        self.lora = cfg.model.lora is not None
        self.ref = build_reference(cfg, dist.world_size, self.device_kind) if self.use_ref and not self.lora else None
        self.engines = {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}
        if dist.is_main:
            self._log_lora()
        self.kl_ctl = make_kl_controller(a.kl)
        # The reward model on the trainer ranks (ZeRO-3 inference, partitioned like the reference).
        self.reward_model, self.reward_tokenizer = None, None
        rm = cfg.reward.model
        if rm is not None and rm.placement == "trainer":
            engine, self.reward_tokenizer, label = build_reward_model(cfg, dist.world_size, self.device_kind)
            self.reward_model = HeadTap(engine, label)
            if dist.is_main:
                shard = sum(p.ds_tensor.numel() * p.element_size() if hasattr(p, "ds_tensor") else p.numel() *
                            p.element_size() for p in engine.module.parameters())
                log.info("reward model %s on the trainer ranks: %.1f MiB of parameters on each (ZeRO-3 stage %d)",
                         rm.path, shard / 2**20, cfg.trainer.zero_stage)
        if debug:
            log.debug("placement: rank %d/%d (local %d) on %s, device %s, backend %s, %d torch threads, pid %d",
                      dist.rank, dist.world_size, dist.local_rank, os.uname().nodename, dist.device, dist.backend,
                      torch.get_num_threads(), os.getpid())
            if dist.is_main:
                log.debug("engines built in %.1fs: actor%s%s%s on %s x %d (%s)", time.time() - t0,
                          " + critic" if self.critic else "", " + reference" if self.ref else "",
                          " + reward model" if self.reward_model else "", self.device_kind, dist.world_size,
                          dist.backend)
        # Samples per no-grad forward and per backward (the DeepSpeed config's micro-batch).
        self.micro = batch_sizes(cfg, dist.world_size)[1]
        self.step = 0
        self.policy_version = 0
        self.skipped_in_a_row = 0  # optimizer steps discarded in a row (non-finite loss or gradient norm)
        self.inject_nan = injected_nan_steps()
        self.correction = cfg.algorithm.correction(cfg.rollout.async_steps)
        self.old_logprobs_forward = needs_old_logprobs_forward(cfg, self.use_ref, self.correction,
                                                               self.actor.module.config)
        self._tokens = [0, 0]  # this step's computed and real tokens over all micro-batches (pad_fraction)
        # Whether the check after the update and the sync probe run on the weights the push gathers (rank 0 alone,
        # no ZeRO-3 fetches); the same on every rank. Its model skeleton is built at first use, on rank 0.
        self.forward_on_gathered = can_stand_in(dist.device, cfg.trainer.zero_stage, self.lora, self.vision is not None)
        self._gathered_policy: GatheredPolicy | None = None

    def _log_lora(self) -> None:
        for name, engine, lora in (("actor", self.actor, self.cfg.model.lora),
                                   ("critic", self.critic, self.cfg.model.critic_lora)):
            if engine is not None and lora is not None:
                trainable, total = parameter_counts(engine.module)
                log.info("%s: LoRA rank %d on %d modules: %d trainable parameters of %d (%.2f%%)%s", name, lora.rank,
                         sum(1 for n, _ in engine.module.named_parameters() if ".lora_A." in n), trainable, total,
                         100 * trainable / total,
                         "; reference = the actor with its adapters off" if name == "actor" and self.use_ref else "")

    def resume(self) -> dict | None:
        """Continue from the newest complete checkpoint of this run dir, if any (all ranks agree); its trainer state
        (rank 0 also gets its batches generated ahead, under "pending"), else None."""
        path = checkpoints.find_latest(self.run) if self.dist.is_main else None
        path = broadcast_object(str(path) if path else None)
        if path is None:
            return None
        state = checkpoint.load(Path(path), self.engines, self.dist.world_size, self.dist.rank)
        self.step = self.policy_version = state["step"]
        self.kl_ctl.load_state_dict(state["kl_controller"])
        if self.dist.is_main:
            state["pending"] = checkpoint.load_pending(Path(path))
            log.info("resumed from %s (step %d%s)", path, self.step,
                     f", {len(state['pending'])} batch(es) generated ahead" if state["pending"] else "")
        return state

    # ------------------------------------------------------------------ the step's learning half

    def score_with_reward_model(self, batch: RolloutBatch) -> None:
        """The reward model on the trainer ranks (placement trainer) scores every sample: its raw logits become the
        batch's reward part model_logits on every rank (collective; nothing to do otherwise)."""
        if self.reward_model is None or batch.reward_model_ids is None:
            return
        t0 = time.time()
        ids = batch.reward_model_ids
        world = self.dist.world_size
        ids = ids + [ids[0]] * (-len(ids) % world)  # an agent's batch need not split evenly: pad, then drop
        per_rank = len(ids) // world
        mine = ids[self.dist.rank * per_rank:(self.dist.rank + 1) * per_rank]
        rm = self.cfg.reward.model
        # Every rank runs as many forwards (ZeRO-3 gathers each layer from all of them).
        forwards = forwards_needed(per_rank, rm.batch_size)
        logits = score_sequences(self.reward_model, mine, rm.batch_size, self.reward_tokenizer.pad_token_id,
                                 self.dist.device, batches=forwards)
        batch.reward_parts["model_logits"] = all_gather_floats(logits).tolist()[:len(batch)]
        batch.stats["reward_model_seconds"] = time.time() - t0
        if debug and self.dist.is_main:
            log.debug("reward model: %d samples on this rank in %d forward(s) of <= %d, longest %d tokens, %.2fs",
                      per_rank, forwards, rm.batch_size, max(map(len, mine), default=0), time.time() - t0)

    def shard(self, step: int, batch: RolloutBatch, scores: list[float]) -> Shard:
        """This rank's 1/world of the samples (its share of each mini-batch: update.mini_batch_rows), packed on its
        device."""
        dist = self.dist
        # The step takes as many optimizer steps as configured. An agent's episodes of several samples make the
        # batch longer than samples_per_step: its mini-batches grow, padded with rows that train nothing to a whole
        # number of rows per rank.
        mini_batches = self.cfg.samples_per_step // self.cfg.trainer.mini_batch_size
        pad = -len(batch) % (mini_batches * dist.world_size)
        batch, scores = batch.with_fillers(pad, self.tokenizer.pad_token_id), scores + [0.0] * pad
        episodes = None if batch.episode_ids is None else torch.tensor(batch.episode_index(), dtype=torch.long)
        mini_batch = len(batch) // mini_batches
        rows = mini_batch_rows(len(batch), mini_batch, dist.world_size, dist.rank, self.cfg.seed, step)
        mine = batch.select(rows.tolist())
        masks = mine.loss_masks
        if self.cfg.algorithm.mask_truncated:
            masks = without_truncated(mine.responses, mine.truncated, masks)
        packed = pack(mine.prompts, mine.responses, self.tokenizer.pad_token_id, masks, self._pixels(mine.images))
        all_scores = torch.tensor(scores, dtype=torch.float32)
        width = packed.responses.shape[1]
        rollout_lp = pad_rows(mine.rollout_logprobs, width)
        teacher_lp = top_ids = top_lp = None
        if mine.teacher_logprobs is not None:
            teacher_lp = pad_rows(mine.teacher_logprobs, width).to(dist.device)
        if mine.teacher_top_ids is not None:
            k = self.cfg.algorithm.distill.top_k
            top_ids, top_lp = without_unknown_tokens(pad_top_rows(mine.teacher_top_ids, width, k, torch.long),
                                                     pad_top_rows(mine.teacher_top_logprobs, width, k),
                                                     self.actor.module.config.get_text_config().vocab_size)
            top_ids, top_lp = top_ids.to(dist.device), top_lp.to(dist.device)
        self.reset_token_counts()
        return Shard(packed.to(dist.device), rows, all_scores, all_scores[rows].to(dist.device),
                     rollout_lp.to(dist.device), mini_batch // dist.world_size, episodes, teacher_lp, top_ids, top_lp)

    def micro_batches(self, batch: Batch, rows: torch.Tensor) -> list[MicroBatch]:
        """`rows` of `batch` cut into micro-batches (trainer.max_tokens_per_micro_batch or micro_batch_size);
        collective (every rank runs as many as the rank that needs the most); counted for pad_fraction."""
        mbs = plan(batch, rows, self.cfg.trainer.max_tokens_per_micro_batch, self.micro)
        computed, real = token_counts(mbs)
        self._tokens[0] += computed
        self._tokens[1] += real
        return mbs

    def reset_token_counts(self) -> None:
        """A new step: pad_fraction counts its micro-batches from here."""
        self._tokens = [0, 0]

    def pad_fraction(self) -> float:
        """The share of computed tokens that were padding, over the micro-batches since the step's shard."""
        computed, real = self._tokens
        return 1.0 - real / computed if computed else 0.0

    def forwards(self, shard: Shard) -> Forwards:
        """Old log-probs (actor), reference log-probs and values (critic) of the shard, without gradients."""
        temp = self.cfg.rollout.temperature
        b = shard.batch
        needed = self.old_logprobs_forward or self.use_ref or self.critic is not None
        mbs = self.micro_batches(b, torch.arange(b.size)) if needed else []
        size, width = b.size, b.responses.shape[1]
        self.actor.eval()
        old_lp = forward_micro_batches(policy_forward, self.actor, mbs, size, width, temperature=temp) \
            if self.old_logprobs_forward else None
        ref_lp = None
        if self.ref is not None:
            ref_lp = forward_micro_batches(policy_forward, self.ref, mbs, size, width, temperature=temp)
        elif self.use_ref:  # LoRA: the base weights are the initial policy
            with self.actor.module.disable_adapter():
                ref_lp = forward_micro_batches(policy_forward, self.actor, mbs, size, width, temperature=temp)
        values = None
        if self.critic is not None:
            self.critic.eval()
            values = forward_micro_batches(value_forward, self.critic, mbs, size, width)
        raw_lp = None
        if self.correction == "tis" and temp != 1.0:  # the engines report temperature-1 log-probs
            raw_lp = forward_micro_batches(policy_forward, self.actor, mbs, size, width)
        return Forwards(old_lp, ref_lp, values, raw_lp)

    def is_weights(self, old_lp: torch.Tensor | None, fwd: Forwards, rollout_lp: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor | None:
        """Truncated importance weights between the trainer's policy and the one that sampled (rollout_correction
        tis); None without the correction, or while the old log-probs are not known yet."""
        if self.correction != "tis" or old_lp is None:
            return None
        proximal = fwd.raw_old_logprobs if fwd.raw_old_logprobs is not None else old_lp
        return truncated_is_weights(proximal, rollout_lp, mask, self.cfg.algorithm.tis_cap)[0]

    def kl(self, fwd: Forwards) -> torch.Tensor:
        """Per-token KL(policy || reference) before the update (zero without a reference)."""
        if fwd.ref_logprobs is None:
            return torch.zeros_like(fwd.old_logprobs)
        kl = self.cfg.algorithm.kl
        return kl_estimate(fwd.old_logprobs, fwd.ref_logprobs, kl.estimator, kl.clamp)

    def advantages(self, shard: Shard, fwd: Forwards):
        """Per-token advantages (and returns, for the critic) from the algorithm's registered estimator; a KL
        penalty in the rewards (algorithm.kl_in_reward) comes from the old and reference log-probs."""
        a = self.cfg.algorithm
        mask = shard.batch.response_mask
        coef = self.kl_ctl.value if a.kl_in_reward and self.use_ref else 0.0
        kl_tok = self.kl(fwd) if coef else torch.zeros_like(mask)
        d = a.distill
        distill = None
        if d.coef and shard.teacher_logprobs is not None:  # the sampling policy's log-probs against the teacher's
            distill = distill_advantages(shard.rollout_logprobs, shard.teacher_logprobs, mask, d.coef, d.baseline)
            if d.only:
                return distill, None
        token_rewards = apply_kl_to_rewards(shard.scores, kl_tok, mask, coef)
        adv, returns = compute_advantages(AdvantageInputs(shard.all_scores, shard.rows, token_rewards, fwd.values,
                                                          mask, shard.episodes), a)
        return (adv if distill is None else adv + distill), returns

    def update(self, step: int, shard: Shard, fwd: Forwards, adv, returns) -> dict:
        """The PPO update of `step` (update.py), with the rollout correction's statistics and the step's padding and
        peak memory; counts optimizer steps skipped in a row across steps."""
        is_weights = self.is_weights(fwd.old_logprobs, fwd, shard.rollout_logprobs, shard.batch.response_mask)
        stats, self.skipped_in_a_row = ppo_update(self, step, shard, fwd, adv, returns, is_weights)
        if not (self.correction == "none" and self.cfg.rollout.temperature != 1.0):
            # The mismatch between the trainer's and the engines' log-probs (not comparable at another temperature
            # without the correction's temperature-1 forward).
            proximal = fwd.raw_old_logprobs if fwd.raw_old_logprobs is not None else fwd.old_logprobs
            stats.update(truncated_is_weights(proximal, shard.rollout_logprobs, shard.batch.response_mask,
                                              self.cfg.algorithm.tis_cap)[1])
        stats["pad_fraction"] = self.pad_fraction()
        # Peak memory of a trainer rank so far (the max over ranks): what a reward model or a longer batch adds.
        stats["rank_peak_rss_mib_max"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        if self.dist.device.type == "cuda":
            stats["rank_peak_gpu_mib_max"] = torch.cuda.max_memory_allocated(self.dist.device) / 2**20
        return stats

    def check_policy(self, step: int, batch: Batch, stats: dict, named: list | None = None,
                     gathered: bool = False) -> None:
        """After the update, before anything is pushed or checkpointed: every rank's part of the actor's (and
        critic's) weights is finite, and so is the actor's forward of one trained row of its `batch` (weights can be
        finite and still absurd: an lr of 1e30 gives |w| ~ 1e30, whose forward overflows). PolicyNotFinite on every
        rank when either fails. `gathered`: every rank just gathered the update's weights (policy_state), rank 0's
        `named`; then the forward may run on those (forward_on_gathered)."""
        names = list(self.engines)  # the same order on every rank
        trained = (batch.response_mask.sum(-1) > 0).nonzero()  # not a padding row: its check is empty
        first = int(trained[0]) if len(trained) else 0
        probe = batch.slice(slice(first, first + 1))
        lp = self._probe_logprobs(probe, named, gathered)
        local = [float(not params_finite(self.engines[n])) for n in names]
        local.append(float(lp is not None and not bool(torch.isfinite(lp[probe.response_mask > 0]).all())))
        flags = all_gather_floats(local).reshape(-1, len(local)).max(0)
        if not flags.any():
            return
        bad = [n for n, f in zip(names, flags) if f]
        why = f"the {' and '.join(bad)}'s weights hold non-finite values" if bad else \
            "its weights are finite but its forward gives non-finite log-probs"
        gn = stats.get("grad_norm_max", math.nan)
        raise PolicyNotFinite(f"step {step + 1}: the policy is not finite after the update ({why}; lr "
                              f"{self.cfg.trainer.lr:.3g}, grad_norm {gn:.3g}, {int(stats['skipped_updates'])} "
                              "optimizer step(s) skipped)")

    def stop_if_diverging(self) -> None:
        """TrainingError (on every rank alike) once trainer.max_skipped_in_a_row optimizer steps in a row were skipped
        for a non-finite loss or gradient."""
        most = self.cfg.trainer.max_skipped_in_a_row
        if self.skipped_in_a_row >= most:
            raise TrainingError(f"{self.skipped_in_a_row} optimizer steps in a row were skipped for a non-finite loss "
                                f"or gradient (the last at step {self.step}; trainer.max_skipped_in_a_row {most}); "
                                f"lower trainer.lr{'' if self.cfg.algorithm.supervised else ', check the reward scale,'}"
                                " or use float32/bfloat16 instead of float16")

    def step_stats(self, shard: Shard, fwd: Forwards, stats: dict) -> tuple[dict, float]:
        """The ranks' statistics averaged (maxima stay maxima) and the KL controller updated: (stats, mean KL);
        collective."""
        stats = dict(stats)
        if self.use_ref:
            stats["_kl_mean"] = float(masked_mean(self.kl(fwd), shard.batch.response_mask))
        if shard.teacher_logprobs is not None:  # the student's distance to the teacher on its own samples
            mask = shard.batch.response_mask
            stats["distill/reverse_kl"] = float(masked_mean(reverse_kl(shard.rollout_logprobs,
                                                                       shard.teacher_logprobs), mask))
        # One collective for all of them: one all-reduce per statistic (~25) cost a small model's step ~10 ms.
        keys = sorted(stats)
        ranks = all_gather_floats([stats[k] for k in keys]).reshape(self.dist.world_size, len(keys))
        out = {k: float(ranks[:, i].max()) if k.endswith("_max") else float(ranks[:, i].sum()) / self.dist.world_size
               for i, k in enumerate(keys)}
        kl_mean = out.pop("_kl_mean", 0.0)
        self.kl_ctl.update(kl_mean, self.cfg.samples_per_step)
        return out, kl_mean

    # ------------------------------------------------------------------ the policy leaves the trainer

    def policy_state(self) -> list | None:
        """What a weight push sends (the adapters under LoRA, else the whole HF state dict), gathered from the ZeRO
        shards; collective; (name, tensor) pairs on rank 0, None elsewhere."""
        sd = policy_state_dict(self.actor, self.lora)
        return list(sd.items()) if sd is not None else None

    def sync_probe(self, batch: RolloutBatch, named: list | None = None, gathered: bool = False) -> tuple | None:
        """(prompt, response, the updated actor's log-probs of it) of the batch's first sample, for the weight-sync
        check (collective; rank 0's, None elsewhere). `named`, `gathered`: as check_policy's."""
        prompt, response = batch.prompts[0], batch.responses[0]
        if not response:
            return None
        images = batch.images[:1] if batch.images is not None else None
        probe = pack([prompt], [response], self.tokenizer.pad_token_id, pixels=self._pixels(images)).to(self.dist.device)
        mine = self._probe_logprobs(probe, named, gathered)
        if not self.dist.is_main:
            return None
        return (prompt, response, mine[0, :len(response)].cpu().tolist(), *([images] if images else []))

    def _probe_logprobs(self, probe: Batch, named: list | None, gathered: bool) -> torch.Tensor | None:
        """The updated actor's log-probs of a small `probe` batch (no gradients): on rank 0 alone from the gathered
        weights where they can stand in for the engine (None on the other ranks), else the engine's collective
        forward."""
        with torch.no_grad():
            if gathered and self.forward_on_gathered:
                if not self.dist.is_main:
                    return None
                if self._gathered_policy is None:
                    self._gathered_policy = GatheredPolicy(self.actor)
                return policy_forward(self._gathered_policy.on(named), probe)[0]
            self.actor.eval()
            return policy_forward(self.actor, probe)[0]

    def _pixels(self, images: list[list[bytes]] | None) -> RowPixels | None:
        """The processed images of packed rows (a vision-language policy's batch), None for a text batch."""
        if images is None or self.vision is None or not any(images):
            return None
        return RowPixels.of(self.vision, images)

    def save_checkpoint(self, pending: list[RolloutBatch] | None, orchestrator: dict | None) -> Path | None:
        """Every rank's DeepSpeed shards, rank 0's HF folder (the adapters alone under LoRA) and trainer state with
        the orchestrator's part (`pending` batches, and its state: the reward shaper's, partial rollouts'; rank
        0's); collective."""
        t0 = time.time()
        hf_sd = None
        if self.cfg.checkpoint.save_hf:
            hf_sd = adapter_state_dict(self.actor) if self.lora else gather_state_dict(self.actor)
        state = {"step": self.step, "kl_controller": self.kl_ctl.state_dict(), "reward_shaper": None,
                 **(orchestrator or {}), "seed": self.cfg.seed, "world_size": self.dist.world_size,
                 "zero_stage": self.cfg.trainer.zero_stage}
        path = checkpoint.save(self.run, self.step, self.engines, state, hf_sd, self.actor.module.config,
                               self.tokenizer, self.cfg.checkpoint.keep_last, self.dist.rank, pending,
                               lora=self.cfg.model.lora, base_path=str(self.cfg.model.path))
        if self.dist.is_main:
            log.info("checkpoint %s written in %.1fs", path, time.time() - t0)
            if self.cfg.checkpoint.keep_best:
                checkpoints.link_best(self.run)  # its evaluation may have come first (synchronous rollouts)
        return path
