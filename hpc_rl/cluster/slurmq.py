"""Talking to Slurm: submitting through submitit (`submit`), asking about a job (squeue, then scontrol, then sacct,
absent without slurmdbd), scancel."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ..errors import ClusterError

# States after which nothing of the job runs any more.
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE", "PREEMPTED", "SPECIAL_EXIT", "REVOKED"}
_CMD_TIMEOUT_S = 30


def _run(cmd: list[str]) -> str | None:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout if p.returncode == 0 else None


def _merge(states: list[str]) -> str | None:
    """One state for a job with several components (hetjob): the least finished one wins."""
    states = [s.split()[0].rstrip("+") for s in states if s.strip()]
    if not states:
        return None
    active = [s for s in states if s not in TERMINAL]
    if active:
        return active[0]
    bad = [s for s in states if s != "COMPLETED"]
    return bad[0] if bad else "COMPLETED"


T = TypeVar("T")


def submit(folder: Path, params: dict, send: Callable[..., T], what: str, check: str) -> T:
    """`send(executor)` with a submitit SlurmExecutor writing to `folder` (made here) with `params`; sbatch's refusal
    is a ClusterError naming `what` was refused and what to `check`."""
    import submitit

    folder.mkdir(parents=True, exist_ok=True)
    executor = submitit.SlurmExecutor(folder=folder)
    executor.update_parameters(**params)
    try:
        return send(executor)
    except (submitit.core.utils.FailedJobError, subprocess.CalledProcessError, OSError) as e:
        msg = " ".join(str(e).split())[-400:]
        raise ClusterError(f"sbatch refused {what} ({msg}); check {check}") from None


def need_sbatch(what: str, instead: str) -> None:
    """ClusterError when sbatch is not on PATH: `what` names the command, `instead` what works without Slurm."""
    if shutil.which("sbatch") is None:
        raise ClusterError(f"sbatch not found on PATH: {what} from a Slurm login node (or load the slurm module); "
                           f"{instead}")


def job_state(job_id: str) -> str | None:
    """Slurm's state of the job (RUNNING, COMPLETED, ...) or None when Slurm no longer knows it."""
    out = _run(["squeue", "-h", "-t", "all", "-j", str(job_id), "-o", "%T"])
    if out and out.strip():
        return _merge(out.splitlines())
    out = _run(["scontrol", "-o", "show", "job", str(job_id)])
    if out:
        st = _merge(re.findall(r"JobState=(\S+)", out))
        if st:
            return st
    out = _run(["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "State"])
    if out and out.strip():
        return _merge(out.splitlines())
    return None


def job_nodes(job_id: str) -> str | None:
    """The job's node list (e.g. n[1-3]) while Slurm knows the job."""
    out = _run(["squeue", "-h", "-t", "all", "-j", str(job_id), "-o", "%N"])
    if out and out.strip():
        nodes = [n.strip() for n in out.splitlines() if n.strip()]
        return ",".join(nodes) or None
    return None


def partition_nodes(partition: str | None) -> int | None:
    """Nodes of a partition (the default one when None), whatever their state; None when sinfo cannot tell."""
    out = _run(["sinfo", "-h", "-N", "-o", "%N %P"] + (["-p", partition] if partition else []))
    if not out:
        return None
    names = {line.split()[0] for line in out.splitlines()
             if line.split() and (partition or line.split()[-1].endswith("*"))}
    return len(names) or None


def scancel(job_id: str) -> tuple[bool, str]:
    """scancel the job (every component and step); (ok, message)."""
    try:
        p = subprocess.run(["scancel", str(job_id)], capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    except FileNotFoundError:
        return False, "scancel not found on PATH"
    except subprocess.TimeoutExpired:
        return False, f"scancel {job_id} did not answer within {_CMD_TIMEOUT_S}s"
    return p.returncode == 0, (p.stderr or p.stdout).strip()
