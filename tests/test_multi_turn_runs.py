"""Multi-turn runs (jobs/toy-tool-cpu.yaml) are as reproducible as single-turn ones: each turn samples with the seed of
(run seed, step, sample, turn), so the waves' timing changes no sample; a run stopped at a checkpoint and resumed
generates exactly the samples of a straight one; and the job evaluates through the same multi-turn episodes."""

import json

import pytest

from hpc_rl.metrics import read_metrics
from tests.runs import hpc_rl, only_run

from .test_pipeline import REPO

JOB = REPO / "jobs" / "toy-tool-cpu.yaml"
# A constant lr: a decay spans trainer.steps, so a 2-step run resumed to 4 would not match a 4-step run.
COMMON = ["trainer.lr_schedule=constant", "trainer.prompts_per_step=16", "trainer.mini_batch_size=32",
          "eval.every=2", "eval.max_prompts=8"]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("straight")
    r = hpc_rl("run", JOB, "trainer.steps=4", "checkpoint.every=0", *COMMON, cwd=cwd)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return only_run(cwd)


def test_a_multi_turn_job_evaluates_through_its_episodes(straight):
    rows = read_metrics(straight / "eval.jsonl")
    assert [e["step"] for e in rows] == [0, 2, 4]
    for e in rows:
        assert e["eval/prompts"] == 8 and e["k"] == 1 and 0 <= e["eval/pass@1"] <= 1
    samples = [json.loads(x) for x in (straight / "eval" / "step_0.jsonl").read_text().splitlines()]
    assert len(samples) == 8
    assert all(s["prompt"].startswith("find ") and s["prompt"][-1] in "iklno" for s in samples)  # held-out keys
    assert all(isinstance(s["score"], float) for s in samples)


def test_a_resumed_multi_turn_run_generates_the_straight_runs_samples(straight, tmp_path):
    r = hpc_rl("run", JOB, "trainer.steps=2", "checkpoint.every=2", *COMMON, cwd=tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    run = only_run(tmp_path)
    r = hpc_rl("run", JOB, "--resume", run, "trainer.steps=4", "checkpoint.every=2", *COMMON, cwd=tmp_path)
    assert r.returncode == 0 and "resumed from" in r.stdout, (r.stdout + r.stderr)[-3000:]
    resumed, want = read_metrics(run / "metrics.jsonl"), read_metrics(straight / "metrics.jsonl")
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for key in ("samples_sha1", "reward_mean", "prompt_ids", "tool_calls_per_sample"):
        assert [m[key] for m in resumed] == [m[key] for m in want], key
    # The evaluations are the same too (their seeds are the step's, whoever runs them).

    def evals(r):
        return [{k: v for k, v in e.items() if k not in ("time", "eval/seconds")} for e in read_metrics(r / "eval.jsonl")]

    assert evals(run) == evals(straight)
