"""The reward section: a reward function, a reward model, their weights and the shaping of the sum."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from .job import JobConfig


@dataclass
class RewardModelConfig:
    """A sequence-classification reward model: one score per sample, read at the last real token of prompt + response."""

    # HF folder loaded with AutoModelForSequenceClassification (config.json, weights, tokenizer files).
    path: str | None = None
    # Build the tiny reward model of a toy task offline instead of `path` (e.g. toy:repeat_digit; tests and toys).
    tiny: str | None = None
    # Allow code shipped inside the folder to run (transformers' trust_remote_code).
    trust_remote_code: bool = False
    # Precision of the reward model; null: model.dtype.
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    # The head's output used as the score, for heads with more than one label (null: the head must have one).
    label_index: int | None = None
    # score = transform(scale * (logit - shift)): sigmoid/tanh bound raw logits (a binary head's logits in
    # [-15, -8] would otherwise be dwarfed by the KL penalty).
    transform: Literal["raw", "sigmoid", "tanh"] = "raw"
    # Multiplies the logit (after the shift), before the transform.
    scale: float = 1.0
    # Subtracted from the logit before scaling (e.g. the mean logit of the reward model on reference answers).
    shift: float = 0.0
    # Longest prompt + response in the reward model's tokens; longer ones keep their last max_length tokens.
    max_length: int = 1024
    # Sequences per reward-model forward (on each trainer rank, or per server request).
    batch_size: int = 8
    # trainer: a ZeRO-3 inference engine on the trainer ranks (partitioned like the reference model);
    # server: on the rollout servers' nodes, on a GPU of its own (each server gets tensor_parallel + 1 GPUs).
    placement: Literal["trainer", "server"] = "trainer"


@dataclass
class OverlongConfig:
    """DAPO's soft overlong punishment (https://arxiv.org/abs/2503.14476, eq. 13): a response longer than the length
    budget minus buffer_tokens loses penalty x (its excess / buffer_tokens), linearly up to penalty at the budget."""

    # The last tokens of the budget over which the penalty grows; 0: off.
    buffer_tokens: int = 0
    # The penalty at the budget (DAPO: 1.0, the reward's scale).
    penalty: float = 1.0


@dataclass
class JudgeConfig:
    """An LLM as the reward (the part "judge"): the template's prompt -> the judge's answer (services.judge) -> the
    parser -> a score; combined with the other parts through reward.weights."""

    # jinja2 template of the judge's prompt over `prompt` and `completion` (the texts) and the row's fields, e.g.
    # "Question: {{ prompt }} Answer: {{ completion }} Reference: {{ ground_truth }}. Is the answer right? yes or no".
    # A judge whose tokenizer has a chat template gets it as a user message.
    template: str = ""
    # How an answer becomes a score: yes_no (1 when it starts with yes, 0 with no), score (the regex's first number,
    # mapped from score_range to [0, 1]), or pkg.mod:fn(answer, row) -> float, or None when it does not parse.
    parser: str = "yes_no"
    # score: the range of the judge's numbers; a number outside it does not parse.
    score_range: list = field(default_factory=lambda: [0, 10])
    # score: the regex whose first group is the number.
    regex: str = r"(-?\d+(?:\.\d+)?)"
    # The reward of a sample whose judgment does not parse (counted in judge/parse_failed_frac).
    fallback: float = 0.0
    # Tokens of the judge's answer at most.
    max_new_tokens: int = 16
    # The judge's sampling temperature; 0: greedy.
    temperature: float = 0.0


@dataclass
class RewardConfig:
    """Rewards: a callable `pkg.mod:fn(prompt, completion, **row_fields) -> float`, a reward model, or both."""

    # The reward callable as pkg.module:function (importable by the trainer ranks); null: the reward model only.
    function: str | None = "hpc_rl.rewards.toy:repeat_digit"
    # Extra keyword arguments passed to every call.
    kwargs: dict = field(default_factory=dict)
    # batched: fn(prompts, completions, **fields_as_lists) -> B floats, for functions that vectorize.
    batched: bool = False
    # A sequence-classification reward model; null: none.
    model: RewardModelConfig | None = None
    # An LLM judge's verdict as a reward part (served by services.judge); null: none.
    judge: JudgeConfig | None = None
    # Nodes of their own for the reward model (placement: server): one reward server on each, after the rollout
    # nodes; 0: each rollout server hosts it, on a GPU of its own.
    nodes: int = 0
    # Weights of the parts when both are given: {function: w, model: w} (a missing part weighs 1.0).
    weights: dict = field(default_factory=dict)
    # A rule-based score `pkg.mod:fn(prompt, completion, **row_fields)` (no reward.kwargs) logged as monitor_mean, never
    # trained on.
    monitor: str | None = None
    # Multiply every (combined) reward by this.
    scale: float = 1.0
    # Standardize rewards with running mean/std over the whole run (kept in checkpoints).
    normalize: bool = False
    # Clip rewards to [-clip, clip] after scaling/normalizing; null: no clipping.
    clip: float | None = None
    # DAPO's soft overlong punishment, added to the reward as the part "overlong".
    overlong: OverlongConfig = field(default_factory=OverlongConfig)

    @property
    def parts(self) -> list[str]:
        """The reward's parts that are trained on: 'function', 'model' and 'judge', those that are set."""
        return [name for name, on in (("function", self.function), ("model", self.model), ("judge", self.judge)) if on]

    @property
    def on_rollout_servers(self) -> bool:
        """Whether each rollout server hosts the reward model (placement server without reward nodes)."""
        return self.model is not None and self.model.placement == "server" and not self.nodes


def check(cfg: JobConfig, need) -> None:
    rw, rm = cfg.reward, cfg.reward.model
    need(rw.clip is None or rw.clip > 0, f"reward.clip must be > 0 (or null); got {rw.clip}")
    ol = rw.overlong
    need(ol.buffer_tokens >= 0 and ol.penalty >= 0, "reward.overlong.buffer_tokens and reward.overlong.penalty must be "
         f">= 0; got {ol.buffer_tokens} and {ol.penalty}")
    budget = cfg.response_budget
    need(ol.buffer_tokens <= budget, f"reward.overlong.buffer_tokens ({ol.buffer_tokens}) exceeds the response budget "
         f"({budget} tokens: {'rollout.max_total_tokens' if cfg.rollout.env else 'rollout.max_new_tokens'}); make "
         "it a part of the budget, e.g. a quarter")
    env = cfg.rollout.env or cfg.rollout.agent  # an agent's reward is the "environment" part, as an env's
    need(bool(rw.parts) or bool(env), "reward: neither reward.function nor reward.model nor reward.judge is set (nor "
         "rollout.env or rollout.agent); "
         "give a reward function (pkg.module:function), a reward model (reward.model.path), a judge, or several")
    for key, w in rw.weights.items():
        need(key in ("function", "model", "judge", "environment"),
             f"reward.weights.{key}: unknown part; the parts are 'function', 'model', 'judge' and 'environment'")
        need(isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w),
             f"reward.weights.{key}: expected a finite number, got {w!r}")
        need(key in rw.parts or (key == "environment" and env), f"reward.weights.{key}: this job has no reward "
             f"{key}; remove the weight or set {'rollout.env' if key == 'environment' else 'reward.' + key}")
    if rw.judge is not None:
        check_judge(cfg, need)
    need(rw.nodes >= 0, f"reward.nodes must be >= 0; got {rw.nodes}")
    need(not rw.nodes or (rm is not None and rm.placement == "server"),
         "reward.nodes: nodes of their own serve a reward model; set reward.model with placement: server, or "
         "reward.nodes: 0")
    if rm is None:
        return
    need((rm.path is None) != (rm.tiny is None), "reward.model: set exactly one of reward.model.path (an HF folder "
         "with a sequence-classification head) and reward.model.tiny (a toy task's tiny reward model)")
    need(rm.label_index is None or rm.label_index >= 0, f"reward.model.label_index must be >= 0; got {rm.label_index}")
    need(rm.max_length >= 2, f"reward.model.max_length must be >= 2 tokens; got {rm.max_length}")
    need(rm.batch_size >= 1, f"reward.model.batch_size must be >= 1; got {rm.batch_size}")
    need(rm.scale != 0, "reward.model.scale must not be 0 (every sample would score the same)")
    r, s = cfg.rollout, cfg.slurm
    if rw.nodes:
        need(not r.local_devices or (len(r.local_devices) - rw.nodes) % r.tensor_parallel == 0 and
             len(r.local_devices) > rw.nodes,
             f"rollout.local_devices: with reward.nodes {rw.nodes} its last {rw.nodes} GPU(s) go to the reward "
             f"servers and the rest to rollout servers of rollout.tensor_parallel {r.tensor_parallel} GPUs each; "
             f"got {len(r.local_devices)}")
        return
    per = cfg.gpus_per_rollout_server
    if rw.on_rollout_servers and s.gpus_per_node and cfg.trainer.device != "cpu":
        gpus = s.rollout_gpus_per_node or s.gpus_per_node
        need(per * r.servers_per_node <= gpus,
             f"reward.model.placement: server gives each rollout server a GPU of its own for the reward model "
             f"((rollout.tensor_parallel + 1) x rollout.servers_per_node = {per * r.servers_per_node}"
             f" GPUs) but a rollout node has {gpus}; lower rollout.servers_per_node or use placement: trainer")
    if rw.on_rollout_servers and r.local_devices:
        need(len(r.local_devices) % per == 0,
             "rollout.local_devices: with reward.model.placement server each rollout server takes "
             f"rollout.tensor_parallel + 1 = {per} GPUs (the last for the reward model); "
             f"got {len(r.local_devices)}")


JUDGE_PARSERS = ("yes_no", "score")


def check_judge(cfg: JobConfig, need) -> None:
    import re

    import jinja2

    j = cfg.reward.judge
    need(cfg.services.judge is not None, "reward.judge: an LLM judge needs services.judge (path: an HF folder served "
         "by the run, or url: an OpenAI-compatible endpoint)")
    need(bool(j.template.strip()), "reward.judge.template: give the judge's prompt, a jinja2 template over {{ prompt "
         "}}, {{ completion }} and the row's fields")
    try:
        jinja2.Environment().parse(j.template)
    except jinja2.TemplateSyntaxError as e:
        need(False, f"reward.judge.template: not a valid jinja2 template ({e.message}, line {e.lineno})")
    need(j.parser in JUDGE_PARSERS or re.fullmatch(r"[\w.]+:\w+", j.parser) is not None,
         f"reward.judge.parser: {j.parser!r}; use yes_no, score or pkg.module:function")
    lo_hi = j.score_range
    need(isinstance(lo_hi, list) and len(lo_hi) == 2 and all(isinstance(v, (int, float)) for v in lo_hi)
         and lo_hi[0] < lo_hi[1], f"reward.judge.score_range: two numbers [low, high] with low < high; got {lo_hi}")
    try:
        need(re.compile(j.regex).groups >= 1, f"reward.judge.regex: {j.regex!r} has no group; the first group is the "
             "number")
    except re.error as e:
        need(False, f"reward.judge.regex: {j.regex!r} is not a regex ({e})")
    need(math.isfinite(j.fallback), f"reward.judge.fallback must be a finite number; got {j.fallback}")
    need(j.max_new_tokens >= 1, f"reward.judge.max_new_tokens must be >= 1; got {j.max_new_tokens}")
    need(j.temperature >= 0, f"reward.judge.temperature must be >= 0 (0: greedy); got {j.temperature}")
