"""DAPO's recipe end to end on the CPU toy (jobs/toy-dapo-cpu.yaml: dynamic sampling, clip-higher, an overlong
buffer): the toy learns to the toys' criterion and to stop before the buffer; with CISPO and truncated samples
masked it logs what dynamic sampling did each step, trains only groups with a reward spread while the rounds last,
and a resumed run replays exactly the rounds and samples of an uninterrupted one."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_rl.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent
JOB = str(REPO / "jobs" / "toy-dapo-cpu.yaml")
pytestmark = pytest.mark.slow


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "hpc_rl.cli", "run", *args], capture_output=True, text=True, cwd=cwd,
                       timeout=1800, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def test_dynamic_sampling_resume_replays_the_same_rounds(tmp_path):
    """A run stopped after 2 steps and resumed to 4 generates the same rounds, prompts and samples as a 4-step run
    (a constant lr: a decay spans trainer.steps); with truncated samples masked out of the loss and CISPO."""
    common = ["checkpoint.every=2", "trainer.lr_schedule=constant", "trainer.prompts_per_step=16",
              "trainer.mini_batch_size=32", "algorithm.mask_truncated=true", "algorithm.policy_loss=cispo"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _run(tmp_path / "a", JOB, "trainer.steps=4", *common)
    _run(tmp_path / "b", JOB, "trainer.steps=2", *common)
    (run_b,) = list((tmp_path / "b" / "runs").iterdir())
    r = _run(tmp_path / "b", JOB, "--resume", str(run_b), "trainer.steps=4")
    assert "resumed from" in r.stdout
    (run_a,) = list((tmp_path / "a" / "runs").iterdir())
    straight, resumed = read_metrics(run_a / "metrics.jsonl"), read_metrics(run_b / "metrics.jsonl")
    assert [x["step"] for x in resumed] == [1, 2, 3, 4]
    for key in ("prompt_ids", "samples_sha1", "gen_batches", "prompts_consumed", "generated_reward_mean"):
        assert [x[key] for x in resumed] == [x[key] for x in straight], key
    for row in straight:
        assert 0 < row["groups_kept_frac"] <= 1 and row["prompts_consumed"] >= 16 and 0 <= row["truncated_frac"] <= 1
        if row["gen_batches"] < 4:  # the rounds did not run out: every trained group has a reward spread
            assert row["groups_with_spread_frac"] == 1.0
    assert "groups kept" in r.stdout and "generated reward" in r.stdout  # in the step line


def test_toy_dapo_job_learns_and_stops_before_the_overlong_buffer(tmp_path):
    """The job as users copy it, 80 steps (~80 s): the task reward of every generated sample (the trained batch's is
    of groups chosen for their spread) rises to the toys' criterion, the samples cut by the budget go from most
    to almost none, dynamic sampling takes extra rounds as the easy groups stop having a spread, and it says so."""
    r = _run(tmp_path, JOB, "checkpoint.every=0")
    (run,) = list((tmp_path / "runs").iterdir())
    rows = read_metrics(run / "metrics.jsonl")
    gen = [row["generated_reward_mean"] for row in rows]
    trunc = [row["truncated_frac"] for row in rows]
    first, last5 = gen[0], sum(gen[-5:]) / 5
    print(f"toy DAPO: generated reward first {first:.3f}, last-5 {last5:.3f}, truncated {trunc[0]:.2f} -> "
          f"{sum(trunc[-5:]) / 5:.2f}, groups kept {[round(row['groups_kept_frac'], 2) for row in rows[::10]]}")
    assert last5 >= 0.8 and last5 - first >= 0.6, gen
    assert trunc[0] >= 0.5 and sum(trunc[-5:]) / 5 <= 0.05, trunc
    assert all(0 < row["groups_kept_frac"] <= 1 for row in rows)
    assert max(row["gen_batches"] for row in rows[-10:]) > 1  # the rounds grow as groups turn all-right
    assert "groups with a reward spread after" in r.stdout + r.stderr  # the warning once the rounds run out
