"""`hpc-rl run` with rollout.partial: responses still running when a step's batch is full are carried over and
continued with the next step's weights (every token's log-prob is its own version's), the checkpoint keeps them,
and a run killed by SIGKILL resumes on exactly the data of an uninterrupted one."""

import json
import re
import subprocess
from pathlib import Path

import pytest

from hpc_rl import checkpoints
from hpc_rl.metrics import read_metrics
from hpc_rl.rundir import RunDir
from hpc_rl.train import checkpoint

from .local_run import kill_at_step, poll, start_run
from .logprob_checks import check_each_token_is_its_versions

REPO = Path(__file__).resolve().parent.parent
TOY = REPO / "jobs" / "toy-grpo-cpu.yaml"
STEPS = 5
# Responses end at any digit, so their lengths vary (up to 12 tokens), and a step generates 2 tokens a segment: the
# batch is full while the longest groups still run.
OVERRIDES = [f"trainer.steps={STEPS}", "rollout.async_steps=1", "rollout.partial=true", "rollout.max_new_tokens=12",
             "rollout.partial_tokens=2", 'rollout.stop=["0","1","2","3","4","5","6","7","8","9"]',
             "trainer.prompts_per_step=8", "trainer.mini_batch_size=32", "checkpoint.every=1",
             "checkpoint.keep_last=20", "logging.tensorboard=false"]
pytestmark = pytest.mark.slow


def _start(cwd: Path, log: Path, *extra: str) -> subprocess.Popen:
    return start_run(TOY, cwd, log, *OVERRIDES, *extra)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("partial")
    log = cwd / "run.log"
    proc = _start(cwd, log)
    assert proc.wait(timeout=900) == 0, log.read_text()[-3000:]
    return RunDir(next((cwd / "runs").glob("*/job.yaml")).parent)


def _pools(run: RunDir) -> list[list[dict]]:
    return [json.loads((checkpoints.step_dir(run, s) / "trainer_state.json").read_text())["partial_rollouts"]["pool"]
            for s in range(1, STEPS + 1)]


def test_running_responses_are_carried_over_and_continued_with_newer_weights(straight):
    rows = read_metrics(straight.metrics)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["partial_carried_groups"] > 0 for r in rows)
    assert any(s["finish"] is None for pool in _pools(straight) for g in pool for s in g["samples"])
    # A carried group is trained a step later than it began: its oldest tokens lag one version more.
    assert max(r["policy_lag_max"] for r in rows) >= 2
    assert all(r["stale_dropped_groups"] == 0 for r in rows)  # no rollout.max_token_staleness: nothing dropped
    batches = [b for s in range(1, STEPS) for b in checkpoint.load_pending(checkpoints.step_dir(straight, s))]
    assert check_each_token_is_its_versions(straight, batches) > 0, "no trained sample was continued across versions"


def test_sigkill_resumes_on_exactly_the_uninterrupted_data(straight, tmp_path):
    log = tmp_path / "a0.log"
    proc = _start(tmp_path, log)
    found = poll("the run dir", lambda: list((tmp_path / "runs").glob("*/job.yaml")), 300, proc, log)
    run = RunDir(found[0].parent)
    kill_at_step(proc, run.root, log, 3, STEPS)
    log = tmp_path / "a1.log"
    proc = _start(tmp_path, log, "--resume", str(run.root))
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    assert re.search(r"resumed from \S+ \(step \d+, 1 batch\(es\) generated ahead\)", log.read_text()), \
        log.read_text()[-3000:]
    rows, want = read_metrics(run.metrics), read_metrics(straight.metrics)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for a, b in zip(rows, want):
        for key in ("samples_sha1", "reward_mean", "prompt_ids", "partial_segments", "partial_carried_groups"):
            assert a[key] == b[key], (a["step"], key)
    assert _pools(run) == _pools(straight)
