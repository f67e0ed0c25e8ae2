"""Steps to the toys' criterion, on-policy distillation against GRPO: jobs/toy-distill-cpu.yaml (the student of 4
SFT steps, the teacher of 30, both built once per cache) with trainer.stop_at {reward_mean: 0.8} (last-5 mean of the
copy_pair rule), for each seed, sides alternating (A B A B):

  distill        the job as it is: the teacher's per-token reverse KL and its top-8 term (distill.top_k), lr 2e-3
  distill_lr1e-3 the same at GRPO's learning rate
  sampled_only   the per-token reverse KL alone (distill.top_k 0), lr 1e-3: the sources' formulation
  grpo           GRPO on the copy_pair rule from the same student, no teacher, lr 1e-3 (at 2e-3 it is far slower)

Per side and seed: the steps to the criterion (the run's steps; trainer.steps + 1 when it is not reached) and the
wall seconds. The ratio is the job's mean steps / GRPO's, over the seeds of this run.
  python bench/distill.py              # seeds 1 2 3, up to 60 steps
  python bench/distill.py --quick      # seed 1
Writes bench/results/distill.json; the last line printed is one JSON object with the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import bench_job, machine, run_hpc_rl, table, write_result  # noqa: E402

SIDES = {"distill": [], "distill_lr1e-3": ["trainer.lr=1e-3"],
         "sampled_only": ["algorithm.distill.top_k=0", "trainer.lr=1e-3"],
         "grpo": ["services.teacher=null", "algorithm.distill.coef=0", "algorithm.distill.only=false",
                  "algorithm.distill.top_k=0", "trainer.lr=1e-3"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=60, help="trainer.steps: the most steps a side may take")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--work", help="keep the run dirs and logs here (default: a temp dir)")
    args = ap.parse_args()
    if args.quick:
        args.seeds = [1]
    work = Path(args.work or tempfile.mkdtemp(prefix="distill-bench-"))
    job = bench_job("toy-distill-cpu", "distill-bench", args.steps)
    job["eval"] = {"source": None}
    load_before = machine()["load_avg"]
    runs = {side: [] for side in SIDES}
    for seed in args.seeds:
        for side, overrides in SIDES.items():
            res = run_hpc_rl(job, work, f"{side}-{seed}", overrides=[f"seed={seed}",
                                                                     "trainer.stop_at={reward_mean: 0.8}", *overrides])
            rewards = [r["reward_mean"] for r in res["metrics"]]
            reached = len(rewards) >= 5 and sum(rewards[-5:]) / 5 >= 0.8
            runs[side].append({"seed": seed, "steps": len(rewards) if reached else args.steps + 1,
                               "reached": reached, "wall_s": res["wall_s"]})
            print(f"seed {seed} {side}: {runs[side][-1]}", flush=True)
    mean = {side: statistics.mean(r["steps"] for r in rs) for side, rs in runs.items()}
    ratio = mean["distill"] / mean["grpo"]
    print(table(["side", "steps to 0.8 (per seed)", "mean"],
                [[side, " ".join(str(r["steps"]) for r in rs), f"{mean[side]:.1f}"] for side, rs in runs.items()]))
    write_result("distill", {"machine": machine(), "load_avg_before": load_before, "seeds": args.seeds,
                             "max_steps": args.steps, "runs": runs, "mean_steps": mean,
                             "ratio_distill_vs_grpo_steps": ratio,
                             "ratio_at_grpo_lr": mean["distill_lr1e-3"] / mean["grpo"],
                             "ratio_sampled_only": mean["sampled_only"] / mean["grpo"], "goal": 0.5})
    print(json.dumps({"distill_vs_grpo_steps": round(ratio, 3), "goal": 0.5,
                      "at_grpo_lr": round(mean["distill_lr1e-3"] / mean["grpo"], 3),
                      "sampled_only": round(mean["sampled_only"] / mean["grpo"], 3)}))


if __name__ == "__main__":
    main()
