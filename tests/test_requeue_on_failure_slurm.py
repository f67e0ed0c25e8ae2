"""A trainer rank killed on the real local Slurm cluster: with slurm.requeue_on_failure the job is requeued
and resumes from its latest checkpoint to COMPLETED; without it the job fails fast, naming the dead rank."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster.helpers import hpc_rl, metrics_rows, processes_naming, run_logs, status, submitted_run_dir, wait_for  # noqa: E402,F401

from hpc_rl.cluster import slurmq  # noqa: E402
from hpc_rl.rundir import read_json  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
STEPS = 8



def _rank_pid(run: Path, rank: int) -> int | None:
    """The pid of trainer rank `rank` of this run (found through its environment)."""
    for pid, (cmd, env) in processes_naming(run).items():
        if b"hpc_rl.loop" in cmd and str(run).encode() in cmd and f"RANK={rank}".encode() in env.split(b"\0"):
            return pid
    return None


def test_killed_rank_requeues_and_resumes_from_the_checkpoint(slurm_cluster, tmp_path):
    """~80 s: a run on the cluster, a rank killed, Slurm's requeue (its cred_expire delay, 20 s in the test
    cluster) and the second attempt, which must start again and finish."""
    p = hpc_rl("submit", "jobs/toy-grpo-cpu.yaml", f"output_dir={tmp_path}", "trainer.nodes=1", "rollout.nodes=1",
               f"trainer.steps={STEPS}", "checkpoint.every=2", "trainer.prompts_per_step=8",
               "trainer.mini_batch_size=32", "slurm.requeue_on_failure=1", timeout=300)
    run = submitted_run_dir(p.stdout)
    job_id = read_json(run / "slurm.json")["job_id"]
    wait_for(lambda: (run / "checkpoints" / "step_4").is_dir(), 900,
             f"job {job_id} to checkpoint step 4\n{run_logs(run)}", poll_s=1)
    pid = wait_for(lambda: _rank_pid(run, 1), 60, "trainer rank 1's process", poll_s=0.5)
    os.kill(pid, signal.SIGKILL)

    final = wait_for(lambda: (s := status(run))["state"] in slurmq.TERMINAL and s, 1200,
                     f"job {job_id} to be requeued and end\n{run_logs(run)}", poll_s=3)
    assert final["state"] == "COMPLETED", f"{final}\n{run_logs(run)}"
    assert final["requeues"] == 1, final
    logs = "\n".join(f.read_text(errors="replace") for f in sorted((run / "submitit").glob("*_log.*"))
                     + sorted((run / "logs").glob("*.log")))
    assert "trainer rank 1 " in logs and "requeueing job" in logs, run_logs(run)
    assert "resumed from" in (run / "logs" / "trainer-0.log").read_text()
    rows = metrics_rows(run)
    # Steps after the checkpoint that were re-run appear once: the resumed attempt rewrites them.
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), [r["step"] for r in rows]
    assert (run / "checkpoints" / f"step_{STEPS}" / "hf" / "config.json").is_file()
