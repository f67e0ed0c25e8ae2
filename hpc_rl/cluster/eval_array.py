"""`hpc-rl eval RUN --submit`: the evaluation of checkpoints as one Slurm job array (submitit), one element per
checkpoint. Each element takes one node with the GPUs of a rollout node, starts one rollout server on its
checkpoint and evaluates it exactly as `hpc-rl eval` does on this machine (eval/offline.py); the rows go to the
run's eval.jsonl marked "source": "offline". Slurm's files are in RUN/eval/submitit/.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import submitit

from .. import config
from ..config import JobConfig
from ..logs import setup_logging
from ..rundir import RunDir, read_json, write_json_atomic
from . import slurmq
from .env import prepare_node_env
from .render import executor_params, submitit_command

log = logging.getLogger("hpc_rl")

EVAL_SUBMITIT_DIR = "eval/submitit"
SUBMISSIONS_JSON = "eval/submissions.json"


class EvalTask:
    """What one array element runs: the evaluation of checkpoint `step` of the run (picklable for submitit)."""

    def __init__(self, run_dir: str | Path, step: int, overrides: list[str]):
        self.run_dir, self.step, self.overrides = str(run_dir), int(step), list(overrides)

    def __call__(self) -> dict:
        from ..eval.offline import evaluate_checkpoint

        setup_logging(rank=0)
        run = RunDir(Path(self.run_dir))
        cfg = config.load(run.job_yaml, self.overrides)
        prepare_node_env(cfg)
        return evaluate_checkpoint(run, cfg, self.step)

    def checkpoint(self, *args, **kwargs):
        """Preempted: the element runs again from the start (its eval.jsonl row is written only at the end)."""
        return submitit.helpers.DelayedSubmission(EvalTask(self.run_dir, self.step, self.overrides))

    def __repr__(self) -> str:
        return f"EvalTask({self.run_dir!r}, step={self.step})"


def eval_array_params(cfg: JobConfig, run_dir: str | Path, parallel: int | None = None) -> dict:
    """submitit parameters of the array: one node with a rollout node's GPUs per element, the job's partition,
    account, time and environment."""
    s = cfg.slurm
    gpus = s.rollout_gpus_per_node if s.rollout_gpus_per_node is not None else s.gpus_per_node
    one_node = dataclasses.replace(cfg, name=f"{cfg.name}-eval",
                                   trainer=dataclasses.replace(cfg.trainer, nodes=1),
                                   rollout=dataclasses.replace(cfg.rollout, nodes=0),
                                   reward=dataclasses.replace(cfg.reward, nodes=0),
                                   slurm=dataclasses.replace(s, gpus_per_node=gpus, partition=s.rollout_partition
                                                             or s.partition, array_parallelism=parallel))
    return executor_params(one_node, run_dir, clear_rendezvous=False)  # the run may still be training


def render_eval_array(cfg: JobConfig, run_dir: str | Path, count: int, parallel: int | None = None) -> str:
    """The sbatch script of the array (what --dry-run prints; submitit writes the same one)."""
    from submitit.slurm.slurm import _make_sbatch_string

    folder = Path(run_dir) / EVAL_SUBMITIT_DIR
    return _make_sbatch_string(command=submitit_command(folder), folder=folder, map_count=count,
                               **eval_array_params(cfg, run_dir, parallel))


def submit_eval(target: str, step: int | None = None, every: bool = False, best: bool = False,
                overrides: list[str] | None = None, dry_run: bool = False, runs_dir: str = "runs") -> int:
    """`hpc-rl eval RUN --submit [--dry-run]`: the checkpoints asked for as one job array."""
    from ..eval.offline import resolve_run

    overrides = list(overrides or [])
    run, cfg, steps = resolve_run(target, step, every, best, overrides, runs_dir)
    return submit_eval_array(run, cfg, steps, overrides, dry_run)


def submit_eval_array(run: RunDir, cfg: JobConfig, steps: list[int], overrides: list[str],
                      dry_run: bool = False) -> int:
    """Submit one element per checkpoint step (or print the script); prints the array job id."""
    if dry_run:
        print(render_eval_array(cfg, run.root, len(steps)), end="")
        print(f"# dry run: nothing submitted; {len(steps)} element(s), checkpoints of steps "
              f"{', '.join(map(str, steps))}")
        return 0
    slurmq.need_sbatch("submit", "`hpc-rl eval RUN` without --submit evaluates on this machine")
    folder = run.root / EVAL_SUBMITIT_DIR

    def send(executor):
        with executor.batch():
            return [executor.submit(EvalTask(run.root, s, overrides)) for s in steps]

    jobs = slurmq.submit(folder, eval_array_params(cfg, run.root), send, "the evaluation array",
                         "slurm.partition/account/qos/time against `sinfo`")
    array_id = str(jobs[0].job_id).split("_")[0]
    subs = read_json(run.root / SUBMISSIONS_JSON) or {"submissions": []}
    subs["submissions"].append({"array_job_id": array_id, "steps": steps, "overrides": overrides,
                                "time": time.time()})
    write_json_atomic(run.root / SUBMISSIONS_JSON, subs)
    print(f"submitted evaluation array {array_id}: {len(steps)} checkpoint(s) of {run.name} "
          f"(steps {', '.join(map(str, steps))})")
    print(f"results: {run.eval_log} (source offline); Slurm logs: {folder}")
    return 0
