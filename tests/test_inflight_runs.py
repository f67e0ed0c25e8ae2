"""`hpc-rl run` with rollout.inflight_updates: pushes land while a batch is generated, the later tokens of a sample
come from the newer weights and say so, every token's log-prob is its own version's (rescored by that version's
checkpoint), and a run killed mid-way resumes from its checkpoint with the batch it generated ahead."""

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
STEPS = 6
# Long generations in small chunks against a small training batch: the trainer's pushes come while a batch is still
# being generated (most of each step), as on GPUs where the longest responses decide the step time.
OVERRIDES = [f"trainer.steps={STEPS}", "rollout.async_steps=1", "rollout.inflight_updates=true",
             "rollout.max_new_tokens=40", "rollout.hf_batch_samples=4", "trainer.prompts_per_step=4",
             "trainer.mini_batch_size=32", "checkpoint.every=1", "checkpoint.keep_last=20",
             "logging.tensorboard=false"]
pytestmark = pytest.mark.slow


def _start(cwd: Path, log: Path, *extra: str) -> subprocess.Popen:
    return start_run(TOY, cwd, log, *OVERRIDES, *extra)


@pytest.fixture(scope="module")
def inflight_run(tmp_path_factory):
    """One run, killed (SIGKILL) after step 3 and resumed to the end; its logs."""
    cwd = tmp_path_factory.mktemp("inflight")
    log = cwd / "a0.log"
    proc = _start(cwd, log)
    found = poll("the run dir", lambda: list((cwd / "runs").glob("*/job.yaml")), 300, proc, log)
    run = RunDir(found[0].parent)
    kill_at_step(proc, run.root, log, 3, STEPS)
    log = cwd / "a1.log"
    proc = _start(cwd, log, "--resume", str(run.root))
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    return run, log


def test_pushes_land_in_flight_and_tokens_carry_their_versions(inflight_run):
    run, _ = inflight_run
    rows = read_metrics(run.metrics)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        # Batch s starts with version s - 1: no token is older, and tokens after an in-flight push are newer.
        assert r["policy_lag_max"] == min(r["step"] - 1, 1), r
        assert 0 <= r["token_lag_mean"] <= r["token_lag_max"] <= r["policy_lag_max"], r
        assert 0 <= r["inflight_mixed_frac"] <= 1
    # From step 2 every batch starts with the version before the trainer's: newer tokens bring the mean below 1.
    assert any(r["token_lag_mean"] < 1 for r in rows[1:]), rows
    assert any(r["inflight_mixed_frac"] > 0 for r in rows), rows


def test_every_token_is_its_own_versions(inflight_run):
    """The batches checkpoints hold (generated ahead) are rescored, token by token, by the checkpoint of the version
    each token reports: they agree, the tokens after an in-flight push included."""
    run, _ = inflight_run
    batches = [b for step in range(1, STEPS) for b in checkpoint.load_pending(checkpoints.step_dir(run, step))]
    assert check_each_token_is_its_versions(run, batches) > 0, "no sample changed version: no push landed in flight"


def test_a_killed_inflight_run_resumes_with_its_batch_generated_ahead(inflight_run):
    run, log = inflight_run
    assert re.search(r"resumed from \S+ \(step \d+, 1 batch\(es\) generated ahead\)", log.read_text()), \
        log.read_text()[-3000:]
    assert [r["step"] for r in read_metrics(run.metrics)] == list(range(1, STEPS + 1))
