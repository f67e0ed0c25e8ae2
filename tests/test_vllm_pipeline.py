"""`hpc-rl run jobs/toy-grpo-vllm-cpu.yaml` for a few steps: vLLM rollout, collective sync, sync check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_rl.config import load

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

JOB = Path(__file__).resolve().parents[1] / "jobs" / "toy-grpo-vllm-cpu.yaml"


def test_toy_grpo_with_vllm_and_collective_sync(tmp_path):
    pytest.importorskip("vllm")
    steps = 5
    p = subprocess.run([sys.executable, "-m", "hpc_rl.cli", "run", str(JOB), f"trainer.steps={steps}",
                        f"output_dir={tmp_path}", "checkpoint.every=0"],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (run,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["policy_version"] for r in rows] == list(range(1, steps + 1))
    tol = load(JOB).trainer.sync_tolerance
    checked = [r["sync_max_diff"] for r in rows if r.get("sync_max_diff") is not None]
    assert len(checked) == 1 and checked[0] < tol  # trainer.check_sync_every: 5
    assert all(r["sync_bytes"] > 0 for r in rows)
    log = (run / "logs" / "rollout-0.log").read_text()
    assert log.count("over the collective") == steps  # every version went over the gloo group
