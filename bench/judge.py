"""What an LLM judge costs against a rule: jobs/toy-judge-cpu.yaml (2 ZeRO-3 ranks, one HF rollout server, one HF
judge server of its own) two ways, sides alternating (A B A B):

  rule    the copy_pair rule as reward.function (no judge, no judge server)
  judge   reward.judge: each step's 256 samples judged in one batch on the run's judge server (the toy judge's
          count of right digits), greedy, 2 tokens per answer

Per side: median step seconds after the first and the judge's own seconds per step (judge_seconds); the ratio is
judge step time / rule step time, measured in the same run of this script. The judge's build (an SFT run, once per
cache) happens before the first judge side and is not timed.
  python bench/judge.py            # 12 steps, 2 rounds
  python bench/judge.py --quick    # 4 steps, 1 round
Writes bench/results/judge.json; the last line printed is one JSON object with the ratio.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import alternate_sides, bench_job, machine, rounds_args, steady, table, write_result  # noqa: E402

SIDES = {"rule": ["reward.judge=null", "services.judge=null", "reward.function=hpc_rl.rewards.toy:copy_pair"],
         "judge": []}


def main() -> None:
    args, work = rounds_args(__doc__, steps=12, rounds=2, quick=(4, 1), prefix="judge-bench-")
    job = bench_job("toy-judge-cpu", "judge-bench", args.steps)
    job["eval"] = {"source": None}  # the step time of training only
    load_before = machine()["load_avg"]

    def measure(side: str, res: dict) -> dict:
        m = res["metrics"][1:] or res["metrics"]
        return {"step_s": steady(res["step_s"]),
                "judge_s": statistics.median(x.get("judge_seconds", 0.0) for x in m),
                "judge_per_s": statistics.median(x.get("judge/s", 0.0) for x in m)}

    runs, med = alternate_sides(job, work, SIDES, args.rounds, measure)
    ratio = med["judge"]["step_s"] / med["rule"]["step_s"]
    rows = [[side, f"{v['step_s']:.2f}", f"{v['judge_s']:.2f}", f"{v['judge_per_s']:.0f}"] for side, v in med.items()]
    print(table(["side", "s/step", "judge s/step", "judgments/s"], rows))
    result = {"machine": machine(), "load_avg_before": load_before, "steps": args.steps, "rounds": args.rounds,
              "sides": med, "runs": runs, "ratio_judge_vs_rule_step_s": ratio}
    write_result("judge", result)
    print(json.dumps({"judge_vs_rule_step_s": round(ratio, 3), "judgments_per_s": round(med["judge"]["judge_per_s"])}))


if __name__ == "__main__":
    main()
