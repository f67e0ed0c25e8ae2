"""Helpers of the tests that drive `hpc-rl run` as a process: wait on it, find the processes of its run dir."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest


def poll(what: str, fn, timeout: float, proc: subprocess.Popen, log: Path, every: float = 0.05):
    """fn()'s first truthy value; fails the test naming `what` when the run exits first or on timeout."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = fn()
        if v:
            return v
        if proc.poll() is not None:
            pytest.fail(f"run exited ({proc.returncode}) while waiting for {what}:\n{log.read_text()[-3000:]}")
        time.sleep(every)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}:\n{log.read_text()[-3000:]}")


def procs_of(run_root: Path, naming: str = "") -> list[int]:
    """Live pids (not this one, no zombies) whose command line names the run dir and, if given, `naming`
    (e.g. a module: launcher, trainer ranks, rollout servers)."""
    me = os.getpid()
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ")
            state = (d / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if state != "Z" and str(run_root).encode() in cmd and naming.encode() in cmd:
            pids.append(int(d.name))
    return pids
