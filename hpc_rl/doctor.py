"""`hpc-rl doctor`: one check per known environment pitfall, each `ok` / `warn` / `FAIL` with cause and fix.

Checks live in hpc_rl/doctor_checks/ (one module per area) and register themselves with `@check`; what they share
(Result, Ctx, the statuses) is doctor_checks/base.py. This module runs them and prints the results.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import asdict
from typing import Any

from .doctor_checks.base import FAIL, OK, REGISTRY, WARN, Ctx, Result

log = logging.getLogger("hpc_rl")

__all__ = ["FAIL", "OK", "WARN", "Ctx", "Result", "run_checks", "run_doctor"]


def _as_list(out: Any, name: str) -> list[Result]:
    if out is None:
        return []
    if isinstance(out, Result):
        return [out]
    return list(out)


def run_checks(ctx: Ctx, only: list[str] | None = None) -> list[Result]:
    """Run every registered check (job checks only when ctx.job is set); a crashing check is a FAIL."""
    from . import doctor_checks  # noqa: F401  (registers the checks)

    results: list[Result] = []
    for c in REGISTRY:
        if only is not None and c.name not in only:
            continue
        if c.needs_job and ctx.job is None:
            continue
        t0 = time.monotonic()
        try:
            results.extend(_as_list(c.fn(ctx), c.name))
        except Exception as e:  # a broken probe must not hide the other checks
            results.append(Result(c.name, FAIL, f"the check itself crashed: {type(e).__name__}: {e}",
                                  "report this as a bug in hpc-rl doctor (HPC_RL_DEBUG=1 shows details)"))
            log.debug("doctor check %s crashed", c.name, exc_info=True)
        log.debug("doctor check %s took %.2f s", c.name, time.monotonic() - t0)
    return results


def _print_human(results: list[Result], stream=None) -> None:
    stream = stream or sys.stdout
    width = max((len(r.name) for r in results), default=10)
    for r in results:
        print(f"{r.status:<4}  {r.name:<{width}}  {r.message}", file=stream)
        if r.fix and r.status != OK:
            print(f"{'':<4}  {'':<{width}}  fix: {r.fix}", file=stream)
    n_fail = sum(r.status == FAIL for r in results)
    n_warn = sum(r.status == WARN for r in results)
    print(f"doctor: {len(results)} checks, {n_fail} FAIL, {n_warn} warn", file=stream)


def run_doctor(job: str | None = None, as_json: bool = False, overrides: list[str] | None = None) -> int:
    """Entry point of `hpc-rl doctor`: print every check's result; exit code 1 on any FAIL, else 0."""
    if os.environ.get("HPC_RL_DEBUG") == "1":
        logging.basicConfig(level=logging.DEBUG)
    ctx = Ctx()
    pre: list[Result] = []
    if job is not None:
        from .config import load
        from .errors import HpcRlError
        try:
            ctx = Ctx(job=load(job, overrides), job_path=job)
            with_ov = f" with {' '.join(overrides)}" if overrides else ""
            pre.append(Result("job:spec", OK, f"{job}{with_ov} loads and validates"))
        except HpcRlError as e:
            pre.append(Result("job:spec", FAIL, str(e), "fix the job spec as the message says"))
    results = pre + run_checks(ctx)
    if as_json:
        print(json.dumps({"ok": not any(r.status == FAIL for r in results),
                          "checks": [asdict(r) for r in results]}, indent=1))
    else:
        _print_human(results)
    return 1 if any(r.status == FAIL for r in results) else 0
