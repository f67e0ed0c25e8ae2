"""Start-up of a toy run: seconds from the `hpc-rl run jobs/toy-grpo-cpu.yaml` command to the end of its first step
(the first metrics.jsonl line), and where they go: each process's start-up phases, as HPC_RL_DEBUG=1 prints them
against the command's clock (rank 0: rank up, deepspeed imported, process group, engines built, servers ready,
first step done; the rollout server: server up, engine loaded, serving).

The reference, measured A B A B with it: one fresh interpreter importing what every trainer rank and server must
(torch, transformers' model classes, DeepSpeed), the floor a process pays before its own work. Goal (issue 54):
median command -> first step <= 8 s on 2 cores.
  python bench/startup.py             # 5 runs of each side
  python bench/startup.py --quick     # 1 run of each
Writes bench/results/startup.json; the last line printed is one JSON object with the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, hpc_rl_cmd, machine, write_result  # noqa: E402

JOB = REPO / "jobs" / "toy-grpo-cpu.yaml"
FLOOR = "import torch, deepspeed; from transformers import AutoModelForCausalLM, AutoTokenizer"
_PHASES = re.compile(r"start-up of (rank 0|rollout server 0), seconds since the command: (.+)$")


def phases(text: str) -> dict:
    """{process: {phase: seconds}} from the start-up lines of a debug run's logs."""
    out = {}
    for line in text.splitlines():
        m = _PHASES.search(line)
        if m:
            out[m.group(1)] = {name: float(t[:-1]) for name, t in (p.rsplit(" ", 1) for p in m.group(2).split(", "))}
    return out


def run_toy(work: Path, tag: str) -> dict:
    """One `hpc-rl run` of the toy as shipped (2 steps): command -> first step, and the phases."""
    out = work / tag
    env = dict(os.environ, HPC_RL_DEBUG="1")
    t0 = time.time()
    p = subprocess.run(hpc_rl_cmd() + ["run", str(JOB), "trainer.steps=2", f"output_dir={out}"], cwd=work, env=env,
                       capture_output=True, text=True, timeout=600)
    wall = time.time() - t0
    if p.returncode != 0:
        raise RuntimeError(f"hpc-rl run {JOB} exited {p.returncode}:\n{(p.stdout + p.stderr)[-2000:]}")
    (run,) = list(out.iterdir())
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    server_log = (run / "logs" / "rollout-0.log").read_text()
    return {"first_step_s": first["time"] - t0, "wall_s": wall, "phases": phases(p.stdout + p.stderr + server_log)}


def run_floor() -> float:
    t0 = time.time()
    subprocess.run([sys.executable, "-c", FLOOR], check=True, capture_output=True, timeout=300)
    return time.time() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 run of each side")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    reps = 1 if args.quick else args.reps
    before = machine()
    toy, floor = [], []
    with tempfile.TemporaryDirectory(prefix="hpc-rl-startup-") as tmp:
        run_toy(Path(tmp), "warm")  # builds the tiny model once (cached, as a user's second run finds it)
        for k in range(reps):  # A B A B
            toy.append(run_toy(Path(tmp), f"r{k}"))
            floor.append(run_floor())
            print(f"rep {k + 1}/{reps}: first step {toy[-1]['first_step_s']:.2f}s, import floor {floor[-1]:.2f}s",
                  flush=True)
    first = statistics.median(r["first_step_s"] for r in toy)
    fl = statistics.median(floor)
    med_phases = {}
    for proc in ("rank 0", "rollout server 0"):
        names = toy[0]["phases"].get(proc, {})
        med_phases[proc] = {n: round(statistics.median(r["phases"][proc][n] for r in toy), 2) for n in names}
    for proc, ph in med_phases.items():
        print(f"{proc:>17}: " + ", ".join(f"{n} {t:.2f}s" for n, t in ph.items()))
    summary = {"first_step_s": round(first, 2), "import_floor_s": round(fl, 2),
               "first_step_over_floor": round(first / fl, 2), "goal_s": 8.0, "met": first <= 8.0}
    write_result("startup", {"machine_before": before, "machine_after": machine(), "reps": reps, "toy": toy,
                             "floor_s": floor, "phases_median": med_phases, "summary": summary})
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
