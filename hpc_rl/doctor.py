"""`hpc-rl doctor`: one check per known environment pitfall, each `ok` / `warn` / `FAIL` with cause and fix.

Checks live in hpc_rl/doctor_checks/ and register themselves with `@check`. Each takes a `Ctx`, whose
facts (environment variables, current directory, GPUs from nvidia-smi, torch's build, statvfs, ...)
are probed lazily and can be given explicitly, which is how tests plant faults one at a time.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("hpc_rl")

OK, WARN, FAIL = "ok", "warn", "FAIL"
REPO = Path(__file__).resolve().parent.parent


@dataclass
class Result:
    """The outcome of one check: status is ok / warn / FAIL; fix is empty when nothing is to be done."""

    name: str
    status: str
    message: str
    fix: str = ""


@dataclass
class Check:
    name: str
    fn: Callable[[Ctx], Any]
    needs_job: bool = False


REGISTRY: list[Check] = []


def check(name: str, needs_job: bool = False):
    """Register a check function `fn(ctx) -> Result | list[Result]` under `name`."""
    def deco(fn):
        REGISTRY.append(Check(name, fn, needs_job))
        fn.check_name = name
        return fn
    return deco


def run_cmd(argv: list[str], timeout: float = 10.0) -> subprocess.CompletedProcess | None:
    """Run a probe command with a timeout; None when it is missing or timed out (never hangs)."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (subprocess.TimeoutExpired, OSError):
        log.debug("doctor: %s did not answer within %.0f s", argv[0], timeout)
        return None


class Ctx:
    """Facts the checks read; each is probed on first use unless given as a keyword argument.

    A check module may add the probes only it needs as `Ctx._probe_NAME` (e.g. hostname, loaded_libs).
    """

    def __init__(self, job: Any = None, job_path: str | None = None, **facts: Any):
        self.job = job
        self.job_path = job_path
        self._facts = dict(facts)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        facts = self.__dict__["_facts"]
        if name not in facts:
            probe = getattr(type(self), "_probe_" + name, None)
            if probe is None:
                raise AttributeError(name)
            facts[name] = probe(self)
        return facts[name]

    # ---- probes of the real machine
    def _probe_environ(self) -> dict:
        return dict(os.environ)

    def _probe_cwd(self) -> Path:
        return Path.cwd()

    def _probe_statvfs(self):
        return os.statvfs

    def _probe_which(self):
        return shutil.which

    def _probe_torch(self) -> dict:
        """torch's version/CUDA from torch/version.py (no import); cuDNN/NCCL need the import (CUDA builds only)."""
        from .doctor_checks.probes import torch_facts
        return torch_facts()

    def _probe_lock(self) -> dict:
        """The header of this env's install-lock.txt (stack, CUDA, env kind)."""
        from .doctor_checks.stacks import read_lock
        return read_lock()

    def _probe_nvidia_smi(self) -> dict | None:
        """{driver, cuda, gpus: [{index, uuid, name}]} from nvidia-smi, or None without a GPU driver."""
        from .doctor_checks.probes import nvidia_smi_facts
        return nvidia_smi_facts()


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


def run_doctor(job: str | None = None, as_json: bool = False) -> int:
    """Entry point of `hpc-rl doctor`: print every check's result; exit code 1 on any FAIL, else 0."""
    if os.environ.get("HPC_RL_DEBUG") == "1":
        logging.basicConfig(level=logging.DEBUG)
    ctx = Ctx()
    pre: list[Result] = []
    if job is not None:
        from .config import load
        from .errors import HpcRlError
        try:
            ctx = Ctx(job=load(job), job_path=job)
            pre.append(Result("job:spec", OK, f"{job} loads and validates"))
        except HpcRlError as e:
            pre.append(Result("job:spec", FAIL, str(e), "fix the job spec as the message says"))
    results = pre + run_checks(ctx)
    if as_json:
        print(json.dumps({"ok": not any(r.status == FAIL for r in results),
                          "checks": [asdict(r) for r in results]}, indent=1))
    else:
        _print_human(results)
    return 1 if any(r.status == FAIL for r in results) else 0
