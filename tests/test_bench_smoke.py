"""bench/: the helpers' arithmetic (fast) and that each script parses its arguments and the TRL reference side
still runs on the installed stack (slow). No timing is asserted anywhere: timings are benchmarks."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import _common  # noqa: E402


def test_step_intervals_use_step_seconds_then_metric_times():
    rows = [{"time": 10.0, "step_seconds": 3.0}, {"time": 11.5, "step_seconds": 1.0}, {"time": 13.5, "step_seconds": 1.8}]
    assert _common.step_intervals(rows) == [3.0, 1.5, 2.0]
    assert _common.steady([3.0, 1.5, 2.0, 1.0]) == 1.5  # median of all but the warm-up step
    assert _common.spread([2.0, 1.0, 4.0]) == {"median": 2.0, "min": 1.0, "max": 4.0, "n": 3}
    assert _common.fmt_spread({"median": 2.0, "min": 1.0, "max": 4.25}) == "2.00 (1.00-4.25)"


def test_table_aligns_columns():
    assert _common.table(["a", "bb"], [[1, "x"], ["long", 2]]).splitlines() == [
        "| a    | bb |", "|------|----|", "| 1    | x  |", "| long | 2  |"]


@pytest.mark.slow
@pytest.mark.parametrize("script", ["vs_trl.py", "overhead.py", "scaling.py", "pipeline.py", "multi_turn.py",
                                    "agent_overhead.py", "judge.py", "distill.py", "vlm.py", "startup.py",
                                    "partial.py"])
def test_script_parses_arguments(script):
    p = subprocess.run([sys.executable, str(REPO / "bench" / script), "--help"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert "--quick" in p.stdout


@pytest.mark.slow
def test_gpu_check_says_no_gpu_here():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: gpu_check.sh would run for minutes")
    p = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh")], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHON": sys.executable})
    assert p.returncode == 2
    assert "no CUDA GPU visible" in p.stdout


@pytest.mark.slow
def test_gpu_check_dry_runs_every_part_on_the_cpu(tmp_path):
    """--dry: doctor, the model, a ZeRO-3 step, HF generation with the engine-vs-trainer log-prob comparison and a
    2-step toy run through `hpc-rl run`, on the CPU, into $OUT: a lent GPU call then fails on nothing but the GPU."""
    p = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--dry"], capture_output=True, text=True,
                       timeout=500, env={**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads((tmp_path / "gpu_check_dry.json").read_text())
    assert r["dry"] is True and "vLLM" in r["vllm"]
    assert not [part for part in ("zero3", "generate", "toy") if "error" in r[part]], p.stdout[-3000:]
    assert r["zero3"]["step_s"] > 0 and r["zero3"]["ranks"] == 1
    g = r["generate"]
    # fp32 on the CPU: the engine's and the trainer's log-probs of the same tokens agree to rounding
    assert g["tokens"] == g["logprob_tokens"] > 0 and g["logprob_abs_diff_max"] < 1e-4
    t = r["toy"]
    assert t["steps"] == 2 and t["push_bytes"] > 0 and t["push_transport"].startswith("collective (gloo)")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs the bench extra: pip install -e '.[bench]'")
def test_trl_reference_side_runs_one_step(tmp_path):
    model = _common.build_model(_common.SMALL, tmp_path / "model")
    out = tmp_path / "trl.json"
    p = subprocess.run([sys.executable, str(REPO / "bench" / "_trl_grpo.py"), "--model", str(model), "--out",
                        str(out), "--steps", "1", "--prompts-per-step", "2", "--group", "4", "--max-new", "4"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    d = json.loads(out.read_text())
    assert len(d["step_ends"]) == 1
    assert 1 <= d["logs"][0]["completions/mean_length"] <= 4
