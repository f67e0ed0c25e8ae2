"""Multi-turn rollouts with and without tools: the toy tool job (jobs/toy-tool-cpu.yaml, 2 ZeRO-3 ranks and one HF
rollout server, random-init policy) three ways, sides alternating (A B C A B C):

  no tools       rollout.max_turns 1: one assistant turn, the environment scores it (the tool never runs)
  instant tool   the lookup tool answers from memory (a dict lookup)
  sandboxed tool the lookup runs `print(D)` in the python tool's sandbox (a process in its own namespaces:
                 a real tool's latency)

Per side: median step seconds after the first, the rollout phase's seconds (every trajectory of the step in
flight), engine idle seconds inside it (no generation request in flight: every unfinished trajectory waited for
its tool), tool seconds summed over trajectories, and tool calls per sample. Tool seconds above the rollout's
wall time mean tools ran while other trajectories generated (what the controller-side loop is for).
  python bench/multi_turn.py           # 12 steps, 2 rounds
  python bench/multi_turn.py --quick   # 4 steps, 1 round
Writes bench/results/multi_turn.json; the last line printed is one JSON object with the ratios against no tools.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import alternate_sides, bench_job, machine, rounds_args, steady, table, write_result  # noqa: E402

SIDES = {"no tools": ["rollout.max_turns=1"], "instant tool": [],
         "sandboxed tool": ["rollout.env_kwargs={sandboxed: true}", "rollout.tool_timeout_s=60"]}


def main() -> None:
    args, work = rounds_args(__doc__, steps=12, rounds=2, quick=(4, 1), prefix="multi-turn-bench-")
    job = bench_job("toy-tool-cpu", "multi-turn-bench", args.steps)
    load_before = machine()["load_avg"]
    def measure(side: str, res: dict) -> dict:
        m = res["metrics"][1:] or res["metrics"]
        return {"step_s": steady(res["step_s"]), "rollout_s": statistics.median(x["rollout_seconds"] for x in m),
                "idle_s": statistics.median(x["engine_idle_seconds"] for x in m),
                "tool_s": statistics.median(x["tool_seconds"] for x in m),
                "calls": statistics.median(x["tool_calls_per_sample"] for x in m),
                "gen_tokens_per_s": statistics.median(x["gen_tokens_per_s"] for x in m)}

    runs, med = alternate_sides(job, work, SIDES, args.rounds, measure)
    ref = med["no tools"]
    rows = [[side, f"{v['step_s']:.2f}", f"{v['step_s'] / ref['step_s']:.2f}", f"{v['rollout_s']:.2f}",
             f"{v['idle_s']:.3f}", f"{v['tool_s']:.2f}", f"{v['calls']:.2f}"] for side, v in med.items()]
    print(table(["side", "s/step", "x no tools", "rollout s", "engine idle s", "tool s (sum)", "calls/sample"], rows))
    result = {"machine": machine(), "load_avg_before": load_before, "steps": args.steps, "rounds": args.rounds,
              "sides": med, "runs": runs,
              "ratios": {side: v["step_s"] / ref["step_s"] for side, v in med.items()}}
    write_result("multi_turn", result)
    print(json.dumps({"step_time_x_no_tools": result["ratios"],
                      "engine_idle_s": {s: v["idle_s"] for s, v in med.items()}}))


if __name__ == "__main__":
    main()
