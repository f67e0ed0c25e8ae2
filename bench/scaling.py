"""How hpc-rl's step time grows with work: batch size x1, x2, x4 (2 trainer ranks) and trainer ranks 1 -> 2.

Ratios are against the x1 / 1-rank runs of the same round; rounds repeat the whole set so load from other jobs
hits every variant alike. Linear cost would give x2 -> 2.0 and x4 -> 4.0; lower means fixed costs amortize.
  python bench/scaling.py            # toy GRPO (HF engine), 6 steps per run, 2 rounds (~8 min on 2 cores)
  python bench/scaling.py --quick    # 3 steps, 1 round
Writes bench/results/scaling.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, SMALL, base_job, build_model, fmt_spread, machine, run_hpc_rl, spread, steady, table, write_result  # noqa: E402

BASE_PROMPTS = 16
VARIANTS = {"batch x1": (1, 2), "batch x2": (2, 2), "batch x4": (4, 2), "1 rank": (1, 1)}  # (batch factor, ranks)


def job_for(model_dir: Path, factor: int, ranks: int, steps: int) -> dict:
    job = base_job("toy-grpo-cpu")
    job["model"] = {"path": str(model_dir), "dtype": "float32"}
    samples = BASE_PROMPTS * factor * job["algorithm"]["group_size"]
    # Two optimizer steps per RL step at every size: work grows with the batch, not the step count.
    job["trainer"].update(steps=steps, prompts_per_step=BASE_PROMPTS * factor, mini_batch_size=samples // 2,
                          procs_per_node=ranks)
    job["checkpoint"] = {"every": 0}
    return job


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 steps per run, 1 round")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", help="keep run dirs and logs here (default: a temp dir)")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.rounds = 3, 1
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-scaling-"))
    m0 = machine()
    model_dir = build_model(SMALL, work / "model")
    per: dict[str, list[float]] = {k: [] for k in VARIANTS}
    ratios: dict[str, list[float]] = {"batch x2 / x1": [], "batch x4 / x1": [], "2 ranks / 1 rank": []}
    for rnd in range(args.rounds):
        order = list(VARIANTS) if rnd % 2 == 0 else list(reversed(VARIANTS))
        got = {}
        for name in order:
            factor, ranks = VARIANTS[name]
            print(f"[scaling] round {rnd + 1}: {name} ...", flush=True)
            r = run_hpc_rl(job_for(model_dir, factor, ranks, args.steps), work, f"{name.replace(' ', '')}-{rnd}")
            got[name] = steady(r["step_s"])
            per[name].append(got[name])
        ratios["batch x2 / x1"].append(got["batch x2"] / got["batch x1"])
        ratios["batch x4 / x1"].append(got["batch x4"] / got["batch x1"])
        ratios["2 ranks / 1 rank"].append(got["batch x1"] / got["1 rank"])
    result = {"machine_before": m0, "steps": args.steps, "rounds": args.rounds, "base_prompts": BASE_PROMPTS,
              "step_s": {k: spread(v) for k, v in per.items()}, "ratios": {k: spread(v) for k, v in ratios.items()},
              "machine_after": machine()}
    path = write_result("scaling", result)
    print(render(result))
    print(f"wrote {path.relative_to(REPO)} (run dirs and logs in {work})")


def render(r: dict) -> str:
    g = 8
    rows = [[k, VARIANTS[k][1], BASE_PROMPTS * VARIANTS[k][0] * g, fmt_spread(v, 3)] for k, v in r["step_s"].items()]
    ideal = {"batch x2 / x1": "2.0 (linear)", "batch x4 / x1": "4.0 (linear)", "2 ranks / 1 rank": "0.5 (perfect)"}
    rrows = [[k, fmt_spread(v), ideal[k]] for k, v in r["ratios"].items()]
    m0, m1 = r["machine_before"], r["machine_after"]
    return "\n\n".join([
        table(["variant", "ranks", "samples/step", "s/step steady: median (min-max)"], rows),
        table(["ratio of step times", "median (min-max)", "reference"], rrows),
        f"toy GRPO, HF engine, steady = median of steps 2..{r['steps']}, {r['rounds']} round(s); machine: "
        f"{m0['cpu']}, {m0['cores']} cores, load avg {m0['load_avg'][0]:.1f} -> {m1['load_avg'][0]:.1f}"])


if __name__ == "__main__":
    main()
