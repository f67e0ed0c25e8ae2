"""What every doctor check shares: the statuses, the Result of a check, the registry (`@check`), and Ctx, whose facts
(environment variables, current directory, GPUs from nvidia-smi, torch's build, statvfs, ...) are probed lazily and
can be given explicitly, which is how tests plant faults one at a time."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .stacks import REPO  # noqa: F401 (the checks read the repository's paths from here)

log = logging.getLogger("hpc_rl")

OK, WARN, FAIL = "ok", "warn", "FAIL"


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
        from .probes import torch_facts
        return torch_facts()

    def _probe_lock(self) -> dict:
        """The header of this env's install-lock.txt (stack, CUDA, env kind)."""
        from .stacks import read_lock
        return read_lock()

    def _probe_nvidia_smi(self) -> dict | None:
        """{driver, cuda, gpus: [{index, uuid, name}]} from nvidia-smi, or None without a GPU driver."""
        from .probes import nvidia_smi_facts
        return nvidia_smi_facts()


