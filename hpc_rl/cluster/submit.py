"""`hpc-rl submit`: one Slurm job of trainer.nodes + rollout.nodes nodes through submitit
(or a heterogeneous job rendered from templates/hetjob.sbatch.j2 for `slurm.layout: hetjob`)."""

from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path

from .. import config
from ..config.resume import load_for_resume
from ..errors import ClusterError
from ..rundir import RunDir, find, read_json, write_json_atomic
from . import slurmq
from .layout import check_layout, describe, nodes_request, total_nodes
from .render import SUBMITIT_DIR, executor_params, render

log = logging.getLogger("hpc_rl")

SLURM_JSON = "slurm.json"


def _print_dry_run(cfg: config.JobConfig) -> None:
    placeholder = Path(cfg.output_dir).resolve() / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    print(render(cfg, placeholder), end="")
    print(f"\n# ---- node roles ({nodes_request(cfg)} nodes, layout {cfg.slurm.layout}) ----")
    for line in describe(cfg):
        print(f"# {line}")
    print(f"# dry run: nothing submitted; the run dir would be {placeholder}")




def _submit_single(run: RunDir, cfg: config.JobConfig) -> str:
    from .task import NodeTask

    job = slurmq.submit(run.root / SUBMITIT_DIR, executor_params(cfg, run.root), lambda ex: ex.submit(NodeTask(run.root)),
                        "the job", "slurm.partition/account/qos/time/gpus_per_node against `sinfo`, or fix the option "
                        "named above")
    return str(job.job_id)


def _submit_hetjob(run: RunDir, cfg: config.JobConfig) -> str:
    folder = run.root / SUBMITIT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "hetjob.sbatch"
    script.write_text(render(cfg, run.root))
    proc = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        msg = " ".join((proc.stderr or proc.stdout).split())[-400:]
        raise ClusterError(f"sbatch refused the heterogeneous job ({msg}); check slurm.partition, "
                           "slurm.rollout_partition and the GPU counts against `sinfo`")
    job_id = proc.stdout.strip().split(";")[0]
    (folder / f"{job_id}_submission.sh").write_text(script.read_text())
    return job_id


def _check_partition_size(cfg: config.JobConfig) -> None:
    """A job (or a node range's MAX) larger than its partition would wait forever: refused, naming the key."""
    have = slurmq.partition_nodes(cfg.slurm.partition)
    want = total_nodes(cfg)
    if have is not None and want > have and cfg.slurm.layout == "single":
        key = "trainer.nodes" if isinstance(cfg.trainer.nodes, str) else "trainer.nodes/rollout.nodes"
        where = f"partition {cfg.slurm.partition}" if cfg.slurm.partition else "the default partition"
        raise ClusterError(f"{key}: the job needs up to {want} nodes but {where} has {have}; lower {key} (a range "
                           "such as \"1-2\" starts on what is free)")


def submit_job(job_path: str, overrides: list[str], dry_run: bool = False, resume: str | None = None) -> int:
    """Submit the job spec to Slurm (or print its sbatch script with --dry-run); with `resume`, a new job for that run
    dir that resumes from its latest checkpoint (overrides may change its size); returns the exit code."""
    if resume:
        return _resubmit(resume, overrides, dry_run)
    cfg = config.load(job_path, overrides)
    check_layout(cfg)
    if dry_run:
        _print_dry_run(cfg)
        return 0
    slurmq.need_sbatch("submit", "use `hpc-rl run` to run on this machine or `hpc-rl submit --dry-run` to see the "
                       "script")
    from ..launch import prepare_run

    _check_partition_size(cfg)
    run, cfg = prepare_run(job_path, overrides)
    _submit(run, cfg)
    return 0


def _submit(run: RunDir, cfg: config.JobConfig) -> None:
    job_id = _submit_hetjob(run, cfg) if cfg.slurm.layout == "hetjob" else _submit_single(run, cfg)
    write_json_atomic(run.root / SLURM_JSON, {
        "job_id": job_id, "layout": cfg.slurm.layout, "nodes": total_nodes(cfg), "nodes_request": nodes_request(cfg),
        "trainer_nodes": cfg.trainer.nodes, "rollout_nodes": cfg.rollout.nodes,
        "submitted_at": time.time(), "slurm_conf": os.environ.get("SLURM_CONF"),
    })
    print(f"submitted Slurm job {job_id}: {cfg.name}, {nodes_request(cfg)} nodes ({cfg.slurm.layout})")
    print(f"run dir: {run.root}")
    print(f"follow it: hpc-rl status {run.name} ; hpc-rl logs {run.name} --follow ; hpc-rl cancel {run.name}")


def _resubmit(resume: str, overrides: list[str], dry_run: bool) -> int:
    """`hpc-rl submit --resume RUN [overrides]`: the run's job (its size may change: trainer.nodes,
    trainer.procs_per_node) as a new Slurm job in the same run dir, resuming from its latest checkpoint."""
    run = find(resume)
    cfg = load_for_resume(run.job_yaml, overrides)
    check_layout(cfg)
    if dry_run:
        _print_dry_run(cfg)
        return 0
    slurmq.need_sbatch("submit --resume", "use `hpc-rl run --resume RUN` to resume on this machine")
    before = read_json(run.root / SLURM_JSON) or {}
    state = slurmq.job_state(str(before["job_id"])) if before.get("job_id") else None
    if state is not None and state not in slurmq.TERMINAL:
        raise ClusterError(f"{run.name}: its job {before['job_id']} is still {state}; cancel it first "
                           f"(hpc-rl cancel {run.name}) or let it end")
    _check_partition_size(cfg)
    run.job_yaml.write_text(config.dump(cfg))
    run.done_file.unlink(missing_ok=True)  # this run goes on: rollout jobs must not take it for ended
    _submit(run, cfg)
    return 0
