"""Rank 0's experience source: a step's prompts -> samples from the rollout servers -> rewards -> the batch.

The batch carries each reward part unshaped (`reward_parts`): the function's scores, the reward model's raw logits
when a server scores them, its token ids (`reward_model_ids`) when the trainer ranks do; the trainer combines and
shapes them in step order (Trainer._rewards), so a batch generated ahead needs no reward state."""

from __future__ import annotations

import dataclasses
import logging
import os
import time

from ..algos.shaping import overlong_penalty
from ..config import JobConfig
from ..data.datasets import PromptDataset
from ..data.sampler import indices_for_step
from ..metrics import samples_sha1, server_token_stats
from ..orchestrator import seeds
from ..rewards.base import compute_rewards, load_reward_fn
from ..rewards.model import RewardInputs
from ..rollout.client.rollout_client import RolloutClient
from ..rollout.environments.loop import Limits, MultiTurnRollout
from ..rollout.environments.sandbox import SandboxLimits
from ..rollout.environments.tools import ToolContext
from ..rollout.wire.sampling import SamplingParams
from .dynamic_sampling import dynamic_batch

log = logging.getLogger("hpc_rl")
debug = os.environ.get("HPC_RL_DEBUG") == "1"


def stop_token_ids(tokenizer, stops: list[str]) -> list[int]:
    """The token ids that end a response: EOS and every rollout.stop string that is one token."""
    ids = {tokenizer.eos_token_id}
    for s in stops:
        toks = tokenizer(s, add_special_tokens=False)["input_ids"]
        if len(toks) == 1:
            ids.add(toks[0])
    return sorted(ids)


class BatchMaker:
    """Builds the batch of one step; deterministic in (seed, step) and the policy version that samples it."""

    def __init__(self, cfg: JobConfig, tokenizer, client: RolloutClient, reward_tokenizer=None,
                 reward_client: RolloutClient | None = None, hide: list | None = None):
        self.cfg, self.tokenizer, self.client = cfg, tokenizer, client
        # Who scores with the reward model (placement: server): the reward nodes' servers, else the rollout servers.
        self.reward_client = reward_client or client
        self.dataset = PromptDataset(cfg.data, tokenizer, cfg.seed)
        rw = cfg.reward
        self.reward_fn = load_reward_fn(rw.function) if rw.function else None
        self.monitor_fn = load_reward_fn(rw.monitor, "reward.monitor") if rw.monitor else None
        self.monitor_cfg = dataclasses.replace(rw, kwargs={}, batched=False)  # reward.kwargs are the function's
        self.reward_inputs = RewardInputs(tokenizer, reward_tokenizer, rw.model.max_length) if rw.model else None
        self.stop_ids = stop_token_ids(tokenizer, cfg.rollout.stop)
        self.multi_turn = self._multi_turn(hide or []) if cfg.rollout.env else None

    def _multi_turn(self, hide: list) -> MultiTurnRollout:
        """The multi-turn loop of rollout.env; `hide`: paths the tools' sandbox hides (the run dir, its parent)."""
        r, sb = self.cfg.rollout, self.cfg.rollout.sandbox
        limits = Limits(r.max_turns, r.total_tokens(self.cfg.data.max_prompt_tokens), r.tool_timeout_s,
                        r.max_new_tokens, r.max_model_len)
        sandbox = SandboxLimits(wall_s=sb.wall_s, cpu_s=sb.cpu_s, memory_mb=sb.memory_mb, processes=sb.processes,
                                output_bytes=sb.output_bytes)
        env_cls = load_reward_fn(r.env, "rollout.env")
        return MultiTurnRollout(env_cls, dict(r.env_kwargs), self.tokenizer, self.client, limits,
                                ToolContext(sandbox, list(hide), sb.require_isolation))

    def make(self, step: int) -> dict:
        """The batch of `step`: token ids, the engine's log-probs and policy version per sample, the reward parts
        (unshaped) and stats. With algorithm.dynamic_sampling, only groups with a reward spread (more rounds)."""
        cfg = self.cfg
        idx = indices_for_step(len(self.dataset), cfg.trainer.prompts_per_step, cfg.seed, step, cfg.data.shuffle)
        if not cfg.algorithm.dynamic_sampling.enabled:
            return self._generate(step, idx, 0)
        return dynamic_batch(self, step, idx)

    def _generate(self, step: int, idx: list[int], round_: int) -> dict:
        """Samples of the prompts `idx` (round_ > 0: an extra round of dynamic sampling, seeds of its own)."""
        cfg, a, r = self.cfg, self.cfg.algorithm, self.cfg.rollout
        ds = self.dataset
        stream = seeds.training(cfg.seed, step, round_)
        params = SamplingParams(n=a.group_size, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                                top_p=r.top_p, top_k=r.top_k, stop_token_ids=self.stop_ids,
                                seeds=stream.prompts(len(idx)))
        t0 = time.time()
        parts, extra, turn_stats = {}, {}, {}
        if self.multi_turn is not None:
            rows = [ds.rows[i] for i in idx for _ in range(a.group_size)]
            trajs, turn_stats = self.multi_turn.run(rows, params, step, stream.turn)
            prompt_ids = [t.prompt_ids for t in trajs]
            resp_ids = [t.response_ids for t in trajs]
            rollout_lp = [t.logprobs for t in trajs]
            versions = [int(t.version) for t in trajs]
            texts = [t.final_text for t in trajs]  # the final answer: what reward functions score
            extra["response_masks"] = [t.mask for t in trajs]
            parts["environment"] = [t.env_reward for t in trajs]
            truncated = [bool(t.truncated) for t in trajs]
        else:
            res = self.client.generate([ds.token_ids[i] for i in idx], params, step=step)
            prompt_ids, resp_ids, texts, rows, rollout_lp, versions, truncated = [], [], [], [], [], [], []
            for i, samples, version in zip(idx, res.outputs, res.policy_versions):
                for s in samples:
                    truncated.append(s.finish_reason == "length")
                    prompt_ids.append(ds.token_ids[i])
                    resp_ids.append(list(s.token_ids))
                    rollout_lp.append(list(s.logprobs))
                    versions.append(int(version))
                    texts.append(self.tokenizer.decode(s.token_ids, skip_special_tokens=True))
                    rows.append(ds.rows[i])
        gen_s = time.time() - t0
        t1 = time.time()
        prompt_texts = [ds.texts[i] for i in idx for _ in range(a.group_size)]
        if self.reward_fn is not None:
            parts["function"] = compute_rewards(self.reward_fn, cfg.reward, prompt_texts, texts, rows).tolist()
        if self.monitor_fn is not None:
            parts["monitor"] = compute_rewards(self.monitor_fn, self.monitor_cfg, prompt_texts, texts, rows,
                                               spec=f"reward.monitor {cfg.reward.monitor}").tolist()
        if self.reward_inputs is not None:
            ids = [self.reward_inputs(p, resp, row["prompt"], text)
                   for p, resp, row, text in zip(prompt_ids, resp_ids, rows, texts)]
            if cfg.reward.model.placement == "server":
                parts["model_logits"] = self.reward_client.score(ids)
            else:
                extra["reward_model_ids"] = ids  # scored by the trainer ranks
        ol = cfg.reward.overlong
        if ol.buffer_tokens:
            parts["overlong"] = overlong_penalty([len(x) for x in resp_ids], cfg.response_budget, ol.buffer_tokens,
                                                 ol.penalty).tolist()
        reward_s = time.time() - t1
        masks = extra.get("response_masks")
        gen_tokens = sum(map(sum, masks)) if masks else sum(len(x) for x in resp_ids)
        for event in self.client.membership_events():  # one line per join or leave
            log.info("step %d: %s", step + 1, event)
        served = self.client.take_server_tokens()  # with rollout jobs: who did the work
        if debug:
            log.debug("step %d: tokens per server %s, measured tok/s %s", step + 1, dict(sorted(served.items())),
                      {k: round(v, 1) for k, v in sorted(self.client.server_throughputs().items())})
        stats = {"response_len": sum(len(x) for x in resp_ids) / len(resp_ids), **turn_stats,
                 "rollout_servers": self.client.live_count(),
                 "truncated_frac": sum(truncated) / len(truncated),
                 "gen_seconds": gen_s, "reward_seconds": reward_s,
                 "gen_tokens_per_s": gen_tokens / gen_s if gen_s > 0 else 0.0,
                 "prompt_ids": [int(ds.rows[i]["id"]) for i in idx],
                 "samples_sha1": samples_sha1(resp_ids), **server_token_stats(served)}
        if debug:
            log.debug("step %d: %d prompts x %d samples by policy version %s, response tokens %d, sample: %r -> %r "
                      "(%s)", step + 1, len(idx), a.group_size, sorted(set(versions)), gen_tokens,
                      ds.texts[idx[0]], texts[0], {k: v[0] for k, v in parts.items()})
        if self.reward_inputs is not None and self.reward_inputs.truncated:
            stats["reward_model_truncated"] = self.reward_inputs.truncated
            self.reward_inputs.truncated = 0
        return {"step": step, "prompts": prompt_ids, "responses": resp_ids, "rollout_logprobs": rollout_lp,
                "versions": versions, "truncated": truncated, "reward_parts": parts, "stats": stats, **extra}
