"""What held-out evaluation costs an asynchronous run: the toy eval job (jobs/toy-grpo-eval-cpu.yaml: 2 ZeRO-3
ranks, one HF rollout server, rollout.async_steps 1) without evaluation (A) and with an evaluation every 10 steps
(B), sides alternating (A B A B). B evaluates the 20 held-out prompts x 13 samples (temperature 1): 260 samples,
~10% of the 2,560 training samples of an interval of 10 steps; plus the step-0 baseline (eval.at_start).

Per side: median step seconds after the first, the whole run's wall time, and (B) the seconds the evaluations took
on the server. The goal: B's wall time at most 1.10 x A's.
  python bench/eval_cost.py           # 20 steps, 2 rounds
  python bench/eval_cost.py --quick   # 10 steps, 1 round
Writes bench/results/eval_cost.json; the last line printed is one JSON object with the ratios B / A.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import alternate_sides, bench_job, machine, rounds_args, steady, table, write_result  # noqa: E402

SIDES = {"no evaluation": ["eval.source=null"],
         "eval every 10 steps": ["eval.every=10", "eval.samples_per_prompt=13", "eval.temperature=1.0"]}


def main() -> None:
    args, work = rounds_args(__doc__, steps=20, rounds=2, quick=(10, 1), prefix="eval-bench-")
    job = bench_job("toy-grpo-eval-cpu", "eval-bench", args.steps)
    job["rollout"]["async_steps"] = 1
    load_before = machine()["load_avg"]

    def measure(side: str, res: dict) -> dict:
        evals = [json.loads(x) for x in (Path(res["run_dir"]) / "eval.jsonl").read_text().splitlines()] \
            if (Path(res["run_dir"]) / "eval.jsonl").exists() else []
        assert bool(evals) == (side != "no evaluation"), (side, evals)
        return {"step_s": steady(res["step_s"]), "wall_s": res["wall_s"], "evals": len(evals),
                "eval_s": sum(e["eval/seconds"] for e in evals),
                "eval_samples": sum(e["eval/prompts"] * e["k"] for e in evals)}

    runs, med = alternate_sides(job, work, SIDES, args.rounds, measure)
    ref = med["no evaluation"]
    rows = [[side, f"{v['step_s']:.3f}", f"{v['step_s'] / ref['step_s']:.3f}", f"{v['wall_s']:.1f}",
             f"{v['wall_s'] / ref['wall_s']:.3f}", f"{v['evals']:.0f}", f"{v['eval_s']:.2f}"] for side, v in med.items()]
    print(table(["side", "s/step", "x", "wall s", "x wall", "evaluations", "eval s (server)"], rows))
    ev = med["eval every 10 steps"]
    result = {"machine": machine(), "load_avg_before": load_before, "steps": args.steps, "rounds": args.rounds,
              "train_samples_per_interval": 10 * job["trainer"]["prompts_per_step"] * job["algorithm"]["group_size"],
              "sides": med, "runs": runs,
              "ratios": {"step_s": ev["step_s"] / ref["step_s"], "wall_s": ev["wall_s"] / ref["wall_s"]}}
    write_result("eval_cost", result)
    print(json.dumps({"eval_over_plain": result["ratios"]}))


if __name__ == "__main__":
    main()
