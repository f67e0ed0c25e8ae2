"""The batch of each training step: the step's prompts (the deterministic sampler) through the one sample-and-score
path (sampling.py), and the step's generation statistics.

The batch carries each reward part unshaped (`reward_parts`): the function's scores, the reward model's raw logits
when a server scores them, its token ids (`reward_model_ids`) when the trainer ranks do; the learner's step combines
and shapes them in step order, so a batch generated ahead needs no reward state."""

from __future__ import annotations

import logging
import os
import time

from ..config import JobConfig
from ..data.datasets import PromptDataset
from ..data.sampler import indices_for_step
from ..errors import RolloutError
from ..metrics import samples_sha1, server_token_stats
from ..rollout.wire.sampling import SamplingParams
from . import seeds
from .batch import RolloutBatch
from .dynamic_sampling import dynamic_batch
from .partial import PartialRollouts
from .sampling import Sampled, Sampler

log = logging.getLogger("hpc_rl")
debug = os.environ.get("HPC_RL_DEBUG") == "1"


class BatchMaker:
    """Builds the batch of one step; deterministic in (seed, step) and the policy version that samples it."""

    def __init__(self, cfg: JobConfig, sampler: Sampler, teacher=None):
        self.cfg, self.sampler = cfg, sampler
        self.teacher = teacher  # services.teacher's client: its log-probs of every sampled token (distillation)
        self.client = sampler.client
        self.dataset = PromptDataset(cfg.data, sampler.tokenizer, cfg.seed, vision=sampler.vision)
        self.scoring = sampler.training_scoring()
        # rollout.partial: the groups still running, carried from step to step.
        self.partial = PartialRollouts(cfg, self.dataset, self.client, sampler.stop_ids) if cfg.rollout.partial \
            else None

    def make(self, step: int) -> RolloutBatch:
        """The batch of `step`: token ids, the engine's log-probs and policy version per sample, the reward parts
        (unshaped) and stats. With algorithm.dynamic_sampling, only groups with a reward spread (more rounds)."""
        cfg = self.cfg
        if self.partial is not None:  # its prompts come in the same order, as the pool makes room for them
            return self._partial(step)
        idx = indices_for_step(len(self.dataset), cfg.trainer.prompts_per_step, cfg.seed, step, cfg.data.shuffle)
        if not cfg.algorithm.dynamic_sampling.enabled:
            return self.generate(step, idx, 0)
        return dynamic_batch(self, step, idx)

    def generate(self, step: int, idx: list[int], round_: int) -> RolloutBatch:
        """Samples of the prompts `idx` (round_ > 0: an extra round of dynamic sampling, seeds of its own)."""
        cfg, r = self.cfg, self.cfg.rollout
        params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                top_k=r.top_k, stop_token_ids=self.sampler.stop_ids)
        sampled = self.sampler.sample(self.dataset, idx, cfg.algorithm.group_size, params,
                                      seeds.training(cfg.seed, step, round_), step, self.scoring)
        sampled.batch.stats = self._stats(step, idx, sampled)
        if self.teacher is not None:
            self._teacher_logprobs(sampled.batch)
        return sampled.batch

    def _partial(self, step: int) -> RolloutBatch:
        """The complete groups of the pool (carried ones first) after the segments this step runs."""
        n = self.cfg.algorithm.group_size
        batch, partial_stats, groups = self.partial.make(step, n)
        texts = [self.sampler.tokenizer.decode(r, skip_special_tokens=True) for r in batch.responses]
        rows = [self.dataset.rows[i] for i in groups for _ in range(n)]
        sampled = self.sampler.scored(batch, self.dataset, groups, n, texts, rows, self.scoring,
                                      partial_stats.pop("gen_seconds"))
        batch.stats = {**self._stats(step, groups, sampled), **partial_stats}
        if self.teacher is not None:
            self._teacher_logprobs(batch)
        return batch

    def _teacher_logprobs(self, b: RolloutBatch) -> None:
        """The teacher's log-prob of every response token (observations included; the loss masks leave them out), and
        with algorithm.distill.top_k its k likeliest tokens at each of those positions."""
        t0 = time.time()
        self.teacher.rejoin()  # teacher servers that joined (a rollout job's) or came back since the last step
        rows, lens = [p + r for p, r in zip(b.prompts, b.responses)], [len(p) for p in b.prompts]
        k = self.cfg.algorithm.distill.top_k
        images = b.images  # a vision-language policy's prompts: the (vision-language) teacher sees their pictures too
        if k:
            top = self.teacher.top_logprobs(rows, lens, k, images)
            b.teacher_logprobs, b.teacher_top_ids, b.teacher_top_logprobs = top.logprobs, top.top_ids, top.top_logprobs
        else:
            b.teacher_logprobs = self.teacher.logprobs(rows, lens, images)
        for i, (lp, r) in enumerate(zip(b.teacher_logprobs, b.responses)):
            if len(lp) != len(r):
                raise RolloutError(f"teacher server answered {len(lp)} log-probs for sample {i}'s {len(r)} response "
                                   "tokens")
            if k and (len(b.teacher_top_ids[i]) != len(r) or any(len(x) != k for x in b.teacher_top_ids[i])):
                raise RolloutError(f"teacher server answered top-{k} tokens of the wrong shape for sample {i}'s "
                                   f"{len(r)} response tokens")
        b.stats["teacher_seconds"] = time.time() - t0
        if debug:
            log.debug("step %d: teacher log-probs of sample 0's %d tokens %s, the policy's %s", b.step + 1,
                      len(b.responses[0]), [round(x, 2) for x in b.teacher_logprobs[0]],
                      [round(x, 2) for x in b.rollout_logprobs[0]])

    def _stats(self, step: int, idx: list[int], sampled: Sampled) -> dict:
        b = sampled.batch
        masks = b.loss_masks
        gen_tokens = sum(map(sum, masks))
        gen_s = sampled.gen_seconds
        for event in self.client.membership_events():  # one line per join or leave
            log.info("step %d: %s", step + 1, event)
        served = self.client.take_server_tokens()  # with rollout jobs: who did the work
        if debug:
            log.debug("step %d: tokens per server %s, measured tok/s %s", step + 1, dict(sorted(served.items())),
                      {k: round(v, 1) for k, v in sorted(self.client.server_throughputs().items())})
            log.debug("step %d: %d prompts x %d samples by policy version %s, response tokens %d, sample: %r -> %r "
                      "(%s)", step + 1, len(idx), self.cfg.algorithm.group_size, sorted(set(b.versions)), gen_tokens,
                      sampled.prompt_texts[0], sampled.texts[0], {k: v[0] for k, v in b.reward_parts.items()})
        stats = {"response_len": sum(len(x) for x in b.responses) / len(b), **sampled.turn_stats,
                 "rollout_servers": self.client.live_count(),
                 "truncated_frac": sum(b.truncated) / len(b),
                 "gen_seconds": gen_s, "reward_seconds": sampled.reward_seconds,
                 "gen_tokens_per_s": gen_tokens / gen_s if gen_s > 0 else 0.0,
                 "prompt_ids": [int(self.dataset.rows[i]["id"]) for i in idx],
                 "samples_sha1": samples_sha1(b.responses), **server_token_stats(served)}
        if sampled.judgments is not None:
            stats.update(sampled.judgments.stats())
            if debug:
                log.debug("step %d: the judge's answer to sample 0: %r -> %s", step + 1, sampled.judgments.answers[0],
                          sampled.judgments.scores[0])
        inputs = self.sampler.reward_inputs
        if inputs is not None and inputs.truncated:
            stats["reward_model_truncated"] = inputs.truncated
            inputs.truncated = 0
        return stats
