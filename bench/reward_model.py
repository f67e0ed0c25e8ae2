"""What a reward model costs a PPO step: jobs/toy-ppo-rm-cpu.yaml scored by its tiny reward model on the trainer ranks
(ZeRO-3 inference engine) and on the rollout server, against the same job scored by the rule function alone.

Every side loads the same policy and reward-model folders (built once), runs the same steps; sides alternate
(A B C A B C) so that load from other jobs hits all alike. Per side: the median step time after the first step,
the reward-scoring seconds, the peak RSS of a trainer rank (max over ranks) and the reward model's parameter bytes
on each trainer rank (its ZeRO-3 shard).
  python bench/reward_model.py                 # 30 steps, 2 rounds
  python bench/reward_model.py --quick         # 8 steps, 1 round
Writes bench/results/reward_model.json; the last line printed is one JSON object with the ratios.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, SMALL, base_job, build_model, machine, param_sizes, rounds_args, run_hpc_rl, steady, table, write_result  # noqa: E402

SIDES = {"rule function": [], "reward model on trainer ranks": ["reward.model.placement=trainer"],
         "reward model on the rollout server": ["reward.model.placement=server"]}


def make_job(side: str, steps: int, model: Path, rm: Path) -> dict:
    job = base_job("toy-ppo-rm-cpu")
    job["model"] = {"path": str(model), "dtype": "float32"}
    job["trainer"]["steps"] = steps
    job["checkpoint"] = {"every": 0}
    job["name"] = "rm-bench"
    if side == "rule function":
        job["reward"] = {"function": "hpc_rl.rewards.toy:repeat_digit"}
    else:  # the job's reward-model settings, the folder built once instead of `tiny`
        job["reward"]["model"] = {**{k: v for k, v in job["reward"]["model"].items() if k != "tiny"}, "path": str(rm)}
    return job


def rm_shard_bytes(rm: Path, world: int) -> dict:
    """The reward model's fp32 parameter bytes in all and per trainer rank under ZeRO-3 (each parameter split in
    ceil(numel / world)-element shards, as tests/test_reward_model_dist.py checks)."""
    sizes = param_sizes(rm)
    return {"total_bytes": 4 * sum(sizes), "per_rank_bytes": 4 * sum(-(-n // world) for n in sizes)}


def main() -> None:
    args, work = rounds_args(__doc__, 30, 2, (8, 1), "bench-rm-")
    from hpc_rl.config import DataConfig
    from hpc_rl.data.datasets import tokenizer_corpus
    from hpc_rl.models.tiny_reward import build_tiny_reward_model

    model = build_model(SMALL, work / "policy")
    rm = build_tiny_reward_model("toy:repeat_digit", tokenizer_corpus(DataConfig(), 1), work / "reward-model")
    m0 = machine()
    per_side: dict[str, list[dict]] = {s: [] for s in SIDES}
    for k in range(args.rounds):
        for i, (side, overrides) in enumerate(SIDES.items()):
            print(f"[reward_model] round {k + 1}: {side} ({args.steps} steps) ...", flush=True)
            run = run_hpc_rl(make_job(side, args.steps, model, rm), work / f"round{k}", f"side{i}", overrides=overrides)
            rows = run["metrics"][1:]
            per_side[side].append({
                "step_s": steady(run["step_s"]),
                "reward_s": statistics.median(r.get("reward_seconds", 0.0) + r.get("reward_model_seconds", 0.0)
                                              for r in rows),
                "peak_rss_mib": max(r["rank_peak_rss_mib_max"] for r in run["metrics"]),
                "monitor_last": run["metrics"][-1].get("monitor_mean", run["metrics"][-1]["reward_mean"])})
    base = statistics.median(r["step_s"] for r in per_side["rule function"])
    summary = {}
    for side, rs in per_side.items():
        summary[side] = {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        summary[side]["step_ratio"] = summary[side]["step_s"] / base
    shard = rm_shard_bytes(rm, 2)
    result = {"machine_before": m0, "machine_after": machine(), "steps": args.steps, "rounds": args.rounds,
              "sides": per_side, "summary": summary, "reward_model_params": shard}
    path = write_result("reward_model", result)
    print(table(["side", "s/step (median)", "x rule", "scoring s/step", "peak RSS/rank MiB"],
                [[s, f"{v['step_s']:.3f}", f"{v['step_ratio']:.3f}", f"{v['reward_s']:.3f}",
                  f"{v['peak_rss_mib']:.0f}"] for s, v in summary.items()]))
    print(f"reward model: {shard['total_bytes'] / 2**20:.2f} MiB of fp32 parameters, "
          f"{shard['per_rank_bytes'] / 2**20:.2f} MiB on each of 2 trainer ranks (ZeRO-3)")
    print(f"wrote {path.relative_to(REPO)} (run dirs and logs in {work})")
    print(json.dumps({"step_ratio_trainer": summary["reward model on trainer ranks"]["step_ratio"],
                      "step_ratio_server": summary["reward model on the rollout server"]["step_ratio"],
                      "load_avg": [m0["load_avg"][0], result["machine_after"]["load_avg"][0]]}))


if __name__ == "__main__":
    main()
