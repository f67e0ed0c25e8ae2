"""Running the `hpc-rl` CLI in a subprocess from tests, and finding the run dir it made."""

import os
import subprocess
import sys
from pathlib import Path


def hpc_rl(*args, cwd, timeout=900, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m hpc_rl.cli ARGS` in `cwd`, output captured (unbuffered, so that a timeout keeps what it printed);
    `env`: variables added to this process's environment."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "hpc_rl.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


def only_run(out: Path) -> Path:
    """The one run dir under out/runs."""
    runs = [d for d in (out / "runs").iterdir() if d.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]
