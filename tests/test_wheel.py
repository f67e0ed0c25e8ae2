"""A non-editable install (`pip install` of the built wheel) carries the templates: `hpc-rl submit --dry-run`
and a short `hpc-rl run` work from outside the repo, importing hpc_rl from the installed copy only."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    base = tmp_path_factory.mktemp("wheel")
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(base / "dist"), str(REPO)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = (base / "dist").glob("hpc_rl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for t in sorted(p.name for p in (REPO / "templates").glob("*.j2")):
        assert f"hpc_rl/templates/{t}" in names, f"the wheel lacks templates/{t}"
    target = base / "site"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                          str(wheel)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    work = base / "elsewhere"  # not the repo: nothing can come from the source checkout
    work.mkdir()
    shutil.copy(REPO / "jobs" / "toy-grpo-cpu.yaml", work / "job.yaml")
    env = {**os.environ, "PYTHONPATH": str(target), "PYTHONSAFEPATH": "1"}
    where = subprocess.run([sys.executable, "-c", "import hpc_rl; print(hpc_rl.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, timeout=60)
    assert where.stdout.strip().startswith(str(target)), where.stdout + where.stderr
    return work, env


def _hpc_rl(work, env, *args, timeout=600):
    return subprocess.run([sys.executable, "-m", "hpc_rl.cli", *args], cwd=work, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_wheel_submit_dry_run(installed):
    work, env = installed
    for layout in ("single", "hetjob"):
        out = _hpc_rl(work, env, "submit", "job.yaml", "trainer.nodes=1", "rollout.nodes=1",
                      f"slurm.layout={layout}", f"output_dir={work / 'runs'}", "--dry-run", timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        # The preamble comes from templates/setup.sh.j2, the hetjob script from templates/hetjob.sbatch.j2.
        assert "#SBATCH" in out.stdout and "export HPC_RL_RUN_DIR=" in out.stdout, out.stdout
        assert (layout == "single") != ("-m hpc_rl.cluster.task" in out.stdout), out.stdout


def test_wheel_run(installed):
    work, env = installed
    out = _hpc_rl(work, env, "run", "job.yaml", "trainer.steps=2", "rollout.engine=hf", "checkpoint.every=2",
                  f"output_dir={work / 'runs'}")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "step 2/2" in out.stdout + out.stderr
    (run,) = (work / "runs").iterdir()
    assert (run / "checkpoints" / "step_2" / "manifest.json").is_file()
