"""The eval section: held-out evaluation during training, and the metrics it reports."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .job import JobConfig


@dataclass
class EvalConfig:
    """Held-out evaluation during training: the policy of a step generates on prompts it never trains on, on the
    rollout servers, with seeds of its own (training samples are the same with evaluation on or off)."""

    # The held-out prompts, in any form data.source takes (toy:NAME, a .jsonl/.parquet file, hf:NAME,
    # reasoning_gym:TASK); null: none.
    source: str | None = None
    # Settings of a reasoning_gym: source (as data.kwargs); null: data.kwargs. Its seed defaults to the job's seed +
    # 1000003, so that the items are not the training items.
    kwargs: dict | None = None
    # The split of an hf: dataset or of a toy task (toy tasks with held-out prompts have a test split).
    split: str = "test"
    # The row field holding the prompt (null: data.prompt_key).
    prompt_key: str | None = None
    # Evaluate every N steps and after the last step; 0: only after the last step.
    every: int = 0
    # Also evaluate the initial policy (step 0): the baseline the later numbers are read against.
    at_start: bool = True
    # Samples per prompt k: pass@k is reported for k = 1, 2, 4, ... up to it (unbiased estimator).
    samples_per_prompt: int = 1
    # Sampling temperature; 0 is greedy (then samples_per_prompt must be 1).
    temperature: float = 0.0
    # Nucleus sampling mass (1: off).
    top_p: float = 1.0
    # Longest response in tokens; null: rollout.max_new_tokens.
    max_new_tokens: int | None = None
    # Evaluate a fixed, seeded subset of this many prompts; null: all of them.
    max_prompts: int | None = None
    # The scoring function pkg.module:function (as reward.function); null: reward.function with reward.kwargs.
    reward: str | None = None
    # Keyword arguments of eval.reward (only when eval.reward is set).
    reward_kwargs: dict = field(default_factory=dict)
    # A sample passes (pass@k) when its score is >= this.
    pass_threshold: float = 1.0

    @property
    def enabled(self) -> bool:
        return self.source is not None

    def due(self, step: int, last_step: int) -> bool:
        """Whether the policy after `step` steps (0: the initial one) is evaluated."""
        if not self.enabled:
            return False
        if step == 0:
            return self.at_start
        return step == last_step or (self.every > 0 and step % self.every == 0)


def pass_k_values(k: int) -> list[int]:
    """The k' of the pass@k' an evaluation with k samples per prompt reports: 1, 2, 4, ... below k, and k."""
    ks, j = [], 1
    while j < k:
        ks.append(j)
        j *= 2
    return ks + [k]


def eval_metric_names(k: int) -> list[str]:
    """The eval/ metrics an evaluation with k samples per prompt reports (eval/pass_at_k.py computes them)."""
    return (["eval/reward_mean", f"eval/mean@{k}"] + [f"eval/pass@{j}" for j in pass_k_values(k)]
            + ["eval/response_tokens_mean", "eval/truncated_frac"])


def check(cfg: JobConfig, need) -> None:
    e = cfg.eval
    if not e.enabled:
        return
    need(bool(str(e.source).strip()), "eval.source must name held-out prompts (toy:NAME, a file, hf:NAME) or be null")
    need(e.every >= 0, f"eval.every must be >= 0 (0: only after the last step); got {e.every}")
    if e.every > cfg.trainer.steps:  # a shortened run (trainer.steps=5) still evaluates once, after its last step
        logging.getLogger("hpc_rl").warning("eval.every (%d) is beyond trainer.steps (%d): only the evaluation after the "
                                            "last step runs", e.every, cfg.trainer.steps)
    need(e.samples_per_prompt >= 1, f"eval.samples_per_prompt must be >= 1 (the k of pass@k); got {e.samples_per_prompt}")
    need(e.temperature >= 0, f"eval.temperature must be >= 0 (0: greedy); got {e.temperature}")
    need(e.temperature > 0 or e.samples_per_prompt == 1,
         f"eval.samples_per_prompt is {e.samples_per_prompt} but eval.temperature is 0 (greedy): every sample "
         "would be the same; set eval.temperature > 0 (e.g. 0.6) or eval.samples_per_prompt: 1")
    need(0 < e.top_p <= 1, f"eval.top_p must be in (0, 1]; got {e.top_p}")
    need(e.max_new_tokens is None or e.max_new_tokens >= 1, f"eval.max_new_tokens must be >= 1; got {e.max_new_tokens}")
    need(e.max_new_tokens is None or e.max_new_tokens < cfg.rollout.max_model_len - cfg.data.max_prompt_tokens + 1,
         f"eval.max_new_tokens ({e.max_new_tokens}) does not fit rollout.max_model_len - data.max_prompt_tokens "
         f"({cfg.rollout.max_model_len - cfg.data.max_prompt_tokens})")
    need(e.max_prompts is None or e.max_prompts >= 1, f"eval.max_prompts must be >= 1 or null (all); got {e.max_prompts}")
    need(e.reward is not None or cfg.reward.function is not None or cfg.reward.judge is not None
         or cfg.rollout.env is not None or cfg.rollout.agent is not None,
         "eval.reward: this job has no reward.function or reward.judge to score held-out samples with; name a scoring function "
         "(pkg.module:function, e.g. a strict exact match)")
    need(e.reward is not None or not e.reward_kwargs,
         "eval.reward_kwargs are the arguments of eval.reward, which is not set; set eval.reward or remove them")
