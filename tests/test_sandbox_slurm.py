"""The python tool's sandbox against the local Slurm cluster: the step daemon's socket of a running job (through
which a process of the job's user signals or attaches to its steps) is reachable from here and not from model code."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster.helpers import wait_for  # noqa: E402

from hpc_rl.rollout.environments.sandbox import SandboxLimits, run_python  # noqa: E402
from tests.sandbox_attacks import CONNECT, REACHED, attack_code, outside  # noqa: E402

pytestmark = pytest.mark.slurm


def test_the_step_daemon_socket_of_a_running_job_is_unreachable(slurm_cluster, tmp_path):
    p = subprocess.run(["sbatch", "--parsable", "-N1", "-o", str(tmp_path / "job.out"), "--wrap", "sleep 300"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    job = p.stdout.strip().split(";")[0]
    try:
        spool = slurm_cluster.state / "spool"
        socks = wait_for(lambda: sorted(str(s) for s in spool.glob(f"*/*_{job}.*") if s.is_socket()), 120,
                         f"the step daemon socket of job {job} under {spool}")
        for path in socks:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)  # the control: reachable from outside the sandbox
            code = attack_code(CONNECT, path)
            assert outside(code).endswith(REACHED)
            r = run_python(code, SandboxLimits(wall_s=10))
            assert r.exit_code == 1 and REACHED not in r.output.splitlines(), r.output
            assert r.output.strip().splitlines()[-1].startswith("PermissionError"), r.output
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=60)
