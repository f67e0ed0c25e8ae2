"""The RL loop of DESIGN.md "One RL iteration": rank 0 is the controller, every rank trains its shard."""

from __future__ import annotations

import logging
import math
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import set_seed

from .. import tracking
from ..algos.correction import truncated_is_weights
from ..algos.estimators import AdvantageInputs, compute_advantages
from ..algos.kl import apply_kl_to_rewards, kl_estimate, make_kl_controller
from ..algos.losses import actor_loss, micro_batch_weight, value_loss
from ..algos.utils import masked_mean
from ..config import JobConfig
from ..errors import HpcRlError, PolicyNotFiniteError, RolloutError, TrainingError
from ..eval.evaluator import EvalLog, Evaluator
from ..logs import tail_lines
from ..metrics import MetricsWriter, format_step_line
from ..models.loading import load_tokenizer
from ..rewards.base import RewardShaper, combine_rewards, describe
from ..rewards.model import HeadTap, forwards_needed, score_sequences
from ..rollout.client.rollout_client import RolloutClient
from ..rundir import RunDir, write_json_atomic
from . import checkpoint
from .batch_maker import BatchMaker
from .distributed import DistInfo, all_gather_floats, all_reduce_scalar, broadcast_object, resolve_device_kind
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
from .experience import Batch, forward_micro_batches, pack, pad_rows, policy_forward, value_forward, without_truncated
from .micro_batches import MicroBatch, plan, token_counts
from .rollout_pipeline import RolloutPipeline

log = logging.getLogger("hpc_rl")
debug = os.environ.get("HPC_RL_DEBUG") == "1"

# Set by SIGUSR1/SIGUSR2 (Slurm's warning before preemption or the time limit; see main.py).
_preempt_requested = False


def request_preemption(*_args) -> None:
    """Signal handler: checkpoint and stop at the next step boundary (all ranks agree through an all-reduce)."""
    global _preempt_requested
    _preempt_requested = True


# Waits for rollout servers (rollout.wait_for_servers_s) in a row without a finished step: a step whose generation
# keeps failing with servers up (a timeout, a bad request) stops the run instead of retrying forever.
MAX_RECOVERIES = 3


class _RolloutStop(Exception):
    """Raised on every rank at once when rank 0 could not get samples: wait for servers, or checkpoint and stop."""


class _FatalStop(Exception):
    """Raised on every rank at once when rank 0's rollout side failed beyond a checkpoint (e.g. a sync check)."""


class _PolicyStop(Exception):
    """Raised on every rank at once when the policy is not finite: after this rank's update (`version` None: nothing
    of it was pushed or checkpointed), or on a server that holds policy `version` (its checkpoints are set aside)."""

    def __init__(self, message: str, version: int | None = None):
        super().__init__(message)
        self.version = version


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
    """This rank's contiguous slice of the step's samples."""

    batch: Batch  # token ids and masks, on this rank's device
    rows: slice  # its rows among all the step's samples
    all_scores: torch.Tensor  # [N] every sample's (shaped) score, on CPU
    scores: torch.Tensor  # [B] this shard's scores, on this rank's device
    rollout_logprobs: torch.Tensor  # [B, R] the rollout engine's log-probs of the sampled tokens (behaviour policy)


@dataclass
class Forwards:
    """No-grad forwards of the shard before the update."""

    # [B, T] the actor's, the PPO ratio's denominator; None when the update's own forward gives them (see
    # Trainer.old_logprobs_forward), which fills them in
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None  # [B, T] the frozen reference's (only when a KL term is used)
    values: torch.Tensor | None  # [B, T] the critic's (only for algorithms with a critic)
    # [B, T] the actor's at temperature 1, as the engines report theirs (only for tis at another temperature)
    raw_old_logprobs: torch.Tensor | None = None


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
    """Holds the engines of one rank; rank 0 also holds the data, the reward and the rollout client."""

    def __init__(self, cfg: JobConfig, run: RunDir, dist: DistInfo):
        self.cfg, self.run, self.dist = cfg, run, dist
        self.device_kind = resolve_device_kind(cfg)
        t0 = time.time()
        # Weights created at load (the critic's value head, any missing head) come from the global RNGs:
        # seeded alike on every rank, a run is reproducible and a resumed PPO run builds the same critic.
        set_seed(cfg.seed)
        self.tokenizer = load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)
        self.actor = build_actor(cfg, dist.world_size, self.device_kind)
        self.critic = build_critic(cfg, dist.world_size, self.device_kind) if cfg.algorithm.uses_critic else None
        a = cfg.algorithm
        self.use_ref = a.kl.coef > 0 or a.kl.adaptive
        # Under LoRA the reference is the actor with its adapters off: no second copy of the weights.
        self.lora = cfg.model.lora is not None
        self.ref = build_reference(cfg, dist.world_size, self.device_kind) if self.use_ref and not self.lora else None
        if dist.is_main:
            for name, engine, lora in (("actor", self.actor, cfg.model.lora), ("critic", self.critic,
                                                                                cfg.model.critic_lora)):
                if engine is not None and lora is not None:
                    trainable, total = parameter_counts(engine.module)
                    log.info("%s: LoRA rank %d on %d modules: %d trainable parameters of %d (%.2f%%)%s", name,
                             lora.rank, sum(1 for n, _ in engine.module.named_parameters() if ".lora_A." in n),
                             trainable, total, 100 * trainable / total,
                             "; reference = the actor with its adapters off" if name == "actor" and self.use_ref
                             else "")
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
        elif rm is not None and dist.is_main:
            from ..rewards.model import load_reward_tokenizer

            self.reward_tokenizer = load_reward_tokenizer(rm)  # rank 0 tokenizes what the servers score
        self.shaper = RewardShaper(cfg.reward)  # rank 0's: shapes each step's rewards in step order
        self.engines = {"actor": self.actor}
        if self.critic is not None:
            self.engines["critic"] = self.critic
        if debug:
            log.debug("placement: rank %d/%d (local %d) on %s, device %s, backend %s, %d torch threads, pid %d",
                      dist.rank, dist.world_size, dist.local_rank, os.uname().nodename, dist.device, dist.backend,
                      torch.get_num_threads(), os.getpid())
        if debug and dist.is_main:
            log.debug("engines built in %.1fs: actor%s%s%s on %s x %d (%s)", time.time() - t0,
                      " + critic" if self.critic else "", " + reference" if self.ref else "",
                      " + reward model" if self.reward_model else "", self.device_kind, dist.world_size, dist.backend)
        # Samples per no-grad forward and per backward (the DeepSpeed config's micro-batch).
        self.micro = batch_sizes(cfg, dist.world_size)[1]
        self.step = 0
        self.preempted = False
        self.skipped_in_a_row = 0  # optimizer steps discarded in a row (non-finite loss or gradient norm)
        self._inject_nan = injected_nan_steps()
        self.policy_version = 0
        self.correction = cfg.algorithm.correction(cfg.rollout.async_steps)
        self.old_logprobs_forward = needs_old_logprobs_forward(cfg, self.use_ref, self.correction,
                                                               self.actor.module.config)
        self._tokens = [0, 0]  # this step's computed and real tokens over all micro-batches (pad_fraction)
        # Rank 0 only: the rollout client, the batch maker and the pipeline that runs them (connect_rollout).
        self.client = None
        self.reward_client = None  # the reward nodes' servers (reward.nodes)
        self.maker = None
        self.pipeline = None
        self._recoveries = 0  # waits for servers since the last finished step (a step that keeps failing stops)
        self.evaluator = None  # eval.source set: the held-out evaluation (rank 0)
        self._eval_failure = None  # the last evaluation failed after training ended: reported at the very end
        self.metrics = None
        self._resumed: dict = {}  # rank 0: the reward shaper's state and the pending batches of the checkpoint

    # ------------------------------------------------------------------ set-up

    def resume_if_possible(self) -> None:
        """Continue from the newest complete checkpoint of this run dir, if any (all ranks agree)."""
        path = checkpoint.find_latest(self.run) if self.dist.is_main else None
        path = broadcast_object(str(path) if path else None)
        if path is None:
            return
        state = checkpoint.load(Path(path), self.engines)
        self.step = state["step"]
        self.policy_version = state["step"]
        self.kl_ctl.load_state_dict(state["kl_controller"])
        if self.dist.is_main:
            self._resumed = {"shaper": state["reward_shaper"], "pending": checkpoint.load_pending(Path(path))}
            log.info("resumed from %s (step %d%s)", path, self.step,
                     f", {len(self._resumed['pending'])} batch(es) generated ahead" if self._resumed["pending"] else "")

    def connect_rollout(self) -> None:
        if not self.dist.is_main:
            return
        cfg = self.cfg
        self.client = RolloutClient.from_run_dir(self.run, cfg)
        self.client.wait_ready(cfg.rollout_servers, cfg.rollout.startup_timeout_s)
        if cfg.rollout_servers == 0:  # rollout.servers_per_node 0: the servers come from rollout jobs
            log.info("no rollout servers of the job's own: waiting up to %.0fs for rollout jobs' (hpc-rl rollout add "
                     "%s)", cfg.rollout.server_wait_s, self.run.name)
            if not self.client.wait_for_servers(cfg.rollout.server_wait_s):
                raise RolloutError(f"no rollout server joined within {cfg.rollout.server_wait_s:.0f}s "
                                   f"(rollout.wait_for_servers_s); add one with `hpc-rl rollout add {self.run.name}`, "
                                   "or give the job its own (rollout.servers_per_node >= 1)")
        if cfg.reward.nodes:
            self.reward_client = RolloutClient.from_run_dir(self.run, cfg, kind="reward")
            self.reward_client.wait_ready(cfg.reward.nodes, cfg.rollout.startup_timeout_s)
        # Model-written code (the python tool) must not see this run's token nor other runs': the sandbox hides both.
        self.maker = BatchMaker(cfg, self.tokenizer, self.client, self.reward_tokenizer, self.reward_client,
                                hide=[self.run.root, self.run.root.parent])
        if self._resumed:
            self.shaper.load_state_dict(self._resumed["shaper"])
        r = cfg.rollout
        pending = self._resumed.get("pending") or []
        if pending and [b["step"] for b in pending] != list(range(self.step, self.step + len(pending))):
            raise TrainingError(f"the checkpoint of step {self.step} holds batches for steps "
                                f"{[b['step'] + 1 for b in pending]}, not the ones after it; it is damaged")
        evaluate = None
        if cfg.eval.enabled:
            self.evaluator = Evaluator(cfg, self.tokenizer, self.client, self.run, self.maker.stop_ids)
            self.evaluator.log = EvalLog(self.run, resume_step=self.step)
            log.info("eval: %d held-out prompts of %s x %d sample(s), at step 0: %s, every %s steps and at the end",
                     self.evaluator.prompts, cfg.eval.source, cfg.eval.samples_per_prompt, cfg.eval.at_start,
                     cfg.eval.every or "-")
            evaluate = lambda version: self.evaluator.evaluate(version, version)  # noqa: E731 (version = step)
        self._evaluate = evaluate
        self.pipeline = self._new_pipeline(self.step, pending[:r.async_steps])
        tracker = None
        if tracking.enabled(cfg):
            tracker = tracking.Tracker(cfg, self.run)
        self.metrics = MetricsWriter(self.run.metrics, self.run.tensorboard if cfg.logging.tensorboard else None,
                                     resume_step=self.step, tracker=tracker)

    def _new_pipeline(self, first_step: int, ready: list[dict], eval_rows: list[dict] | None = None
                      ) -> RolloutPipeline:
        r = self.cfg.rollout
        return RolloutPipeline(self.maker.make, self._push_weights, r.async_steps, first_step, self.cfg.trainer.steps,
                               ready=ready, wait_timeout_s=4 * r.request_timeout_s * (r.retries + 1),
                               evaluate=self._evaluate, eval_rows=eval_rows)

    def _servers_back(self, step: int, error: str) -> bool:
        """No rollout server answered at `step`: wait (rank 0, rollout.wait_for_servers_s) for one to come back or
        join; then, as a resume does, a new pipeline with the batches already generated and a push of the current
        policy (which brings the servers to it). Collective; False when none came."""
        wait = self.cfg.rollout.server_wait_s
        back = False
        if self.dist.is_main and wait > 0 and self._recoveries < MAX_RECOVERIES:
            log.warning("step %d: no rollout server answered (%s); waiting up to %.0fs (rollout.wait_for_servers_s) "
                        "for one to come back or join", step + 1, error.split(" | ")[0], wait)
            back = self.client.wait_for_servers(wait)
        back = broadcast_object(back)
        if not back:
            return False
        self._recoveries += 1
        sd = policy_state_dict(self.actor, self.lora)
        if self.dist.is_main:
            ready, rows = self.pipeline.take_ready(step), self.pipeline.eval_rows()
            self.pipeline.close()
            self.pipeline = self._new_pipeline(step, ready[:self.cfg.rollout.async_steps], rows)
            self.pipeline.push(list(sd.items()), self.policy_version)
        del sd
        return True

    # ------------------------------------------------------------------ one step

    def _server_log_tails(self, lines: int = 2) -> str:
        """' | rollout-K.log: last lines' for every server, on one line (the error stays one line)."""
        parts = []
        for k in range(self.cfg.rollout_servers):
            tail = tail_lines(self.run.logs / f"rollout-{k}.log", lines) or ["(no log)"]
            parts.append(f"logs/rollout-{k}.log: " + " / ".join(t.strip() for t in tail))
        return " | " + " | ".join(parts) if parts else ""

    def train_step(self, step: int) -> dict:
        """One RL iteration, as DESIGN.md lists it; collective over all trainer ranks. Returns metrics on rank 0."""
        t_start = time.time()
        payload = self._rollout_batch(step)  # generated + scored on rank 0 (or ahead, by the pipeline); all ranks
        t_wait = time.time() - t_start
        self._rewards(payload)
        shard = self._shard(payload)
        self._tokens = [0, 0]
        t0 = time.time()
        fwd = self._forwards(shard)
        t_fwd = time.time() - t0
        adv, returns = self._advantages(shard, fwd)
        is_weights = self._is_weights(fwd.old_logprobs, fwd, shard.rollout_logprobs, shard.batch.response_mask)
        if debug and self.dist.is_main:
            log.debug("step %d shapes: %d samples, this rank's shard input_ids %s (prompt %d + response %d), "
                      "micro-batch %s; no-grad forwards %.2fs%s", step + 1, len(payload["prompts"]),
                      tuple(shard.batch.input_ids.shape), shard.batch.prompt_len, shard.batch.responses.shape[1],
                      f"{self.cfg.trainer.max_tokens_per_micro_batch} tokens" if self.cfg.trainer.max_tokens_per_micro_batch
                      else f"{self.micro} samples", t_fwd, "" if self.old_logprobs_forward else
                      " (old log-probs come from the update's forward)")
        t0 = time.time()
        stats = self._update(shard, fwd, adv, returns, is_weights)
        t_update = time.time() - t0
        self._check_policy(step, shard, stats)
        stats.update(self._correction_stats(shard, fwd))
        kl_tok = self._kl(fwd)
        computed, real = self._tokens
        stats["pad_fraction"] = 1.0 - real / computed if computed else 0.0
        # Peak memory of a trainer rank so far (the max over ranks): what a reward model or a longer batch adds.
        stats["rank_peak_rss_mib_max"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        if self.dist.device.type == "cuda":
            stats["rank_peak_gpu_mib_max"] = torch.cuda.max_memory_allocated(self.dist.device) / 2**20
        t0 = time.time()
        sync = self._sync_weights(step, payload)
        t_sync = time.time() - t0
        timings = {"trainer_wait_seconds": t_wait, "forward_seconds": t_fwd, "update_seconds": t_update,
                   "sync_seconds": t_sync}
        return self._step_metrics(step, payload, shard, kl_tok, stats, sync, timings, t_start)

    def _rollout_batch(self, step: int) -> dict:
        """Rank 0 takes this step's batch from the rollout pipeline; every rank gets it (or all stop together)."""
        payload = None
        if self.dist.is_main:
            try:
                payload = self.pipeline.get(step)
                self._check_policy_lag(step, payload["versions"])
            except RolloutError as e:  # every server gone past the client's timeouts and retries
                payload = {"rollout_error": f"{e}{self._server_log_tails()}"}
            except PolicyNotFiniteError as e:  # the pushed weights, not the servers
                payload = {"policy_error": str(e), "version": e.version}
            except HpcRlError as e:  # e.g. a failed weight-sync check of the pipeline's last push
                payload = {"fatal_error": str(e)}
        payload = broadcast_object(payload)
        if "rollout_error" in payload:
            raise _RolloutStop(payload["rollout_error"])
        if "fatal_error" in payload:
            raise _FatalStop(payload["fatal_error"])
        if "policy_error" in payload:
            v = payload["version"]
            raise _PolicyStop(f"step {step + 1}: the policy is not finite on the rollout servers ({payload['policy_error']})",
                              v if v is not None and v >= 0 else self.policy_version)
        return payload

    def _rewards(self, payload: dict) -> None:
        """payload["scores"]: the reward parts combined (reward.weights) and shaped in step order on rank 0, after
        the trainer ranks scored the samples with the reward model (placement trainer; collective)."""
        if "reward_parts" not in payload:  # a batch generated ahead by a version before reward parts: shaped
            return
        parts = payload["reward_parts"]
        if self.reward_model is not None:
            t0 = time.time()
            ids = payload["reward_model_ids"]
            per_rank = len(ids) // self.dist.world_size
            mine = ids[self.dist.rank * per_rank:(self.dist.rank + 1) * per_rank]
            rm = self.cfg.reward.model
            # Every rank runs as many forwards (ZeRO-3 gathers each layer from all of them).
            forwards = forwards_needed(per_rank, rm.batch_size)
            logits = score_sequences(self.reward_model, mine, rm.batch_size, self.reward_tokenizer.pad_token_id,
                                     self.dist.device, batches=forwards)
            parts["model_logits"] = all_gather_floats(logits).tolist()
            payload["stats"]["reward_model_seconds"] = time.time() - t0
            if debug and self.dist.is_main:
                log.debug("reward model: %d samples on this rank in %d forward(s) of <= %d, longest %d tokens, "
                          "%.2fs", per_rank, forwards, rm.batch_size, max(map(len, mine), default=0),
                          time.time() - t0)
        scores = None
        if self.dist.is_main:
            try:
                combined, stats = combine_rewards(parts, self.cfg.reward)
                shaped = self.shaper(combined)
                payload["stats"].update(stats)
                payload["stats"].update(describe(shaped, "reward_shaped"))
                scores = shaped.tolist()
            except HpcRlError as e:
                scores = {"fatal_error": str(e)}
        scores = broadcast_object(scores)
        if isinstance(scores, dict):
            raise _FatalStop(scores["fatal_error"])
        payload["scores"] = scores

    def _check_policy_lag(self, step: int, versions: list[int]) -> None:
        """No sample may come from a policy more than rollout.async_steps versions older than the trainer's."""
        n = self.cfg.rollout.async_steps
        oldest = min(versions)
        if self.policy_version - oldest > n:
            raise RolloutError(f"step {step + 1}: rollout servers answered with policy version {oldest} but the trainer "
                               f"is at {self.policy_version} (rollout.async_steps {n} allows {n} version(s) of lag); "
                               "a server missed a weight update")

    def _shard(self, payload: dict) -> Shard:
        """This rank's contiguous 1/world of the samples, packed on its device."""
        dist = self.dist
        per_rank = len(payload["prompts"]) // dist.world_size
        rows = slice(dist.rank * per_rank, (dist.rank + 1) * per_rank)
        masks = payload.get("response_masks")  # multi-turn: observation tokens are not trained on
        masks = masks[rows] if masks else None
        if self.cfg.algorithm.mask_truncated and "truncated" in payload:
            masks = without_truncated(payload["responses"][rows], payload["truncated"][rows], masks)
        batch = pack(payload["prompts"][rows], payload["responses"][rows], self.tokenizer.pad_token_id, masks)
        all_scores = torch.tensor(payload["scores"], dtype=torch.float32)
        rollout_lp = pad_rows(payload["rollout_logprobs"][rows], batch.responses.shape[1])
        return Shard(batch.to(dist.device), rows, all_scores, all_scores[rows].to(dist.device),
                     rollout_lp.to(dist.device))

    def _micro_batches(self, batch: Batch, rows: torch.Tensor) -> list[MicroBatch]:
        """`rows` of `batch` cut into micro-batches (trainer.max_tokens_per_micro_batch or micro_batch_size);
        collective (every rank runs as many as the rank that needs the most); counted for pad_fraction."""
        mbs = plan(batch, rows, self.cfg.trainer.max_tokens_per_micro_batch, self.micro)
        computed, real = token_counts(mbs)
        self._tokens[0] += computed
        self._tokens[1] += real
        return mbs

    def _forwards(self, shard: Shard) -> Forwards:
        """Old log-probs (actor), reference log-probs and values (critic) of the shard, without gradients."""
        temp = self.cfg.rollout.temperature
        b = shard.batch
        needed = self.old_logprobs_forward or self.use_ref or self.critic is not None
        mbs = self._micro_batches(b, torch.arange(b.size)) if needed else []
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

    def _is_weights(self, old_lp: torch.Tensor | None, fwd: Forwards, rollout_lp: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor | None:
        """Truncated importance weights between the trainer's policy and the one that sampled (rollout_correction
        tis); None without the correction, or while the old log-probs are not known yet."""
        if self.correction != "tis" or old_lp is None:
            return None
        proximal = fwd.raw_old_logprobs if fwd.raw_old_logprobs is not None else old_lp
        return truncated_is_weights(proximal, rollout_lp, mask, self.cfg.algorithm.tis_cap)[0]

    def _correction_stats(self, shard: Shard, fwd: Forwards) -> dict:
        """The mismatch statistics between the trainer's and the engines' log-probs, logged with or without the
        correction (not at another temperature without it: the two are then not comparable)."""
        if self.correction == "none" and self.cfg.rollout.temperature != 1.0:
            return {}
        proximal = fwd.raw_old_logprobs if fwd.raw_old_logprobs is not None else fwd.old_logprobs
        return truncated_is_weights(proximal, shard.rollout_logprobs, shard.batch.response_mask,
                                    self.cfg.algorithm.tis_cap)[1]

    def _kl(self, fwd: Forwards) -> torch.Tensor:
        """Per-token KL(policy || reference) before the update (zero without a reference)."""
        if fwd.ref_logprobs is None:
            return torch.zeros_like(fwd.old_logprobs)
        return kl_estimate(fwd.old_logprobs, fwd.ref_logprobs, self.cfg.algorithm.kl.estimator)

    def _advantages(self, shard: Shard, fwd: Forwards):
        """Per-token advantages (and returns, for the critic) from the algorithm's registered estimator; a KL
        penalty in the rewards (algorithm.kl_in_reward) comes from the old and reference log-probs."""
        a = self.cfg.algorithm
        mask = shard.batch.response_mask
        coef = self.kl_ctl.value if a.kl_in_reward and self.use_ref else 0.0
        kl_tok = self._kl(fwd) if coef else torch.zeros_like(mask)
        token_rewards = apply_kl_to_rewards(shard.scores, kl_tok, mask, coef)
        return compute_advantages(AdvantageInputs(shard.all_scores, shard.rows, token_rewards, fwd.values, mask), a)

    def _sync_weights(self, step: int, payload: dict) -> dict:
        """Every rank joins the gather of the updated actor; rank 0 hands it to the pipeline, which pushes it to
        the rollout servers now (synchronous) or once the batches of older versions are generated (async)."""
        self.policy_version = step + 1
        sd = policy_state_dict(self.actor, self.lora)
        every = self.cfg.trainer.check_sync_every
        probe = self._sync_probe(payload) if every and (step + 1) % every == 0 else None
        sync = {}
        if self.dist.is_main:
            sync = self.pipeline.push(list(sd.items()), self.policy_version, probe,
                                      evaluate=self.cfg.eval.due(self.policy_version, self.cfg.trainer.steps))
        del sd
        return sync

    def _push_weights(self, named: list, version: int, probe: tuple | None) -> dict:
        """Rank 0 (the pipeline calls it): push one version; then, with a probe, check the servers serve it."""
        try:
            sync = self.client.push_weights(named, version=version)
        except RolloutError as e:
            # The update itself is done: keep it. The next batch stops the run (after a checkpoint) if no
            # server is left, or names the version lag if one missed this push.
            log.error("weight push of version %d failed: %s", version, e)
            return {}
        if probe is not None:
            sync["max_diff"] = self._compare_with_servers(probe, version)
        return sync

    def _sync_probe(self, payload: dict) -> tuple | None:
        """(prompt, response, the updated actor's log-probs of it) of the batch's first sample (collective)."""
        prompt, response = payload["prompts"][0], payload["responses"][0]
        if not response:
            return None
        probe = pack([prompt], [response], self.tokenizer.pad_token_id).to(self.dist.device)
        with torch.no_grad():
            self.actor.eval()
            mine, _ = policy_forward(self.actor, probe)
        return (prompt, response, mine[0, :len(response)].cpu()) if self.dist.is_main else None

    def _compare_with_servers(self, probe: tuple, version: int) -> float:
        """Max |log-prob difference| between the actor and the rollout servers on the probe; TrainingError beyond
        trainer.sync_tolerance (the servers did not load what was pushed)."""
        prompt, response, mine = probe
        theirs = self.client.logprobs([prompt + response], [len(prompt)])[0]
        diff = float((mine - torch.tensor(theirs)).abs().max())
        if not math.isfinite(diff) or diff > self.cfg.trainer.sync_tolerance:
            raise TrainingError(f"weight sync check failed at policy version {version}: the rollout "
                                f"servers' log-probs differ from the actor's by {diff:.2e} (> trainer.sync_tolerance "
                                f"{self.cfg.trainer.sync_tolerance}); the servers did not load the pushed weights "
                                "(see logs/rollout-*.log)")
        return diff

    def _step_metrics(self, step: int, payload: dict, shard: Shard, kl_tok, stats: dict, sync: dict,
                      timings: dict, t_start: float) -> dict:
        """Average the ranks' statistics, update the KL controller; the step's metrics on rank 0."""
        cfg, dist = self.cfg, self.dist
        mask = shard.batch.response_mask
        kl_mean = all_reduce_scalar(float(masked_mean(kl_tok, mask)) if self.use_ref else 0.0) / dist.world_size
        self.kl_ctl.update(kl_mean, cfg.samples_per_step)
        # Maxima stay maxima over the ranks; everything else is the ranks' mean.
        metrics = {k: all_reduce_scalar(v, "max") if k.endswith("_max") else all_reduce_scalar(v) / dist.world_size
                   for k, v in sorted(stats.items())}
        if not dist.is_main:
            return {}
        t_end = time.time()
        lag = [step - v for v in payload["versions"]]  # the trainer held version `step` when the step began
        m = dict(payload["stats"])
        m.update(metrics)
        m.update({"kl": kl_mean, "kl_coef": self.kl_ctl.value, **timings, "sync_bytes": sync.get("bytes", 0),
                  "sync_max_diff": sync.get("max_diff"), "push_seconds": sync.get("seconds"),
                  "rollout_idle_seconds": self.pipeline.idle_seconds(t_start, t_end),
                  "policy_lag_mean": sum(lag) / len(lag), "policy_lag_max": max(lag),
                  "step_seconds": t_end - t_start, "policy_version": self.policy_version})
        if debug:
            log.debug("step %d timings: waited for the batch %.2fs (generate %.2fs, reward %.2fs), no-grad forwards "
                      "%.2fs, update %.2fs, weight sync %.2fs (%s, %d bytes), rollout idle %.2fs, total %.2fs",
                      step + 1, m["trainer_wait_seconds"], m["gen_seconds"], m["reward_seconds"], m["forward_seconds"],
                      m["update_seconds"], m["sync_seconds"], sync.get("transport", "-"), sync.get("bytes", 0),
                      m["rollout_idle_seconds"], m["step_seconds"])
        return m

    def _update(self, shard: Shard, fwd: Forwards, adv, returns, is_weights=None) -> dict:
        """PPO epochs over mini-batches: actor (and critic) optimizer steps; non-finite steps are skipped.

        Each mini-batch is cut into micro-batches (_micro_batches) whose losses are weighted to sum to the
        mini-batch's loss; the optimizer steps after the last one. Without an old log-prob forward (one epoch,
        one optimizer step), the current log-probs are the old ones: they fill fwd.old_logprobs.
        """
        cfg, a, dist = self.cfg, self.cfg.algorithm, self.dist
        batch = shard.batch
        ref_lp, old_values = fwd.ref_logprobs, fwd.values
        old_lp = fwd.old_logprobs
        fill_old = old_lp is None
        if fill_old:
            old_lp = torch.zeros_like(batch.response_mask)
        per_rank_mb = cfg.trainer.mini_batch_size // dist.world_size
        n = batch.size
        rng = np.random.default_rng([cfg.seed, self.step, dist.rank])
        sums: dict[str, float] = {}
        count = 0
        skipped = 0
        opt_step = 0
        grad_norms = []
        self.actor.train()
        if self.critic is not None:
            self.critic.train()
        use_kl_loss = self.use_ref and not a.kl_in_reward
        for _epoch in range(a.ppo_epochs):
            order = torch.as_tensor(rng.permutation(n))
            for mb_start in range(0, n, per_rank_mb):
                opt_step += 1
                poison = (self.step + 1, opt_step) in self._inject_nan
                rows = order[mb_start:mb_start + per_rank_mb].to(batch.input_ids.device)
                mini_mask = batch.response_mask[rows]
                mbs = self._micro_batches(batch, rows)
                for j, mb in enumerate(mbs):
                    # The optimizer steps after the last micro-batch, however many the token budget made.
                    for engine in self.engines.values():
                        engine.set_gradient_accumulation_boundary(j == len(mbs) - 1)
                    idx, w = mb.rows, mb.response_width
                    mask = mb.batch.response_mask
                    weight = micro_batch_weight(mask, mini_mask, a.loss_agg)
                    logp, ent = policy_forward(self.actor, mb.batch, cfg.rollout.temperature, with_entropy=True)
                    if fill_old:  # before this mini-batch's (only) optimizer step: these are the old log-probs
                        old_lp[idx, :w] = logp.detach()
                        mb_is = self._is_weights(logp.detach(), fwd, shard.rollout_logprobs[idx, :w], mask)
                    else:
                        mb_is = is_weights[idx, :w] if is_weights is not None else None
                    loss, st = actor_loss(logp, ent, old_lp[idx, :w], ref_lp[idx, :w] if use_kl_loss else None,
                                          adv[idx, :w], mask, a, self.kl_ctl.value, mb_is)
                    if poison and j == 0:
                        loss = loss * float("nan")
                    # A non-finite loss still goes through backward: its NaN gradient norm makes the optimizer
                    # discard the step on every rank alike (was_step_applied() is False; at stage 0 in float32
                    # the guard is optimizer.GuardedAdamW's).
                    self.actor.backward(loss * weight, scale_wrt_gas=False)
                    self.actor.step()
                    if self.critic is not None:
                        v = value_forward(self.critic, mb.batch)
                        vl, vst = value_loss(v, old_values[idx, :w], returns[idx, :w], mask, a.value_clip, a.loss_agg)
                        self.critic.backward(a.value_coef * vl * weight, scale_wrt_gas=False)
                        self.critic.step()
                        st.update(vst)
                        st["value_loss"] = float(vl.detach())
                    for k, val in st.items():
                        sums[k] = sums.get(k, 0.0) + (val if math.isfinite(val) else float("nan"))
                    count += 1
                # The last micro-batch closed the accumulation window: the optimizer step happened (or was
                # discarded for a non-finite gradient norm).
                applied = self.actor.was_step_applied() and (self.critic is None or self.critic.was_step_applied())
                gn = self.actor.get_global_grad_norm()
                if gn is not None:
                    grad_norms.append(float(gn))
                if not applied:
                    skipped += 1
                self.skipped_in_a_row = 0 if applied else self.skipped_in_a_row + 1
        if fill_old:
            fwd.old_logprobs = old_lp
        out = {k: v / max(count, 1) for k, v in sums.items()}
        out["grad_norm"] = float(np.mean(grad_norms)) if grad_norms else float("nan")
        out["grad_norm_max"] = max((g if math.isfinite(g) else math.inf for g in grad_norms), default=math.nan)
        out["skipped_updates"] = float(skipped)
        out["lr"] = float(self.actor.get_lr()[0])
        return out

    def _check_policy(self, step: int, shard: Shard, stats: dict) -> None:
        """After the update, before anything is pushed or checkpointed: every rank's part of the actor's (and
        critic's) weights is finite, and so is the actor's forward of one sample of its shard (weights can be finite
        and still absurd: an lr of 1e30 gives |w| ~ 1e30, whose forward overflows). Collective; _PolicyStop on every
        rank when either fails."""
        names = list(self.engines)  # the same order on every rank
        probe = shard.batch.slice(slice(0, 1))
        with torch.no_grad():
            self.actor.eval()
            lp, _ = policy_forward(self.actor, probe)
        local = [float(not params_finite(self.engines[n])) for n in names]
        local.append(float(not bool(torch.isfinite(lp[probe.response_mask > 0]).all())))
        flags = all_gather_floats(local).reshape(-1, len(local)).max(0)
        if not flags.any():
            return
        bad = [n for n, f in zip(names, flags) if f]
        why = f"the {' and '.join(bad)}'s weights hold non-finite values" if bad else \
            "its weights are finite but its forward gives non-finite log-probs"
        gn = stats.get("grad_norm_max", math.nan)
        raise _PolicyStop(f"step {step + 1}: the policy is not finite after the update ({why}; lr {self.cfg.trainer.lr:.3g}, "
                          f"grad_norm {gn:.3g}, {int(stats['skipped_updates'])} optimizer step(s) skipped)")

    # ------------------------------------------------------------------ loop

    def fit(self) -> None:
        cfg, dist = self.cfg, self.dist
        total = cfg.trainer.steps
        if self.step > 0:
            # The servers start from the initial weights: give them the resumed policy first (and evaluate it when
            # an interruption came between its checkpoint and its evaluation).
            sd = policy_state_dict(self.actor, self.lora)
            if dist.is_main:
                again = self.cfg.eval.due(self.step, total) and self.step not in self.evaluator.log.steps() \
                    if self.evaluator is not None else False
                self.pipeline.push(list(sd.items()), self.policy_version, evaluate=again)
            del sd
        elif dist.is_main and self.cfg.eval.due(0, total):
            self.pipeline.evaluate_served()  # the baseline: the initial policy
        while self.step < total:
            step = self.step
            try:
                m = self.train_step(step)
            except _RolloutStop as e:
                if self._servers_back(step, str(e)):
                    continue
                # Keep the finished steps: a checkpoint of the last one (unless it exists), then stop.
                if self.step > 0 and not checkpoint.step_dir(self.run, self.step).is_dir():
                    self.save_checkpoint()
                if dist.is_main:
                    raise RolloutError(f"step {step + 1}: no rollout server answered; checkpoint of step "
                                       f"{self.step} kept, resume with `hpc-rl run JOB --resume RUN`: {e}") from None
                return  # the other ranks stop quietly; rank 0 reports
            except _FatalStop as e:
                if dist.is_main:
                    self.pipeline.close()
                    raise TrainingError(str(e)) from None
                return
            except _PolicyStop as e:
                if dist.is_main:
                    self.pipeline.close()
                    raise TrainingError(f"{e}; latest checkpoint: {self._roll_back(e.version)}; lower trainer.lr "
                                        "(or check the reward scale)") from None
                return
            self.step = step + 1
            self._recoveries = 0
            if dist.is_main:
                if m["skipped_updates"]:
                    log.warning("step %d: non-finite loss or gradient; %d optimizer step(s) skipped (%d in a row at "
                                "the step's end)", self.step, m["skipped_updates"], self.skipped_in_a_row)
                self._add_eval_metrics(m, last=self.step == total)
                self.metrics.write(self.step, m)
                if self.step % cfg.logging.every == 0 or self.step == total:
                    log.info(format_step_line(self.step, total, m))
            if self.skipped_in_a_row >= cfg.trainer.max_skipped_in_a_row:
                raise TrainingError(f"{self.skipped_in_a_row} optimizer steps in a row were skipped for a non-finite "
                                    f"loss or gradient (the last at step {self.step}; trainer.max_skipped_in_a_row "
                                    f"{cfg.trainer.max_skipped_in_a_row}); lower trainer.lr, check the reward scale, "
                                    "or use float32/bfloat16 instead of float16")
            every = cfg.checkpoint.every
            saved = bool(every) and (self.step % every == 0 or self.step == total)
            # keep_best: every evaluated step has a checkpoint that can become the best one.
            saved = saved or bool(cfg.checkpoint.keep_best and cfg.eval.due(self.step, total))
            if saved:
                self.save_checkpoint()
            # Preemption: one rank got the signal; all of them stop here, at the same step boundary.
            if self.step < total and all_reduce_scalar(1.0 if _preempt_requested else 0.0, "max") > 0:
                if not saved:
                    self.save_checkpoint()
                self.preempted = True
                if dist.is_main:
                    log.warning("preempted: checkpoint of step %d written; stopping so that the job is requeued "
                                "(it resumes from this step)", self.step)
                break
        if dist.is_main:
            self.pipeline.close()  # its worker may be pushing: it finishes that push first
            self.client.close()  # leaves the weight-sync group before the servers see done.json
            if self.reward_client is not None:
                self.reward_client.close()
            if not self.preempted:
                write_json_atomic(self.run.done_file, {"step": self.step, "time": time.time()})
            self.metrics.close("preempted" if self.preempted else "finished")
            if self._eval_failure is not None:
                raise TrainingError(f"training finished (checkpoint kept) but the last evaluation failed: "
                                    f"{self._eval_failure}")

    def _roll_back(self, version: int | None) -> str:
        """Rank 0, as the run stops for a policy that is not finite: checkpoints of that policy or later (version
        None: none was written) are set aside; what `latest` names now, in words."""
        aside = checkpoint.set_aside(self.run, version) if version is not None else []
        latest = checkpoint.find_latest(self.run)
        now = latest.name if latest is not None else "none"
        if aside:
            now += f", rolled back from {aside[-1].name.removesuffix(checkpoint.NOT_FINITE_SUFFIX)} (kept as " \
                   f"{', '.join(p.name for p in aside)})"
        return now

    def _add_eval_metrics(self, m: dict, last: bool) -> None:
        """Rank 0: the evaluations finished since the last step join this step's metrics (eval/step names the
        step evaluated: in async mode an earlier one). After the last step it waits for the last evaluation."""
        if self.evaluator is None:
            return
        if last:
            try:
                self.pipeline.finish_evals()
            except HpcRlError as e:  # the other ranks are past the last collective but the checkpoint's
                log.error("the last evaluation failed: %s", e)
                self._eval_failure = e
        ck = self.cfg.checkpoint
        for row in self.pipeline.eval_rows():
            m.update({k: v for k, v in row.items() if k.startswith("eval/")})
            m["eval/step"] = row["step"]
            if ck.keep_best and checkpoint.record_eval(self.run, row, ck.keep_best, ck.best_mode):
                log.info("best %s so far: %.4f at step %d (checkpoints/best)", ck.keep_best, row[ck.keep_best],
                         row["step"])

    def save_checkpoint(self) -> None:
        t0 = time.time()
        hf_sd = None
        if self.cfg.checkpoint.save_hf:  # the adapters alone under LoRA (a PEFT folder)
            hf_sd = adapter_state_dict(self.actor) if self.lora else gather_state_dict(self.actor)
        pending, shaper = None, None
        if self.dist.is_main:
            self.pipeline.wait_evals(self.step)  # evaluations of earlier versions are not lost to a kill after it
            # Batches generated ahead (async) belong to the checkpoint; their rewards are shaped when trained on.
            pending = self.pipeline.pending(self.step)
            shaper = self.shaper.state_dict()
        state = {"step": self.step, "kl_controller": self.kl_ctl.state_dict(), "reward_shaper": shaper,
                 "seed": self.cfg.seed}
        path = checkpoint.save(self.run, self.step, self.engines, state, hf_sd, self.actor.module.config,
                               self.tokenizer, self.cfg.checkpoint.keep_last, self.dist.rank, pending,
                               lora=self.cfg.model.lora, base_path=str(self.cfg.model.path))
        if self.dist.is_main:
            log.info("checkpoint %s written in %.1fs", path, time.time() - t0)
            if self.cfg.checkpoint.keep_best:
                checkpoint.link_best(self.run)  # its evaluation may have come first (synchronous rollouts)
