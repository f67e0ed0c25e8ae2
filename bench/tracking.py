"""What experiment tracking costs a run: the toy GRPO job (2 ZeRO-3 ranks, one HF rollout server) with metrics.jsonl
alone (A) and with W&B offline + an MLflow file store (B), sides alternating (A B A B).

Per side: median step seconds after the first (trackers log from a thread of rank 0: this should not move), the first
step's seconds (the trackers start meanwhile: wandb's service, MLflow's import), the seconds from the last step's
metrics line to the end of `hpc-rl run` (the trackers finish: the curves PNG, flushing), and the whole run's wall time.
  python bench/tracking.py           # 12 steps, 2 rounds
  python bench/tracking.py --quick   # 4 steps, 1 round
Writes bench/results/tracking.json; the last line printed is one JSON object with the ratios B / A.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import alternate_sides, bench_job, machine, rounds_args, steady, table, write_result  # noqa: E402

SIDES = {"metrics.jsonl only": [], "W&B offline + MLflow": ["logging.wandb.mode=offline", "logging.mlflow.experiment=bench"]}


def main() -> None:
    args, work = rounds_args(__doc__, steps=12, rounds=2, quick=(4, 1), prefix="tracking-bench-")
    job = bench_job("toy-grpo-cpu", "tracking-bench", args.steps)
    load_before = machine()["load_avg"]
    def measure(side: str, res: dict) -> dict:
        if SIDES[side]:
            text = (Path(res["run_dir"]) / "logs" / "trainer-0.log").read_text()
            assert "W&B: offline run" in text and "MLflow: run" in text, text[-2000:]
        # The end: from the last metrics line (rank 0 writes it, then finishes the trackers) to the launcher's exit.
        return {"step_s": steady(res["step_s"]), "first_step_s": res["step_s"][0],
                "end_s": res["end_time"] - res["metrics"][-1]["time"], "wall_s": res["wall_s"]}

    runs, med = alternate_sides(job, work, SIDES, args.rounds, measure)
    ref = med["metrics.jsonl only"]
    rows = [[side, f"{v['step_s']:.3f}", f"{v['step_s'] / ref['step_s']:.3f}", f"{v['first_step_s']:.2f}",
             f"{v['end_s']:.2f}", f"{v['wall_s']:.1f}", f"{v['wall_s'] / ref['wall_s']:.3f}"] for side, v in med.items()]
    print(table(["side", "s/step", "x", "first step s", "end s", "wall s", "x wall"], rows))
    tracked = med["W&B offline + MLflow"]
    result = {"machine": machine(), "load_avg_before": load_before, "steps": args.steps, "rounds": args.rounds,
              "sides": med, "runs": runs,
              "ratios": {"step_s": tracked["step_s"] / ref["step_s"], "wall_s": tracked["wall_s"] / ref["wall_s"]}}
    write_result("tracking", result)
    print(json.dumps({"tracked_over_plain": result["ratios"]}))


if __name__ == "__main__":
    main()
