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


def start_run(job: Path, cwd: Path, log: Path, *args: str) -> subprocess.Popen:
    """`hpc-rl run JOB ARGS...` in `cwd`, its output to `log`, in a session of its own (killpg reaches it all)."""
    import sys

    return subprocess.Popen([sys.executable, "-m", "hpc_rl.cli", "run", str(job), *args], cwd=cwd,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)


def kill_at_step(proc: subprocess.Popen, run_root: Path, log: Path, step: int, steps: int) -> None:
    """SIGKILL the whole run once its log shows `step`, then wait (up to 15 s) for its processes to be gone."""
    import re
    import signal

    poll(f"step {step}", lambda: re.search(rf"step {step}/{steps} ", log.read_text(errors="replace")), 300, proc, log)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 15
    while procs_of(run_root, "hpc_rl.") and time.time() < deadline:
        time.sleep(0.2)
