"""Golden samples: the first steps of seeded toy runs must stay bit-identical, so that a restructure of the RL loop
provably changes no sample. Each file under tests/golden/samples/ holds, per step, `samples_sha1` (of every
generated token id), `reward_mean`, and the evaluation rows of those steps.

The runs are ones the suite makes anyway (the learning runs of tests/test_toy_learning.py and tests/test_dapo.py,
the short run of tests/test_pipeline.py): a golden file costs no run of its own. Each test calls `check` on its
run dir. Re-record (an intended change of the samples, whose commit says why): HPC_RL_RECORD_GOLDEN=1 with the
tests that make the runs, e.g. `HPC_RL_RECORD_GOLDEN=1 .venv/bin/python -m pytest tests/test_toy_learning.py`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hpc_rl.metrics import read_metrics

DIR = Path(__file__).resolve().parent / "golden" / "samples"
RECORD = os.environ.get("HPC_RL_RECORD_GOLDEN") == "1"
STEPS = 6


def samples_of(run: Path, steps: int = STEPS) -> dict:
    """What a golden file holds for a run dir: its first `steps` steps and the evaluations of steps <= `steps`."""
    rows = read_metrics(run / "metrics.jsonl")[:steps]
    out = {"steps": [{"step": r["step"], "samples_sha1": r["samples_sha1"], "reward_mean": r["reward_mean"]}
                     for r in rows]}
    evals = run / "eval.jsonl"
    if evals.is_file():
        out["eval"] = [{k: v for k, v in sorted(e.items()) if k == "step" or k.startswith("eval/") and k != "eval/seconds"}
                       for e in read_metrics(evals) if e["step"] <= steps and e.get("source", "train") == "train"]
    return out


def check(name: str, run: Path, steps: int = STEPS) -> None:
    """Compare the run's first steps with tests/golden/samples/NAME.json (write it under HPC_RL_RECORD_GOLDEN=1)."""
    got = samples_of(run, steps)
    assert len(got["steps"]) == steps, f"{run}: {len(got['steps'])} steps, the golden file needs {steps}"
    path = DIR / f"{name}.json"
    if RECORD:
        DIR.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(got, indent=1) + "\n")
        return
    assert path.is_file(), f"{path} is missing; record it with HPC_RL_RECORD_GOLDEN=1"
    want = json.loads(path.read_text())
    for a, b in zip(got["steps"], want["steps"]):
        assert a == b, f"{name}: step {b['step']} differs from the golden samples: got {a}, want {b}"
    assert got == want, f"{name}: evaluations differ from the golden samples: got {got.get('eval')}, want {want.get('eval')}"
