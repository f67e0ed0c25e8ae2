"""The `slurm_cluster` fixture and helpers for tests that run on the local 3-node Slurm cluster.

The cluster (tests/cluster/up.sh) comes up once per test session and goes down at the end, also
when tests fail or the session is interrupted (fixture finalizer + atexit). Import the fixture
into a test module: `from cluster.helpers import slurm_cluster  # noqa: F401`.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
UP, DOWN = HERE / "up.sh", HERE / "down.sh"
NODE_ADDRS = {"n1": "10.77.0.11", "n2": "10.77.0.12", "n3": "10.77.0.13"}
LOCK = "/tmp/hpc-rl-slurm.lock"
LOCK_WAIT_S = 1800


@dataclass
class Cluster:
    state: Path
    conf: Path


def unavailable() -> str | None:
    """Why the local cluster cannot run here, or None."""
    if os.geteuid() != 0:
        return "the local Slurm cluster needs root (network namespaces, slurmd)"
    missing = [b for b in ("slurmctld", "slurmd", "munged", "sbatch", "ip", "unshare") if shutil.which(b) is None]
    if missing:
        return f"{', '.join(missing)} not found: apt-get install -y slurm-wlm munge iproute2"
    return None


def _down(env: dict) -> None:
    subprocess.run([str(DOWN)], env=env, capture_output=True, timeout=120)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running 3-node cluster; SLURM_CONF points at it for the session. A missing prerequisite skips the
    Slurm tests, which under CI (HPC_RL_REQUIRE_ALL=1, see tests/conftest.py) is a failure."""
    reason = unavailable()
    if reason:
        pytest.skip(f"the local Slurm cluster cannot start: {reason}")
    # The cluster's namespaces, addresses and /etc/hosts names are machine-wide: a second test session would
    # tear down the first one's cluster mid-test. One session at a time holds this lock (released at exit).
    lock = open(LOCK, "w")  # held for the whole session
    deadline = time.time() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.time() > deadline:
                pytest.fail(f"another test session has held the local Slurm cluster ({LOCK}) for {LOCK_WAIT_S}s; "
                            "let it finish (two sessions cannot share the cluster)")
            time.sleep(5)
    state = Path(os.environ.get("HPC_RL_SLURM_STATE", "/tmp/hpc-rl-slurm"))
    env = {**os.environ, "HPC_RL_SLURM_STATE": str(state)}
    atexit.register(_down, env)  # an interrupted session still removes namespaces and /etc/hosts lines
    p = subprocess.run([str(UP)], env=env, capture_output=True, text=True, timeout=240)
    if p.returncode != 0:
        _down(env)
        pytest.fail(f"tests/cluster/up.sh failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(state / "slurm.conf")
    try:
        yield Cluster(state, state / "slurm.conf")
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        _down(env)
        lock.close()


def hpc_rl(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    """Run the `hpc-rl` CLI (this venv's python) from the repo root."""
    p = subprocess.run([sys.executable, "-m", "hpc_rl.cli", *args], cwd=REPO, capture_output=True, text=True,
                       timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"hpc-rl {' '.join(args)} exited {p.returncode}:\n{p.stdout}\n{p.stderr[-4000:]}")
    return p


def submitted_run_dir(out: str) -> Path:
    """The run dir printed by `hpc-rl submit`."""
    for line in out.splitlines():
        if line.startswith("run dir: "):
            return Path(line[len("run dir: "):].strip())
    raise AssertionError(f"no run dir in submit output:\n{out}")


def status(run: Path) -> dict:
    return json.loads(hpc_rl("status", str(run), "--json", timeout=60).stdout)


def wait_for(cond, timeout_s: float, what: str, poll_s: float = 1.0):
    """Poll `cond()` until it returns something truthy; AssertionError naming `what` on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def job_processes(run_root: Path) -> dict[int, str]:
    """{pid: cmdline} of every process on the machine (all node namespaces share the pid space)
    whose environment carries HPC_RL_RUN_DIR=run_root (the job's preamble exports it)."""
    needle = f"HPC_RL_RUN_DIR={run_root}".encode()
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if needle in (d / "environ").read_bytes().split(b"\0"):
                out[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # exited meanwhile
    return out


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return f"({path} missing)"


def processes_naming(run: Path) -> dict[int, tuple[bytes, bytes]]:
    """{pid: (cmdline, environ)} of every process whose command line or environment names the run dir."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd, env = (d / "cmdline").read_bytes(), (d / "environ").read_bytes()
        except OSError:
            continue
        if str(run).encode() in cmd + env:
            out[int(d.name)] = (cmd, env)
    return out


def metrics_rows(run: Path) -> list[dict]:
    """The complete rows of a run's metrics.jsonl ([] before the first step)."""
    from hpc_rl.metrics import read_metrics

    return read_metrics(run / "metrics.jsonl")


def run_logs(run: Path) -> str:
    """Last lines of every log of a run (for assertion messages)."""
    files = sorted((run / "submitit").glob("*_log.*")) + sorted((run / "logs").glob("*"))
    return "\n".join(f"==> {f.name} <==\n{tail(f, 25)}" for f in files)
