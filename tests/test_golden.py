"""Golden files for everything hpc-rl renders: the sbatch script of every job in jobs/ in both layouts, the
sweep's array script, and the DeepSpeed config of every job. A change in a template, in the rendering code or
in submitit's own sbatch writer shows up here as a diff (as submitit records its own sbatch output).

Re-record after an intended change: HPC_RL_RECORD_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden.py
"""

from __future__ import annotations

import difflib
import json
import os
import sys
from pathlib import Path

import pytest

from hpc_rl import config
from hpc_rl.cluster.layout import check_layout
from hpc_rl.cluster.render import render
from hpc_rl.cluster.sweep import load_sweep, point_config, render_array
from hpc_rl.errors import ConfigError
from hpc_rl.train.ds_config import render as render_deepspeed

REPO = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "golden"
JOBS = sorted(p.name for p in (REPO / "jobs").glob("*.yaml") if p.name != "sweep-kl.yaml")
RUN_DIR = Path("/runs/JOB-20260101-000000")
RECORD = os.environ.get("HPC_RL_RECORD_GOLDEN") == "1"


def _normalized(text: str) -> str:
    """Machine-specific paths (this checkout, this env's python) become placeholders."""
    py = Path(sys.executable)
    for path, name in ((str(py), "{PYTHON}"), (str(py.parent.parent), "{ENV}"), (str(REPO), "{REPO}")):
        text = text.replace(path, name)
    return text


def _check(name: str, text: str) -> None:
    path = GOLDEN / name
    if RECORD:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    assert path.is_file(), f"no golden file {path}; record it: HPC_RL_RECORD_GOLDEN=1 pytest tests/test_golden.py"
    want = path.read_text()
    if text != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True), f"golden/{name}", "rendered"))
        pytest.fail(f"{name} differs from its golden file:\n{diff}\nIf the change is intended, re-record: "
                    "HPC_RL_RECORD_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden.py", pytrace=False)


@pytest.fixture(autouse=True)
def _no_conda(monkeypatch):
    monkeypatch.delenv("CONDA_PREFIX", raising=False)  # the preamble activates a conda env only when one is active


@pytest.mark.parametrize("layout", ["single", "hetjob"])
@pytest.mark.parametrize("job", JOBS)
def test_sbatch_script(job, layout):
    overrides = [f"slurm.layout={layout}"] + (["rollout.nodes=1"] if layout == "hetjob" else [])
    cfg = config.load(REPO / "jobs" / job, overrides)
    if layout == "hetjob" and cfg.algorithm.supervised:  # trainer nodes only: refused (test_submit_dryrun)
        with pytest.raises(ConfigError, match="SFT has trainer nodes only"):
            check_layout(cfg)
        return
    _check(f"sbatch/{job.removesuffix('.yaml')}-{layout}.sh", _normalized(render(cfg, RUN_DIR)))


def test_sweep_array_script():
    spec = load_sweep(REPO / "jobs" / "sweep-kl.yaml")
    cfgs = [point_config(spec, pt) for pt in spec.points]
    _check("sbatch/sweep-kl-array.sh", _normalized(render_array(cfgs, Path("/runs/sweeps/sweep-kl-20260101-000000"),
                                                                spec.name, spec.max_parallel)))


def test_eval_array_script():
    from hpc_rl.cluster.eval_array import render_eval_array

    cfg = config.load(REPO / "jobs" / "toy-grpo-eval-cpu.yaml")
    _check("sbatch/toy-grpo-eval-cpu-eval-array.sh", _normalized(render_eval_array(cfg, RUN_DIR, 3)))


@pytest.mark.parametrize("job", JOBS)
def test_deepspeed_config(job):
    cfg = config.load(REPO / "jobs" / job)
    device = "cpu" if cfg.trainer.device == "cpu" else "cuda"
    rendered = {"train": render_deepspeed(cfg, cfg.world_size, device),
                "reference": render_deepspeed(cfg, cfg.world_size, device, train=False)}
    _check(f"deepspeed/{job.removesuffix('.yaml')}.json", json.dumps(rendered, indent=1, sort_keys=True) + "\n")


@pytest.mark.parametrize("job,nodes,overrides", [
    ("toy-grpo-cpu.yaml", 1, []),
    # A preemptible partition, a shorter time limit and the engine's own memory fraction.
    ("qwen2.5-7b-gsm8k-grpo-lora.yaml", 2, ["slurm.partition=preempt", "slurm.time=04:00:00",
                                            "rollout.gpu_memory_utilization=0.85"]),
])
def test_rollout_job_script(job, nodes, overrides):
    from hpc_rl.cluster.rollout_jobs import render_rollout_job

    cfg = config.load(REPO / "jobs" / job, overrides)
    _check(f"sbatch/{job.removesuffix('.yaml')}-rollout-job.sh", _normalized(render_rollout_job(cfg, RUN_DIR, nodes,
                                                                                                overrides)))
