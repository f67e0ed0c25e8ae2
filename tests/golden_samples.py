"""Golden samples: the first steps of seeded toy runs must stay bit-identical, so that a restructure of the RL loop
provably changes no sample. Each file under tests/golden/samples/ holds, per step, `samples_sha1` (of every
generated token id), `reward_mean`, and the evaluation rows of those steps.

The runs are ones the suite makes anyway (the learning runs of tests/test_toy_learning.py and tests/test_dapo.py,
the short run of tests/test_pipeline.py): a golden file costs no run of its own. Each test calls `check` on its
run dir. Re-record (an intended change of the samples, whose commit says why): HPC_RL_RECORD_GOLDEN=1 with the
tests that make the runs, e.g. `HPC_RL_RECORD_GOLDEN=1 .venv/bin/python -m pytest tests/test_toy_learning.py`.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

from hpc_rl.metrics import read_metrics
from hpc_rl.rundir import RunDir

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


def reward_model_sha1(run: Path) -> str:
    """The fingerprint of the tiny reward model a run trained at its start (its weights' bytes)."""
    return hashlib.sha1((RunDir(str(run)).reward_model_init / "model.safetensors").read_bytes()).hexdigest()[:16]


def check(name: str, run: Path, steps: int = STEPS, trained_reward_model: bool = False) -> None:
    """Compare the run's first steps with tests/golden/samples/NAME.json (write it under HPC_RL_RECORD_GOLDEN=1).

    trained_reward_model: the run trains a tiny reward model at its start, whose weights depend on the CPU's float
    kernels (400 optimizer steps amplify their rounding: a Xeon with AVX-512 and an AMD EPYC train different ones).
    Its rewards, and so every step after the first, are compared where the reward model is the recorded one; with
    another, the first step's samples (the initial policy's) are, and a warning says what was not."""
    got = samples_of(run, steps)
    assert len(got["steps"]) == steps, f"{run}: {len(got['steps'])} steps, the golden file needs {steps}"
    if trained_reward_model:
        got["reward_model_sha1"] = reward_model_sha1(run)
    path = DIR / f"{name}.json"
    if RECORD:
        DIR.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(got, indent=1) + "\n")
        return
    assert path.is_file(), f"{path} is missing; record it with HPC_RL_RECORD_GOLDEN=1"
    want = json.loads(path.read_text())
    if trained_reward_model and got["reward_model_sha1"] != want["reward_model_sha1"]:
        a, b = got["steps"][0]["samples_sha1"], want["steps"][0]["samples_sha1"]
        assert a == b, f"{name}: step 1's samples (of the initial policy) differ from the golden ones: got {a}, want {b}"
        warnings.warn(f"{name}: the reward model trained on this CPU ({got['reward_model_sha1']}) is not the recorded "
                      f"one ({want['reward_model_sha1']}): only step 1's samples were compared; HPC_RL_RECORD_GOLDEN=1 "
                      "records this machine's", stacklevel=2)
        return
    for a, b in zip(got["steps"], want["steps"]):
        assert a == b, f"{name}: step {b['step']} differs from the golden samples: got {a}, want {b}"
    assert got == want, f"{name}: evaluations differ from the golden samples: got {got.get('eval')}, want {want.get('eval')}"
