"""What runs on every node of a submitted job: read the node's place in the job, set its
environment, and hand over to `hpc_rl.launch.run_node` (the same code `hpc-rl run` uses).

Submitted through submitit as `NodeTask(run_dir)` (picklable); the hetjob script runs
`python -m hpc_rl.cluster.task RUN_DIR --node-offset K --num-nodes N` instead.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from pathlib import Path

from ..errors import ClusterError
from ..rundir import RunDir

log = logging.getLogger("hpc_rl")


def run_this_node(run_dir: str | Path, node_index: int, num_nodes: int) -> int:
    """Prepare this node's environment and run its role; returns launch.run_node's exit code."""
    from .. import config
    from ..logs import setup_logging
    from .env import prepare_node_env
    from .layout import role_of

    setup_logging(rank=0)
    run = RunDir(Path(run_dir))
    cfg = config.from_resolved(run.job_yaml)
    prepare_node_env(cfg)
    log.info("node %d/%d on %s (%s): %s", node_index, num_nodes, socket.gethostname(),
             os.environ.get("HPC_RL_NODE_ADDR"), role_of(cfg, node_index))
    if cfg.rollout.nodes == 0 and num_nodes == 1:
        # rollout.nodes=0: the rollout server(s) share the trainer's node, exactly as in `hpc-rl run`.
        from ..launch import run_local

        return int(run_local(run, cfg) or 0)
    from ..launch import run_node

    return int(run_node(run, node_index, num_nodes) or 0)


class NodeTask:
    """The callable submitit runs once per node (one task per node)."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = str(run_dir)

    def __call__(self) -> int:
        import submitit

        env = submitit.JobEnvironment()
        rc = run_this_node(self.run_dir, env.node, env.num_nodes)
        if rc != 0:
            # An exception makes submitit record the failure and exit non-zero, so that srun
            # (--kill-on-bad-exit) ends the other nodes and Slurm shows the job FAILED.
            raise ClusterError(f"node {env.node} ({socket.gethostname()}) of run {Path(self.run_dir).name} "
                               f"exited with code {rc}; see `hpc-rl logs {self.run_dir}`")
        return rc

    def checkpoint(self, *args, **kwargs):
        """Preemption or time limit: the trainer ranks checkpoint at the next step boundary and exit, then
        submitit requeues the same task; the run resumes from that checkpoint."""
        import submitit

        from .. import config
        from ..launch import preempt_trainers

        delay = config.from_resolved(RunDir(Path(self.run_dir)).job_yaml).slurm.signal_delay_s
        preempt_trainers(max(5.0, delay - 15.0))  # leave Slurm time for the requeue itself
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
    return run_this_node(args.run_dir, node, args.num_nodes)


if __name__ == "__main__":
    sys.exit(main())
