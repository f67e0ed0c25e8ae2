"""What runs on every node of a submitted job: read the node's place in the job, set its
environment, and hand over to `hpc_rl.launch.run_node` (the same code `hpc-rl run` uses).

Submitted through submitit as `NodeTask(run_dir)` (picklable); the hetjob script runs
`python -m hpc_rl.cluster.task RUN_DIR --node-offset K --num-nodes N` instead.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import submitit

from .. import config
from ..errors import ClusterError
from ..launch import job_of_attempt, preempt_trainers, run_local, run_node
from ..logs import setup_logging
from ..rundir import RunDir
from .env import prepare_node_env
from .layout import role_of
from .render import checkpoint_wait_s

log = logging.getLogger("hpc_rl")


def run_this_node(run_dir: str | Path, node_index: int, num_nodes: int) -> int:
    """Prepare this node's environment and run its role; returns launch.run_node's exit code."""
    setup_logging(rank=0)
    run = RunDir(Path(run_dir))
    cfg = job_of_attempt(run, num_nodes)
    prepare_node_env(cfg)
    log.info("node %d/%d on %s (%s): %s", node_index, num_nodes, socket.gethostname(),
             os.environ.get("HPC_RL_NODE_ADDR"), role_of(cfg, node_index))
    if cfg.rollout.nodes == 0 and num_nodes == 1:
        # rollout.nodes=0: the rollout server(s) share the trainer's node, exactly as in `hpc-rl run`.
        return int(run_local(run, cfg) or 0)
    return int(run_node(run, node_index, num_nodes) or 0)


def requeue_after_failure(run_dir: Path, rc: int) -> bool:
    """Requeue the job after a trainer crash, while slurm.requeue_on_failure allows; True when requeued.

    Exit code 2 (a user error: bad data, a failing reward) is never retried: it would fail again.
    """
    run = RunDir(run_dir)
    allowed = config.load(run.job_yaml).slurm.requeue_on_failure
    done = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job = f"{array_job}_{array_task}" if array_job and array_task else os.environ.get("SLURM_JOB_ID")
    if not job or done >= allowed:
        if allowed:
            log.error("the trainer failed (exit code %d) and the job was already requeued %d time(s) "
                      "(slurm.requeue_on_failure=%d): giving up", rc, done, allowed)
        return False
    log.error("the trainer failed (exit code %d); requeueing job %s (%d of slurm.requeue_on_failure=%d): it "
              "resumes from the latest checkpoint", rc, job, done + 1, allowed)
    r = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        log.error("scontrol requeue %s failed: %s", job, (r.stderr or r.stdout).strip())
        return False
    return True


class NodeTask:
    """The callable submitit runs once per node (one task per node)."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = str(run_dir)

    def __call__(self) -> int:
        env = submitit.JobEnvironment()
        rc = run_this_node(self.run_dir, env.node, env.num_nodes)
        # Any node may ask: the first to see the crash requeues the whole job (later asks are refused).
        if rc not in (0, 2) and requeue_after_failure(Path(self.run_dir), rc):
            return rc  # Slurm now ends this attempt and starts the job again
        if rc != 0:
            # An exception makes submitit record the failure and exit non-zero, so that srun
            # (--kill-on-bad-exit) ends the other nodes and Slurm shows the job FAILED.
            raise ClusterError(f"node {env.node} ({socket.gethostname()}) of run {Path(self.run_dir).name} "
                               f"exited with code {rc}; see `hpc-rl logs {self.run_dir}`")
        return rc

    def checkpoint(self, *args, **kwargs):
        """Preemption or time limit: the trainer ranks checkpoint at the next step boundary and exit, then
        submitit requeues the same task; the run resumes from that checkpoint."""
        preempt_trainers(checkpoint_wait_s(config.load(RunDir(Path(self.run_dir)).job_yaml)))
        return submitit.helpers.DelayedSubmission(NodeTask(self.run_dir))

    def __repr__(self) -> str:
        return f"NodeTask({self.run_dir!r})"


def main(argv: list[str] | None = None) -> int:
    """Entry of the hetjob script: node index = --node-offset + this component's SLURM_NODEID."""
    ap = argparse.ArgumentParser(prog="python -m hpc_rl.cluster.task")
    ap.add_argument("run_dir")
    ap.add_argument("--node-offset", type=int, required=True)
    ap.add_argument("--num-nodes", type=int, required=True)
    args = ap.parse_args(argv)
    node = args.node_offset + int(os.environ.get("SLURM_NODEID", "0"))
    _checkpoint_on_usr_signals(Path(args.run_dir))
    return run_this_node(args.run_dir, node, args.num_nodes)


def _checkpoint_on_usr_signals(run_dir: Path) -> None:
    """The hetjob script passes the preemption warning (USR2) on to the trainer component: this node's
    trainer ranks then checkpoint and exit (NodeTask.checkpoint does the same under submitit)."""
    wait_s = checkpoint_wait_s(config.load(RunDir(run_dir).job_yaml))

    def on_signal(signum, _frame):
        log.warning("%s: asking this node's trainer ranks to checkpoint and stop", signal.Signals(signum).name)
        preempt_trainers(wait_s)

    signal.signal(signal.SIGUSR1, on_signal)
    signal.signal(signal.SIGUSR2, on_signal)


if __name__ == "__main__":
    sys.exit(main())
