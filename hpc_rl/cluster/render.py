"""Rendering a job spec into Slurm terms: submitit parameters, the sbatch preamble (jinja2 templates),
and, for `slurm.layout: hetjob` only, a whole heterogeneous sbatch script (submitit has no hetjob)."""

from __future__ import annotations

import math
import re
import shlex
import sys
from pathlib import Path

from ..config import JobConfig
from ..errors import ConfigError
from ..nccl import nccl_env
from ..templating import render as render_template
from .layout import nodes_request, total_nodes

# submitit names its files %j_submission.sh, %j_%t_log.out, %j_%t_result.pkl under this folder.
SUBMITIT_DIR = "submitit"
# One submitit task per node: launch.run_node starts that node's processes itself.
SRUN_ARGS = ["--kill-on-bad-exit=1"]

_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def time_minutes(text: str) -> int:
    """Slurm time string -> whole minutes (rounded up): MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    m = _TIME.match(str(text).strip())
    if not m:
        raise ConfigError(f"slurm.time: {text!r} is not a Slurm time; use e.g. 01:30:00, 90 or 2-00:00:00")
    days, a, b, c = m.groups()
    a, b, c = int(a), int(b or 0), int(c or 0)
    if days is not None:  # D-HH[:MM[:SS]]
        secs = int(days) * 86400 + a * 3600 + b * 60 + c
    elif m.group(4) is not None:  # HH:MM:SS
        secs = a * 3600 + b * 60 + c
    elif m.group(3) is not None:  # MM:SS
        secs = a * 60 + b
    else:  # MM
        secs = a * 60
    if secs <= 0:
        raise ConfigError(f"slurm.time: {text!r} is zero; give the job a time limit such as 01:00:00")
    return math.ceil(secs / 60)


def checkpoint_wait_s(cfg: JobConfig) -> float:
    """How long a node waits for its trainer ranks to checkpoint after the preemption warning (the rest of
    slurm.signal_delay_s is left to Slurm for the requeue itself)."""
    return max(5.0, cfg.slurm.signal_delay_s - 15.0)


def python_executable() -> str:
    """The interpreter the job's nodes run (submitit uses sys.executable too)."""
    return sys.executable


def preamble_lines(cfg: JobConfig, run_dir: str | Path, clear_rendezvous: bool = True) -> list[str]:
    """The sbatch preamble (setup lines, env activation, exports) rendered from templates/setup.sh.j2;
    `clear_rendezvous` false for jobs beside the run's own (an evaluation array must not touch its addresses)."""
    import os

    py = Path(python_executable())
    text = render_template(
        "setup.sh.j2",
        name=cfg.name, run_dir=str(run_dir), setup=[str(s) for s in cfg.slurm.setup],
        env_bin=str(py.parent), conda_prefix=os.environ.get("CONDA_PREFIX"),
        virtual_env=str(py.parent.parent) if (py.parent.parent / "pyvenv.cfg").is_file() else None,
        nccl=nccl_env(cfg), env_vars={str(k): str(v) for k, v in cfg.env.vars.items()},
        clear_rendezvous=clear_rendezvous)
    return [line for line in text.splitlines() if line.strip()]


def executor_params(cfg: JobConfig, run_dir: str | Path, clear_rendezvous: bool = True) -> dict:
    """submitit SlurmExecutor parameters for the single-job layout (one task per node)."""
    s = cfg.slurm
    params: dict = {
        "job_name": cfg.name,
        "nodes": total_nodes(cfg),
        "ntasks_per_node": 1,
        # submitit's own timeout bookkeeping needs minutes; the script shows the spec's text (below).
        "time": time_minutes(s.time),
        "signal_delay_s": s.signal_delay_s,
        "setup": preamble_lines(cfg, run_dir, clear_rendezvous),
        "srun_args": list(SRUN_ARGS),
    }
    for key in ("partition", "account", "qos", "cpus_per_task", "constraint", "mail_user", "mail_type"):
        value = getattr(s, key)
        if value is not None:
            params[key] = value
    if s.gpus_per_node:
        params["gpus_per_node"] = s.gpus_per_node
    if s.exclusive:
        params["exclusive"] = True
    if s.array_parallelism is not None:
        params["array_parallelism"] = s.array_parallelism
    extra: dict = {"time": str(s.time).strip()}
    if isinstance(cfg.trainer.nodes, str):
        _node_range_params(cfg, params, extra)
    # submitit's `mem` wants GB as a number; Slurm's own spelling (64G, 500M, 0 = whole node) passes as is.
    if s.mem is not None:
        extra["mem"] = str(s.mem)
    if s.requeue:
        extra["requeue"] = True
    extra.update(_additional(cfg))
    params["additional_parameters"] = extra
    return params


def _node_range_params(cfg: JobConfig, params: dict, extra: dict) -> None:
    """sbatch and srun options of a trainer node range (trainer.nodes "MIN-MAX").

    Given only --nodes=A-B, Slurm's consumable-resource scheduler allocates A nodes even when B are free (measured
    with Slurm 22.05). A job of B tasks spread over as many nodes as possible (--ntasks=B --spread-job, no
    --ntasks-per-node) gets B nodes when they are free and fewer, down to A, when they are not. srun then starts one
    task per node the job got: one submitit task per node, as at a fixed size. submitit's own bookkeeping counts B
    tasks (its `nodes`)."""
    total = total_nodes(cfg)
    params.pop("ntasks_per_node", None)
    extra.update({"nodes": nodes_request(cfg), "ntasks": total, "spread_job": True})
    params["srun_args"] = [*params["srun_args"], "--ntasks-per-node=1"]
    # srun reads its task count from the job's environment, which says B: one per node it got instead.
    params["setup"] = [*params["setup"], 'export SLURM_NTASKS="$SLURM_JOB_NUM_NODES" SLURM_NPROCS="$SLURM_JOB_NUM_NODES"']


def _additional(cfg: JobConfig) -> dict:
    """`slurm.additional` as sbatch options ({reservation: x} -> --reservation=x; true -> a bare flag)."""
    out = {}
    for k, v in cfg.slurm.additional.items():
        key = str(k).lstrip("-")
        if not key:
            raise ConfigError("slurm.additional: an empty option name; use e.g. {reservation: myres}")
        if v is not None and v is not False:  # null/false: leave the option out
            out[key] = v
    return out


def submitit_command(folder: str | Path) -> str:
    """The command submitit runs on every node (its own runner unpickles the NodeTask)."""
    return " ".join([shlex.quote(python_executable()), "-u -m submitit.core._submit", shlex.quote(str(folder))])


def render_single(cfg: JobConfig, run_dir: str | Path) -> str:
    """The sbatch script submitit submits for this spec (rendered by submitit itself)."""
    from submitit.slurm.slurm import _make_sbatch_string

    folder = Path(run_dir) / SUBMITIT_DIR
    return _make_sbatch_string(command=submitit_command(folder), folder=folder, **executor_params(cfg, run_dir))


def _flags(d: dict) -> list[tuple[str, object]]:
    out = []
    for k, v in d.items():
        if v is None or v is False:
            continue
        out.append((f"--{str(k).replace('_', '-')}", None if v is True else v))
    return out


def render_hetjob(cfg: JobConfig, run_dir: str | Path) -> str:
    """A heterogeneous sbatch script: component 0 = trainer nodes, component 1 = rollout nodes."""
    s = cfg.slurm
    folder = Path(run_dir) / SUBMITIT_DIR
    job_wide = {
        "job-name": cfg.name, "account": s.account, "qos": s.qos,
        # B: the batch shell gets the signal, its trap requeues the job.
        "signal": f"B:USR2@{s.signal_delay_s}", "requeue": s.requeue,
        "mail-user": s.mail_user, "mail-type": s.mail_type,
        "output": str(folder / "%j_batch.out"), "error": str(folder / "%j_batch.err"), "open-mode": "append",
    }

    def resources(partition, nodes, gpus) -> dict:
        return {"partition": partition, "nodes": nodes, "ntasks-per-node": 1, "time": str(s.time).strip(),
                "cpus-per-task": s.cpus_per_task, "gpus-per-node": gpus or None, "mem": s.mem,
                "constraint": s.constraint, "exclusive": s.exclusive}

    rollout_gpus = s.rollout_gpus_per_node if s.rollout_gpus_per_node is not None else s.gpus_per_node
    trainer = {**job_wide, **resources(s.partition, cfg.trainer.nodes, s.gpus_per_node), **_additional(cfg)}
    # Reward nodes (reward.nodes) and the services' nodes sit in the rollout component, after its rollout nodes.
    rollout = resources(s.rollout_partition or s.partition, cfg.server_nodes, rollout_gpus)
    components = [
        {"role": "trainer", "node_offset": 0, "flags": _flags(trainer)},
        {"role": "rollout", "node_offset": cfg.trainer.nodes, "flags": _flags(rollout)},
    ]
    return render_template(
        "hetjob.sbatch.j2",
        components=components, preamble="\n".join(preamble_lines(cfg, run_dir)), folder=str(folder),
        python=python_executable(), run_dir=str(run_dir), num_nodes=total_nodes(cfg),
        checkpoint_wait_s=int(checkpoint_wait_s(cfg)) + 10)


def render(cfg: JobConfig, run_dir: str | Path) -> str:
    """The sbatch script for this spec and layout."""
    return render_hetjob(cfg, run_dir) if cfg.slurm.layout == "hetjob" else render_single(cfg, run_dir)
