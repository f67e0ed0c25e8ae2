"""Asynchronous rollouts (issue 13): the same job synchronous vs rollout.async_steps=1 (and 2), A B A B.

Layout: the two-core "two nodes" model: one trainer rank pinned to the first core, the rollout server (HF engine)
to the last (trainer.local_cpus / rollout.local_cpus), so that generation and training can overlap only when the
pipeline overlaps them. The response length is chosen so that generation and training take similar times.
Goals: speedup = sync step / async step >= 1.4; async_over_bound = async step / max(gen, train) <= 1.15, with
gen = generate + reward and train = no-grad forwards + update + weight sync, both measured in the sync runs.
  python bench/pipeline.py            # 3 reps of sync / async 1 / async 2, 12 steps each
  python bench/pipeline.py --quick    # 2 reps of sync / async 1, 8 steps (< 6 min)
Prints a table; the last line is one JSON object. Writes bench/results/pipeline.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import SMALL, base_job, build_model, machine, run_hpc_rl, step_intervals, table, write_result  # noqa: E402


def make_job(model_dir: Path, steps: int, async_steps: int, new_tokens: int, cores: list[int]) -> dict:
    job = base_job("toy-grpo-cpu")
    job["name"] = f"pipeline-a{async_steps}"
    job["model"] = {"path": str(model_dir), "dtype": "float32"}
    job["trainer"].update(steps=steps, procs_per_node=1, prompts_per_step=16, mini_batch_size=128,
                          local_cpus=[cores[0]], check_sync_every=0)
    job["rollout"].update(async_steps=async_steps, max_new_tokens=new_tokens, local_cpus=[cores[-1]],
                          max_model_len=new_tokens + 32)
    job["checkpoint"] = {"every": 0}
    job["logging"] = {"tensorboard": False}
    return job


def phases(rows: list[dict]) -> dict:
    """Median seconds per step (steps after the first two) of the rollout side's and the trainer side's work."""
    rows = rows[2:] if len(rows) > 3 else rows

    def med(f) -> float:
        return statistics.median(f(r) for r in rows)

    return {"gen_s": med(lambda r: r["gen_seconds"] + r["reward_seconds"]),
            "train_s": med(lambda r: r["forward_seconds"] + r["update_seconds"] + r["sync_seconds"]),
            "wait_s": med(lambda r: r["trainer_wait_seconds"]), "idle_s": med(lambda r: r["rollout_idle_seconds"]),
            "lag_max": max(r["policy_lag_max"] for r in rows)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 reps of sync / async 1, 8 steps each (< 6 min)")
    ap.add_argument("--new-tokens", type=int, default=128, help="response length (balances generation and training)")
    ap.add_argument("--work", default=None, help="keep run dirs and logs here (default: a temp dir)")
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        print("bench/pipeline.py needs 2 cores (one per side); this process may use " + str(cores))
        return 2
    reps, steps, modes = (2, 8, [0, 1]) if args.quick else (3, 12, [0, 1, 2])
    work = Path(args.work or tempfile.mkdtemp(prefix="hpc-rl-pipeline-"))
    before = machine()
    model = build_model(SMALL, work / "model")
    runs: dict[int, list[dict]] = {m: [] for m in modes}
    for rep in range(reps):
        for m in modes:  # A B (C) A B (C): load drift spreads over every side
            res = run_hpc_rl(make_job(model, steps, m, args.new_tokens, cores), work, f"a{m}-r{rep}")
            iv = step_intervals(res["metrics"])
            res["steady_s"] = statistics.median(iv[2:] if len(iv) > 3 else iv)
            res["phases"] = phases(res["metrics"])
            runs[m].append(res)
            print(f"rep {rep} async_steps={m}: {res['steady_s']:.3f} s/step", flush=True)
    step = {m: statistics.median(r["steady_s"] for r in runs[m]) for m in modes}
    ph = {m: {k: statistics.median(r["phases"][k] for r in runs[m]) for k in runs[m][0]["phases"]} for m in modes}
    gen_s, train_s = ph[0]["gen_s"], ph[0]["train_s"]
    rows = [[f"async_steps={m}" if m else "sync", f"{step[m]:.3f}", f"{step[0] / step[m]:.2f}",
             f"{ph[m]['gen_s']:.3f}", f"{ph[m]['train_s']:.3f}", f"{ph[m]['wait_s']:.3f}", f"{ph[m]['idle_s']:.3f}",
             int(ph[m]["lag_max"]), " ".join(f"{r['steady_s']:.2f}" for r in runs[m])] for m in modes]
    print(table(["mode", "s/step", "speedup", "gen s", "train s", "trainer wait s", "rollout idle s", "max lag",
                 "per rep"], rows))
    out = {"sync_step_s": step[0], "async_step_s": step[1], "gen_s": gen_s, "train_s": train_s,
           "speedup": step[0] / step[1], "async_over_bound": step[1] / max(gen_s, train_s)}
    if 2 in step:
        out.update(async2_step_s=step[2], speedup_async2=step[0] / step[2])
    after = list(os.getloadavg())
    write_result("pipeline", {**out, "reps": reps, "steps": steps, "new_tokens": args.new_tokens,
                              "per_run": {m: [{"steady_s": r["steady_s"], "phases": r["phases"], "wall_s": r["wall_s"],
                                               "run_dir": r["run_dir"]} for r in runs[m]] for m in modes},
                              "machine": {**before, "load_avg_after": after}})
    print(f"machine: {before['cpu']}, {before['cores']} cores; load avg before {before['load_avg']}, after {after}; "
          f"goals: speedup >= 1.4, async_over_bound <= 1.15; work dir {work}")
    print(json.dumps({k: round(v, 4) for k, v in out.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
