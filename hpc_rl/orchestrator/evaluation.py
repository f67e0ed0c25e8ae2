"""Rank 0's held-out evaluation: one policy version generates on the eval prompts through the one sample-and-score
path (sampling.py: the servers that generate training samples, with seeds of their own; single-turn prompts or the
episodes of rollout.env), the samples are scored, and the results go to RUN/eval/step_N.jsonl (one row per sample)
and one row of RUN/eval.jsonl (the metrics of eval/pass_at_k.py).

It never runs inside the trainer's step: the rollout pipeline calls it between weight pushes (pipeline.py), so the
version it evaluates is the one the servers hold, and in async mode the trainer does not wait for it.

A sample's score is eval.reward's (else reward.function's and reward.judge's) plus, for multi-turn jobs, its
environment's reward; without eval.reward, reward.monitor is scored too (eval/monitor_mean), and each sample's row
keeps the judge's answer and verdict.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time

import numpy as np

from ..config import JobConfig
from ..data.datasets import PromptDataset
from ..errors import RolloutError
from ..eval.pass_at_k import eval_metrics
from ..metrics import read_metrics, truncate_after
from ..rewards.base import load_reward_fn
from ..rollout.wire.sampling import SamplingParams
from ..rundir import RunDir, write_text_atomic
from . import seeds
from .sampling import Sampler, Scoring

log = logging.getLogger("hpc_rl")

def eval_subset(n: int, max_prompts: int | None, seed: int) -> list[int]:
    """Indices of the prompts evaluated: all, or a fixed seeded subset of max_prompts (the same at every step)."""
    if max_prompts is None or max_prompts >= n:
        return list(range(n))
    return sorted(int(i) for i in np.random.default_rng([seed, 7]).choice(n, max_prompts, replace=False))


def _task(ds: PromptDataset, i: int) -> tuple:
    """What makes row i one task: its prompt after the chat template and its other fields (ids aside): a prompt asked
    again with another answer (the toy lookup task's hidden digits) is another task."""
    row = ds.rows[i]
    return ds.texts[i], tuple(sorted((k, repr(v)) for k, v in row.items() if k not in ("id", "prompt")))


def check_held_out(cfg: JobConfig, train: PromptDataset, held_out: PromptDataset) -> int:
    """Warn when eval rows are also training rows (the same task: see _task); their count."""
    tasks = {_task(held_out, i) for i in eval_subset(len(held_out), cfg.eval.max_prompts, cfg.seed)}
    shared = {text for text, _ in tasks & {_task(train, i) for i in range(len(train))}}
    if shared:
        log.warning("eval.source %s shares %d prompt(s) with data.source %s, e.g. %r: those are not held out; "
                    "evaluate on prompts the run does not train on", cfg.eval.source, len(shared), cfg.data.source,
                    sorted(shared)[0])
    return len(shared)


class EvalLog:
    """RUN/eval.jsonl: one row per evaluation; a resumed run drops the rows past its checkpoint (re-run after it)."""

    def __init__(self, run: RunDir, resume_step: int | None = None):
        self.path = run.eval_log
        if resume_step is not None and self.path.exists():
            truncate_after(self.path, resume_step)
        self._lock = threading.Lock()

    def steps(self, source: str = "train") -> set[int]:
        return {int(r["step"]) for r in read_metrics(self.path) if r.get("source", "train") == source}

    def append(self, row: dict) -> None:
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()


class Evaluator:
    """Evaluates the version the rollout servers hold on the held-out prompts of `cfg.eval`."""

    def __init__(self, cfg: JobConfig, sampler: Sampler, run: RunDir, source: str = "train"):
        self.cfg, self.sampler, self.run, self.source = cfg, sampler, run, source
        e = cfg.eval
        self.dataset = PromptDataset(cfg.eval_data, sampler.tokenizer, cfg.seed, section="eval", vision=sampler.vision)
        self.indices = eval_subset(len(self.dataset), e.max_prompts, cfg.seed)
        if e.reward:
            rw = dataclasses.replace(cfg.reward, function=e.reward, kwargs=dict(e.reward_kwargs))
            self.scoring = Scoring(load_reward_fn(e.reward, "eval.reward"), rw, "eval.reward")
        else:  # training's function and judge (a multi-turn job's environment scores anyway), and its monitor
            self.scoring = dataclasses.replace(sampler.training_scoring(), reward_model=False, overlong=False)
        self.log = None  # the EvalLog rows are appended to (set by the owner: the trainer, or `hpc-rl eval`)

    @property
    def prompts(self) -> int:
        return len(self.indices)

    def evaluate(self, step: int, version: int, served_version: int | None = None) -> dict:
        """Generate with policy `version` (which the servers hold as `served_version`: the same during training, 0
        for a checkpoint loaded offline), score, write eval/step_N.jsonl, append the eval.jsonl row; returns it."""
        served_version = version if served_version is None else served_version
        e, t0 = self.cfg.eval, time.time()
        k = e.samples_per_prompt
        params = SamplingParams(max_new_tokens=e.max_new_tokens or self.cfg.rollout.max_new_tokens,
                                temperature=e.temperature, top_p=e.top_p, top_k=-1, stop_token_ids=self.sampler.stop_ids)
        sampled = self.sampler.sample(self.dataset, self.indices, k, params, seeds.evaluation(self.cfg.seed, step),
                                      step, self.scoring)
        b = sampled.batch
        if set(b.versions) != {served_version}:
            raise RolloutError(f"evaluation of step {step}: the servers answered with policy version(s) "
                               f"{sorted(set(b.versions))}, not {served_version}; a server missed a weight update")
        b = b.episodes()  # an agent's episode of several conversations counts once: its last
        scored = {name: v for name, v in b.reward_parts.items() if name != "monitor"}
        scores = np.sum([np.asarray(v, dtype=np.float64) for name, v in sorted(scored.items())], axis=0).tolist()
        per_prompt = [scores[j:j + k] for j in range(0, len(scores), k)]
        metrics = eval_metrics(per_prompt, e.pass_threshold)
        metrics.update({"eval/response_tokens_mean": float(np.mean([sum(m) for m in b.loss_masks])),
                        "eval/truncated_frac": float(np.mean(b.truncated)),
                        "eval/seconds": time.time() - t0, "eval/prompts": float(len(self.indices))})
        samples = [{"prompt_id": r.get("id"), "prompt": p, "completion": c, "score": s, "truncated": tr}
                   for p, c, r, s, tr in zip(sampled.prompt_texts, sampled.texts, sampled.rows, scores, b.truncated)]
        if "monitor" in b.reward_parts:
            metrics["eval/monitor_mean"] = float(np.mean(b.reward_parts["monitor"]))
            for x, m in zip(samples, b.reward_parts["monitor"]):
                x["monitor"] = m
        if sampled.judgments is not None:  # what the judge said of each sample, and what it was scored
            metrics.update({f"eval/{k}": v for k, v in sampled.judgments.stats().items()})
            for x, answer, verdict in zip(samples, sampled.judgments.answers, sampled.judgments.scores):
                x["judge_answer"], x["judge_score"] = answer, verdict
        path = self.run.eval_samples(step, self.source)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, "".join(json.dumps(x) + "\n" for x in samples))
        row = {"step": step, "policy_version": version, "source": self.source, "k": k,
               "temperature": e.temperature, "pass_threshold": e.pass_threshold, "time": time.time(), **metrics}
        if self.log is not None:
            self.log.append(row)
        # The step line shows it (one line per step); `hpc-rl eval` prints its own line.
        log.debug("eval of step %d (policy version %d, %d prompts x %d): pass@1 %.3f | reward %.3f | %.1fs",
                  step, version, len(self.indices), k, metrics["eval/pass@1"], metrics["eval/reward_mean"],
                  metrics["eval/seconds"])
        return row
