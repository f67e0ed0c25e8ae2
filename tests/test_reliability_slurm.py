"""Preemption on the real local Slurm cluster: the warning signal (what `--signal=USR2@N` delivers, sent here
with scancel) -> every trainer rank stops at the same step boundary with a checkpoint -> submitit requeues ->
the same run dir resumes with new rollout servers -> COMPLETED, same step count and data order, requeue count
in `hpc-rl status`. While it runs: the run's token is on no command line, in no environment, in neither the
sbatch script nor `scontrol show job`."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster.helpers import hpc_rl, metrics_rows, processes_naming, run_logs, status, submitted_run_dir, wait_for  # noqa: E402,F401

from hpc_rl import config  # noqa: E402
from hpc_rl.cluster import slurmq  # noqa: E402
from hpc_rl.data.sampler import indices_for_step  # noqa: E402
from hpc_rl.rundir import read_json  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
STEPS = 24  # still training when the signal comes after the checks (a step takes ~0.4 s on a fast machine)
RANGE_STEPS = 40  # the node range test's run: still training when the preemption signal comes


def _requeued_once_and_resumed_from_the_preemption_checkpoint(run, job_id, before: int,
                                                              steps: int = STEPS) -> tuple[str, int]:
    """Wait for the job to end: COMPLETED after one requeue, resumed from the step the preemption checkpointed
    (at or after `before`); returns rank 0's log and that step."""
    final = wait_for(lambda: (s := status(run))["state"] in slurmq.TERMINAL and s, 1200,
                     f"job {job_id} to be requeued and end\n{run_logs(run)}", poll_s=3)
    assert final["state"] == "COMPLETED", f"{final}\n{run_logs(run)}"
    assert final["requeues"] == 1, final
    log0 = (run / "logs" / "trainer-0.log").read_text()
    m = re.search(r"preempted: checkpoint of step (\d+) written", log0)
    assert m, run_logs(run)
    k = int(m.group(1))
    assert before <= k < steps
    assert re.search(rf"resumed from \S+/step_{k} \(step {k}\)", log0), log0[-3000:]
    return log0, k



def test_usr_signal_checkpoints_requeues_and_resumes_exactly(slurm_cluster, tmp_path):
    """~75 s: two attempts of one job (the signal, its checkpoint, Slurm's requeue delay of 20 s in the test
    cluster, the resumed attempt to the end), as on a cluster that preempts."""
    p = hpc_rl("submit", "jobs/toy-grpo-cpu.yaml", f"output_dir={tmp_path}", "trainer.nodes=1", "rollout.nodes=1",
               f"trainer.steps={STEPS}", "checkpoint.every=0", "trainer.prompts_per_step=8",
               "trainer.mini_batch_size=32", "slurm.signal_delay_s=60", timeout=300)
    run = submitted_run_dir(p.stdout)
    job_id = read_json(run / "slurm.json")["job_id"]
    wait_for(lambda: len(metrics_rows(run)) >= 2, 900, f"job {job_id} to train 2 steps\n{run_logs(run)}", poll_s=1)

    # The token: never on a command line, in an environment, in the sbatch script or in scontrol's view.
    token = (run / "token").read_text().strip().encode()
    procs = processes_naming(run)
    assert len(procs) >= 4, procs  # submitit tasks, 2 trainer ranks, the rollout server
    for pid, (cmd, env) in procs.items():
        assert token not in cmd and token not in env, f"token visible in process {pid}: {cmd[:200]!r}"
    script = next((run / "submitit").glob("*_submission.sh")).read_bytes()
    assert token not in script
    shown = subprocess.run(["scontrol", "show", "job", "-dd", str(job_id)], capture_output=True, timeout=60)
    assert shown.returncode == 0 and str(job_id).encode() in shown.stdout
    assert token not in shown.stdout + shown.stderr
    batch = subprocess.run(["scontrol", "write", "batch_script", str(job_id), "-"], capture_output=True, timeout=60)
    assert token not in batch.stdout

    before = len(metrics_rows(run))
    t_signal = time.time()
    sig = subprocess.run(["scancel", "--signal=USR2", str(job_id)], capture_output=True, text=True, timeout=60)
    assert sig.returncode == 0, sig.stderr
    log0, k = _requeued_once_and_resumed_from_the_preemption_checkpoint(run, job_id, before)
    table = hpc_rl("status", "--runs-dir", str(tmp_path)).stdout
    assert "COMPLETED (requeued 1x)" in table, table
    assert "Traceback" not in log0

    rows = metrics_rows(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    cfg = config.load(run / "job.yaml")
    for r in rows:  # the data order of an uninterrupted run
        assert r["prompt_ids"] == indices_for_step(cfg.data.toy_size, 8, cfg.seed, r["step"] - 1)
        assert r["policy_version"] == r["step"]
    # New rollout servers after the requeue (the preamble cleared the old addresses), weights re-pushed.
    assert (run / "rendezvous" / "done.json").is_file()
    resumed_at = (run / "metrics.jsonl").stat().st_mtime
    out = next(iter(sorted((run / "submitit").glob("*_0_log.out")))).read_text()
    assert "requeued 1 time(s)" in out or "attempt 2" in out, out[-2000:]
    print(f"\npreempted at step {k}; signal -> job completed {resumed_at - t_signal:.0f}s")


def test_hetjob_usr2_to_the_batch_shell_checkpoints_then_requeues(slurm_cluster, tmp_path):
    """slurm.layout=hetjob: --signal=B:USR2 reaches only the batch shell (sent here with scancel --batch). Its
    trap passes the signal on to the trainer component, whose ranks checkpoint at a step boundary; then the job
    is requeued and resumes from exactly that checkpoint (not from the last periodic one: checkpoint.every=0)."""
    p = hpc_rl("submit", "jobs/toy-grpo-cpu.yaml", f"output_dir={tmp_path}", "slurm.layout=hetjob",
               "trainer.nodes=1", "rollout.nodes=1", f"trainer.steps={STEPS}", "checkpoint.every=0",
               "trainer.prompts_per_step=8", "trainer.mini_batch_size=32", "slurm.signal_delay_s=60", timeout=300)
    run = submitted_run_dir(p.stdout)
    job_id = read_json(run / "slurm.json")["job_id"]
    wait_for(lambda: len(metrics_rows(run)) >= 2, 900, f"hetjob {job_id} to train 2 steps\n{run_logs(run)}",
             poll_s=1)
    before = len(metrics_rows(run))
    sig = subprocess.run(["scancel", "--batch", "--signal=USR2", str(job_id)], capture_output=True, text=True,
                         timeout=60)
    assert sig.returncode == 0, sig.stderr
    _requeued_once_and_resumed_from_the_preemption_checkpoint(run, job_id, before)
    assert [r["step"] for r in metrics_rows(run)] == list(range(1, STEPS + 1))
    batch_out = next((run / "submitit").glob("*_batch.out")).read_text()
    assert "caught USR2; the trainer ranks checkpoint" in batch_out, batch_out[-2000:]


def test_rollout_node_whose_server_cannot_start_ends_the_job(slurm_cluster, tmp_path):
    """On a Slurm rollout node a server that cannot start (code 2: rollout.host is no address of the node) ends
    the job within seconds (it does not sit idle until rollout.startup_timeout_s), and the trainer's log names
    the server, its node and the error line."""
    p = hpc_rl("submit", "jobs/toy-grpo-cpu.yaml", f"output_dir={tmp_path}", "trainer.nodes=1", "rollout.nodes=1",
               "trainer.steps=4", "rollout.host=192.0.2.1", "rollout.startup_timeout_s=900", timeout=300)
    run = submitted_run_dir(p.stdout)
    job_id = read_json(run / "slurm.json")["job_id"]
    final = wait_for(lambda: (s := status(run))["state"] in slurmq.TERMINAL and s, 600,
                     f"job {job_id} to end\n{run_logs(run)}", poll_s=2)
    assert final["state"] == "FAILED", f"{final}\n{run_logs(run)}"
    failed = read_json(run / "rendezvous" / "failed-rollout-0.json")
    assert failed["code"] == 2 and failed["node"] in ("n1", "n2", "n3") and not failed["served"], failed
    assert "cannot bind 192.0.2.1" in failed["message"], failed
    started = read_json(run / "attempts.json")["started"]
    assert (run / "rendezvous" / "failed-rollout-0.json").stat().st_mtime - started < 120
    logs = run_logs(run)
    assert f"rollout server 0 on node {failed['node']} exited with code 2 before it served" in logs, logs


def test_a_node_range_takes_what_is_free_and_a_requeue_resumes_on_fewer_trainer_nodes(slurm_cluster, tmp_path):
    """trainer.nodes 1-2 with one rollout node on the 3-node test cluster (sbatch --nodes=2-3): the first attempt gets
    2 trainer nodes (one rank each). One of the job's nodes is drained, then the job is preempted (USR2): it
    checkpoints, Slurm requeues it, the next attempt gets the 2 nodes left (1 trainer node) and resumes the 2-rank
    checkpoint on 1 rank; the run ends with every step in the uninterrupted data order, and `hpc-rl status` shows
    the trainer's size per attempt."""
    p = hpc_rl("submit", "jobs/toy-grpo-cpu.yaml", f"output_dir={tmp_path}", "trainer.nodes=1-2", "rollout.nodes=1",
               "trainer.procs_per_node=1", f"trainer.steps={RANGE_STEPS}", f"checkpoint.every={RANGE_STEPS // 2}",
               "trainer.prompts_per_step=8", "trainer.mini_batch_size=32", "slurm.signal_delay_s=60", timeout=300)
    assert "2-3 nodes" in p.stdout, p.stdout
    run = submitted_run_dir(p.stdout)
    job_id = read_json(run / "slurm.json")["job_id"]
    script = next((run / "submitit").glob("*_submission.sh")).read_text()
    assert "#SBATCH --nodes=2-3" in script and script.count("--nodes=") == 1, script
    assert "#SBATCH --spread-job" in script and "#SBATCH --ntasks-per-node" not in script, script
    wait_for(lambda: len(metrics_rows(run)) >= 2, 900, f"job {job_id} to train 2 steps\n{run_logs(run)}", poll_s=1)
    assert read_json(run / "attempts.json")["history"][-1]["trainer_nodes"] == 2
    node = "n3"
    drain = subprocess.run(["scontrol", "update", f"nodename={node}", "state=drain", "reason=hpc-rl node range test"],
                           capture_output=True, text=True, timeout=60)
    assert drain.returncode == 0, drain.stderr
    try:
        before = len(metrics_rows(run))
        sig = subprocess.run(["scancel", "--signal=USR2", str(job_id)], capture_output=True, text=True, timeout=60)
        assert sig.returncode == 0, sig.stderr
        log0, k = _requeued_once_and_resumed_from_the_preemption_checkpoint(run, job_id, before, RANGE_STEPS)
    finally:
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True, timeout=60)
    assert read_json(run / "attempts.json")["history"][-1]["trainer_nodes"] == 1
    assert "checkpoint written by 2 trainer rank(s), resumed on 1: the optimizer state of actor re-partitioned" in log0
    info = status(run)
    assert info["trainer_nodes"] == [2, 1], info
    table = hpc_rl("status", "--runs-dir", str(tmp_path)).stdout
    assert "COMPLETED (requeued 1x) trainer nodes 2 -> 1" in table, table
    rows = metrics_rows(run)
    assert [r["step"] for r in rows] == list(range(1, RANGE_STEPS + 1))
    cfg = config.load(run / "job.yaml")
    assert cfg.trainer.nodes == "1-2"  # the range stays the job's: a later attempt may grow again
    for r in rows:
        assert r["prompt_ids"] == indices_for_step(cfg.data.toy_size, 8, cfg.seed, r["step"] - 1)
    assert "Traceback" not in log0

    # `hpc-rl submit --resume RUN trainer.nodes=2`: a new job for the ended run, 2 more steps on 2 trainer nodes from
    # its last checkpoint (step 40, written by the 1 rank of the second attempt).
    p = hpc_rl("submit", "jobs/toy-grpo-cpu.yaml", "--resume", str(run), "trainer.nodes=2",
               f"trainer.steps={RANGE_STEPS + 2}", timeout=300)
    assert f"run dir: {run}" in p.stdout, p.stdout
    second = read_json(run / "slurm.json")["job_id"]
    assert second != job_id
    final = wait_for(lambda: (s := status(run))["state"] in slurmq.TERMINAL and s, 900,
                     f"job {second} to end\n{run_logs(run)}", poll_s=2)
    assert final["state"] == "COMPLETED" and final["trainer_nodes"] == [2, 1, 2], f"{final}\n{run_logs(run)}"
    log0 = (run / "logs" / "trainer-0.log").read_text()
    assert "checkpoint written by 1 trainer rank(s), resumed on 2" in log0, log0[-3000:]
    assert [r["step"] for r in metrics_rows(run)] == list(range(1, RANGE_STEPS + 3))
    assert config.load(run / "job.yaml").trainer.nodes == 2


def test_a_node_range_beyond_the_partition_is_refused_at_submit(slurm_cluster, tmp_path):
    p = hpc_rl("submit", "jobs/toy-grpo-cpu.yaml", f"output_dir={tmp_path}", "trainer.nodes=1-4", "rollout.nodes=1",
               "trainer.procs_per_node=1", "trainer.prompts_per_step=12", "trainer.mini_batch_size=48", check=False,
               timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert ("trainer.nodes: the job needs up to 5 nodes but the default partition has 3; lower trainer.nodes"
            in p.stderr), p.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
