"""The one sample-and-score path: prompts -> samples from the rollout servers -> reward parts, as a RolloutBatch.

Training batches (batches.py, dynamic_sampling.py) and evaluations (evaluation.py) both come through
`Sampler.sample`: single-turn prompts go to the servers as one generation (split across them by the client),
multi-turn episodes of rollout.env run through multi_turn.py, OpenAI-SDK agents of rollout.agent through agents.py
(their calls recorded by agent_front.py), and the scoring asked for adds its parts. Seeds come
from the caller's SeedStream (seeds.py): a sample depends on what it is, not on how it was batched or served.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..algos.shaping import overlong_penalty
from ..config import JobConfig, RewardConfig
from ..data.datasets import PromptDataset
from ..data.verifiers_tasks import is_verifiers
from ..models.vision import VisionSpec
from ..rewards.base import compute_rewards, load_reward_fn
from ..rewards.model import RewardInputs
from ..rollout.environments.sandbox import SandboxLimits
from ..rollout.environments.tools import ToolContext
from ..rollout.wire.openai_api import Defaults
from ..rollout.wire.protocol import RequestLimits
from ..rollout.wire.sampling import SamplingParams
from .agent_front import AgentFront
from .agents import AgentRollout, agent_batch, load_agent
from .batch import RolloutBatch
from .judge import Judge, Judgments
from .multi_turn import Limits, MultiTurnRollout
from .seeds import SeedStream
from .verifiers_env import VerifiersEnv


def stop_token_ids(tokenizer, stops: list[str]) -> list[int]:
    """The token ids that end a response: EOS and every rollout.stop string that is one token."""
    ids = {tokenizer.eos_token_id}
    for s in stops:
        toks = tokenizer(s, add_special_tokens=False)["input_ids"]
        if len(toks) == 1:
            ids.add(toks[0])
    return sorted(ids)


@dataclass
class Scoring:
    """The reward parts a generation gets (the environment's, multi-turn, always)."""

    function: Callable | None = None  # reward.function (or eval.reward): the part "function"
    function_cfg: RewardConfig | None = None  # its kwargs / batched, and `function_key` names it in errors
    function_key: str = "reward.function"
    monitor: Callable | None = None  # reward.monitor: the part "monitor" (logged, never trained on)
    monitor_cfg: RewardConfig | None = None
    reward_model: bool = False  # the part "model_logits" (servers) or the reward model's ids (trainer ranks)
    overlong: bool = False  # DAPO's overlong penalty: the part "overlong"
    judge: bool = False  # reward.judge's verdicts: the part "judge"


@dataclass
class Sampled:
    """A generation: the batch (token ids, log-probs, versions, reward parts) and what scoring and logs read."""

    batch: RolloutBatch
    texts: list[str]  # each sample's completion as text (multi-turn: its final answer): what rewards score
    prompt_texts: list[str]
    rows: list[dict]  # each sample's dataset row
    gen_seconds: float
    reward_seconds: float
    turn_stats: dict = field(default_factory=dict)  # the multi-turn loop's statistics
    judgments: Judgments | None = None  # the judge's answers and their statistics (reward.judge)


class Sampler:
    """Generates and scores through the run's rollout client; rank 0 holds one per run."""

    def __init__(self, cfg: JobConfig, tokenizer, client, reward_tokenizer=None, reward_client=None,
                 hide: list | None = None, judge: Judge | None = None):
        self.cfg, self.tokenizer, self.client = cfg, tokenizer, client
        self.judge = judge
        # Who scores with the reward model (placement: server): the reward nodes' servers, else the rollout servers.
        self.reward_client = reward_client or client
        rw = cfg.reward
        self.reward_inputs = RewardInputs(tokenizer, reward_tokenizer, rw.model.max_length) if rw.model else None
        self.stop_ids = stop_token_ids(tokenizer, cfg.rollout.stop)
        verifiers = is_verifiers(cfg.rollout.env)
        self.multi_turn = self._multi_turn(hide or []) if cfg.rollout.env and not verifiers else None
        self.agents = self._agents() if cfg.rollout.agent or verifiers else None
        # A vision-language policy: what turns a prompt's images into its tokens (the datasets' `vision`).
        self.vision = VisionSpec.for_job(cfg, tokenizer)

    def _agents(self) -> AgentRollout:
        """The agent of rollout.agent (or the verifiers environment of rollout.env) and the front its clients call
        (loopback, the run token)."""
        r = self.cfg.rollout
        front = AgentFront(self.tokenizer, self.client, self.stop_ids, RequestLimits.of(r), len(self.tokenizer),
                           self.client.token, self.cfg.model.path)
        fn = VerifiersEnv(r.env, r.env_kwargs, self.cfg.data.kwargs) if is_verifiers(r.env) else load_agent(r.agent)
        return AgentRollout(self.cfg, front, fn)

    def close(self) -> None:
        if self.agents is not None:
            self.agents.front.shutdown()

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

    def training_scoring(self) -> Scoring:
        """The parts a training batch gets: reward.function, reward.monitor, the reward model, the overlong penalty."""
        rw = self.cfg.reward
        return Scoring(function=load_reward_fn(rw.function) if rw.function else None, function_cfg=rw,
                       monitor=load_reward_fn(rw.monitor, "reward.monitor") if rw.monitor else None,
                       monitor_cfg=dataclasses.replace(rw, kwargs={}, batched=False),  # reward.kwargs: the function's
                       reward_model=rw.model is not None, overlong=bool(rw.overlong.buffer_tokens),
                       judge=rw.judge is not None)

    def sample(self, dataset: PromptDataset, idx: list[int], n: int, params: SamplingParams, seeds: SeedStream,
               step: int, scoring: Scoring) -> Sampled:
        """`n` samples of each prompt `idx` of `dataset` (group j: prompt idx[j]'s samples), scored as asked.
        `params` without seeds: they come from `seeds`. `step` names the generation in errors and logs."""
        t0 = time.time()
        rows = [dataset.rows[i] for i in idx for _ in range(n)]
        if self.agents is not None:
            defaults = Defaults(params.max_new_tokens, params.temperature, params.top_p, params.top_k,
                                self.cfg.rollout.tool_call_parser)
            episodes = self.agents.run(rows, step, seeds.turn, defaults)
            batch, texts, turn_stats = agent_batch(episodes, rows, n, step, [dataset.token_ids[i] for i in idx],
                                                   self.tokenizer)
        elif self.multi_turn is not None:
            params = dataclasses.replace(params, n=1, seed=seeds.run_seed, seeds=None)
            trajs, turn_stats = self.multi_turn.run(rows, params, step, seeds.turn)
            batch = RolloutBatch(
                step=step, prompts=[t.prompt_ids for t in trajs], responses=[t.response_ids for t in trajs],
                loss_masks=[t.mask for t in trajs], rollout_logprobs=[t.logprobs for t in trajs],
                versions=[int(t.version) for t in trajs], truncated=[bool(t.truncated) for t in trajs],
                group_ids=[j // n for j in range(len(trajs))], prompt_ids=[int(r["id"]) for r in rows],
                reward_parts={"environment": [t.env_reward for t in trajs]},
                token_versions=[t.token_versions for t in trajs] if any(t.mixed for t in trajs) else None)
            texts = [t.final_text for t in trajs]  # the final answer: what reward functions score
        else:
            turn_stats = {}
            params = dataclasses.replace(params, n=n, seeds=seeds.prompts(len(idx)))
            images = [dataset.images[i] for i in idx] if any(dataset.images) else None
            res = self.client.generate([dataset.token_ids[i] for i in idx], params, step=step, images=images)
            out = [(i, s, int(v)) for i, samples, v in zip(idx, res.outputs, res.policy_versions) for s in samples]
            token_versions = [s.token_versions(v) for _, s, v in out]
            batch = RolloutBatch(
                step=step, prompts=[dataset.token_ids[i] for i, _, _ in out],
                responses=[list(s.token_ids) for _, s, _ in out], loss_masks=[[1] * len(s.token_ids) for _, s, _ in out],
                rollout_logprobs=[list(s.logprobs) for _, s, _ in out],
                versions=[tv[0] if tv else v for tv, (_, _, v) in zip(token_versions, out)],
                truncated=[s.finish_reason == "length" for _, s, _ in out], group_ids=[j // n for j in range(len(out))],
                prompt_ids=[int(r["id"]) for r in rows],
                images=None if images is None else [dataset.images[i] for i, _, _ in out],
                token_versions=token_versions if any(s.versions for _, s, _ in out) else None)
            texts = [self.tokenizer.decode(s.token_ids, skip_special_tokens=True) for _, s, _ in out]
        return self.scored(batch, dataset, idx, n, texts, rows, scoring, time.time() - t0, turn_stats)

    def scored(self, batch: RolloutBatch, dataset: PromptDataset, idx: list[int], n: int, texts: list[str],
               rows: list[dict], scoring: Scoring, gen_s: float, turn_stats: dict | None = None) -> Sampled:
        """A generated batch (group j: `n` samples of prompt idx[j]; `texts`: what rewards score) with its reward
        parts."""
        prompt_texts = [dataset.texts[i] for i in idx for _ in range(n)]
        t1 = time.time()
        view = batch.episodes()  # an episode earns one reward: its parts are scored once, given to all its samples
        judgments = self._score(view, scoring, prompt_texts, texts, rows)
        if view is not batch:
            batch.reward_parts = {k: batch.per_sample(v) for k, v in view.reward_parts.items()}
            if view.reward_model_ids is not None:
                batch.reward_model_ids = batch.per_sample(view.reward_model_ids)
        return Sampled(batch, texts, prompt_texts, rows, gen_s, time.time() - t1, turn_stats or {}, judgments)

    def _score(self, batch: RolloutBatch, scoring: Scoring, prompt_texts: list[str], texts: list[str],
               rows: list[dict]) -> Judgments | None:
        parts = batch.reward_parts
        judgments = None
        if scoring.judge:
            judgments = self.judge(prompt_texts, texts, rows, batch.step)
            parts["judge"] = judgments.scores
        if scoring.function is not None:
            parts["function"] = compute_rewards(scoring.function, scoring.function_cfg, prompt_texts, texts, rows,
                                                scoring.function_key).tolist()
        if scoring.monitor is not None:
            parts["monitor"] = compute_rewards(scoring.monitor, scoring.monitor_cfg, prompt_texts, texts, rows,
                                               "reward.monitor", self.cfg.reward.monitor).tolist()
        if scoring.reward_model:
            ids = [self.reward_inputs(p, resp, row["prompt"], text)
                   for p, resp, row, text in zip(batch.prompts, batch.responses, rows, texts)]
            if self.cfg.reward.model.placement == "server":
                parts["model_logits"] = self.reward_client.score(ids)
            else:
                batch.reward_model_ids = ids  # scored by the trainer ranks
        if scoring.overlong:
            ol = self.cfg.reward.overlong
            parts["overlong"] = overlong_penalty([len(x) for x in batch.responses], self.cfg.response_budget,
                                                 ol.buffer_tokens, ol.penalty).tolist()
        return judgments

