"""Slurm checks: sbatch/squeue on PATH, submitit importable, the job's partition and account exist."""

from __future__ import annotations

import getpass
import importlib.util

from .base import FAIL, OK, WARN, Ctx, Result, check
from .env import dist_version
from .probes import run_cmd


@check("slurm:commands")
def check_commands(ctx: Ctx) -> Result:
    found = {c: ctx.which(c) for c in ("sbatch", "squeue", "sinfo", "scancel")}
    missing = [c for c in ("sbatch", "squeue") if not found[c]]
    if missing:
        return Result("slurm:commands", WARN, f"{' and '.join(missing)} not on PATH: `hpc-rl submit` cannot work here "
                      "(`hpc-rl run` still does)", "load Slurm (e.g. `module load slurm`) or run on a login node")
    return Result("slurm:commands", OK, f"sbatch at {found['sbatch']}, squeue at {found['squeue']}")


@check("slurm:submitit")
def check_submitit(ctx: Ctx) -> Result:
    if importlib.util.find_spec("submitit") is None:
        return Result("slurm:submitit", FAIL, "submitit is not installed (hpc-rl submit uses it)",
                      "pip install 'submitit>=1.5.2' (or re-run ./install.sh)")
    return Result("slurm:submitit", OK, f"submitit {dist_version('submitit')[1]}")


def slurm_partitions() -> tuple[list[str] | None, str]:
    """Partition names from sinfo, or (None, why) when sinfo is missing or fails."""
    q = run_cmd(["sinfo", "-h", "-o", "%R"], 15)
    if q is None:
        return None, "sinfo not found or timed out"
    if q.returncode != 0:
        return None, (q.stderr.strip().splitlines() or ["sinfo failed"])[-1]
    return sorted({ln.strip() for ln in q.stdout.splitlines() if ln.strip()}), ""


def slurm_accounts() -> tuple[list[str] | None, str]:
    """Accounts the user may charge, from sacctmgr, or (None, why) without accounting (no slurmdbd)."""
    user = getpass.getuser()
    q = run_cmd(["sacctmgr", "-n", "-P", "show", "assoc", f"user={user}", "format=account"], 15)
    if q is None:
        return None, "sacctmgr not found or timed out"
    if q.returncode != 0:
        return None, (q.stderr.strip().splitlines() or ["sacctmgr failed"])[-1]
    return sorted({ln.strip() for ln in q.stdout.splitlines() if ln.strip()}), ""


@check("slurm:partition", needs_job=True)
def check_partition(ctx: Ctx) -> list[Result]:
    s = ctx.job.slurm
    wanted = [(k, v) for k, v in (("slurm.partition", s.partition), ("slurm.rollout_partition", s.rollout_partition)) if v]
    if not wanted:
        return [Result("slurm:partition", OK, "slurm.partition unset: the cluster's default partition")]
    parts, why = slurm_partitions()
    out = []
    for key, value in wanted:
        if parts is None:
            out.append(Result("slurm:partition", WARN, f"{key}={value} not verified ({why})", "run the doctor where sinfo works"))
        elif value not in parts:
            out.append(Result("slurm:partition", FAIL, f"{key}: partition {value!r} does not exist (sinfo lists: "
                              f"{', '.join(parts) or 'none'})", f"set {key} to one of the listed partitions"))
        else:
            out.append(Result("slurm:partition", OK, f"{key}={value} exists"))
    return out


@check("slurm:account", needs_job=True)
def check_account(ctx: Ctx) -> Result:
    acct = ctx.job.slurm.account
    if not acct:
        return Result("slurm:account", OK, "slurm.account unset: your default account")
    accounts, why = slurm_accounts()
    if accounts is None:
        return Result("slurm:account", WARN, f"slurm.account={acct} not verified ({why})",
                      "check it with `sacctmgr show assoc user=$USER` where accounting works")
    if acct not in accounts:
        return Result("slurm:account", FAIL, f"slurm.account: {acct!r} is not one of your accounts "
                      f"({', '.join(accounts) or 'none'})", "set slurm.account to one of them")
    return Result("slurm:account", OK, f"slurm.account={acct} is yours")
