"""`hpc-rl submit`: one Slurm job of trainer.nodes + rollout.nodes nodes through submitit
(or a heterogeneous job rendered from templates/hetjob.sbatch.j2 for `slurm.layout: hetjob`)."""

from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path

from .. import config
from ..errors import ClusterError
from ..rundir import RunDir, write_json_atomic
from . import slurmq
from .layout import check_layout, describe, total_nodes
from .render import SUBMITIT_DIR, executor_params, render

log = logging.getLogger("hpc_rl")

SLURM_JSON = "slurm.json"


def _print_dry_run(cfg: config.JobConfig) -> None:
    placeholder = Path(cfg.output_dir).resolve() / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    print(render(cfg, placeholder), end="")
    print(f"\n# ---- node roles ({total_nodes(cfg)} nodes, layout {cfg.slurm.layout}) ----")
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


def submit_job(job_path: str, overrides: list[str], dry_run: bool = False) -> int:
    """Submit the job spec to Slurm (or print its sbatch script with --dry-run); returns the exit code."""
    cfg = config.load(job_path, overrides)
    check_layout(cfg)
    if dry_run:
        _print_dry_run(cfg)
        return 0
    slurmq.need_sbatch("submit", "use `hpc-rl run` to run on this machine or `hpc-rl submit --dry-run` to see the "
                       "script")
    from ..launch import prepare_run

    run, cfg = prepare_run(job_path, overrides)
    job_id = _submit_hetjob(run, cfg) if cfg.slurm.layout == "hetjob" else _submit_single(run, cfg)
    write_json_atomic(run.root / SLURM_JSON, {
        "job_id": job_id, "layout": cfg.slurm.layout, "nodes": total_nodes(cfg),
        "trainer_nodes": cfg.trainer.nodes, "rollout_nodes": cfg.rollout.nodes,
        "submitted_at": time.time(), "slurm_conf": os.environ.get("SLURM_CONF"),
    })
    print(f"submitted Slurm job {job_id}: {cfg.name}, {total_nodes(cfg)} nodes ({cfg.slurm.layout})")
    print(f"run dir: {run.root}")
    print(f"follow it: hpc-rl status {run.name} ; hpc-rl logs {run.name} --follow ; hpc-rl cancel {run.name}")
    return 0
