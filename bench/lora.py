"""Full fine-tuning against LoRA (rank 8 and 32, every linear module of the body) on a ~25M-parameter model: the
toy GRPO job of jobs/toy-grpo-cpu.yaml on 2 ZeRO-3 ranks and one rollout server, the same model folder, steps and
data on every side; sides alternate (A B C A B C).

Per side: trainable parameters (counted on the model as PEFT wraps it), optimizer-state bytes of one rank (the
size of its ZeRO-3 optimizer file in the last checkpoint: fp32 master copy and Adam moments of its partition),
peak RSS of a trainer rank, bytes and seconds of one weight push (median; the servers merge LoRA adapters into
their weights, so a push's seconds include that merge), and the median step time after the first step. For the
choice of what a LoRA push carries, the bytes of the alternative are printed too: the adapted weights themselves
(merged deltas of the adapted modules).
  python bench/lora.py                 # 12 steps, 2 rounds
  python bench/lora.py --quick         # 5 steps, 1 round
Writes bench/results/lora.json; the last line printed is one JSON object with the ratios against full fine-tuning.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import MEDIUM, REPO, base_job, build_model, machine, param_count, rounds_args, run_hpc_rl, steady, table, write_result  # noqa: E402

SIDES = {"full": None, "lora r8": 8, "lora r32": 32}


def make_job(rank: int | None, steps: int, model: Path) -> dict:
    job = base_job("toy-grpo-cpu")
    job["name"] = "lora-bench"
    job["model"] = {"path": str(model), "dtype": "float32"}
    if rank is not None:
        job["model"]["lora"] = {"rank": rank, "alpha": 2 * rank, "target_modules": ["all-linear"]}
    job["trainer"].update(steps=steps, prompts_per_step=8, mini_batch_size=32, check_sync_every=0)
    job["rollout"]["max_new_tokens"] = 8
    job["checkpoint"] = {"every": steps, "keep_last": 1, "save_hf": False}
    return job


def counts(model: Path, rank: int | None) -> dict:
    """Trainable parameters as the trainer wraps the model, and the bytes of the adapted weights (what a push of
    merged deltas would carry) against the adapters' own."""
    import torch  # noqa: F401
    from peft import get_peft_model

    from hpc_rl.config import LoraConfig
    from hpc_rl.models import load_causal_lm
    from hpc_rl.models.lora import peft_config, resolve_targets

    m = load_causal_lm(model)
    total = sum(p.numel() for p in m.parameters())
    if rank is None:
        return {"trainable": total, "total": total}
    lora = LoraConfig(rank=rank, alpha=2 * rank)
    targets = resolve_targets(m, lora.target_modules, "model.lora")
    mods = dict(m.named_modules())
    adapted_bytes = sum(mods[t].weight.numel() * 4 for t in targets)
    pm = get_peft_model(m, peft_config(lora, targets))
    trainable = sum(p.numel() for p in pm.parameters() if p.requires_grad)
    return {"trainable": trainable, "total": total, "merged_delta_bytes": adapted_bytes, "adapter_bytes": 4 * trainable}


def optimizer_bytes(run_dir: str) -> int:
    files = sorted(Path(run_dir).glob("checkpoints/step_*/deepspeed/actor/state/zero_pp_rank_0_*optim_states.pt"))
    return files[-1].stat().st_size


def main() -> None:
    args, work = rounds_args(__doc__, 12, 2, (5, 1), "bench-lora-")
    model = build_model(MEDIUM, work / "policy")
    m0 = machine()
    per_side: dict[str, list[dict]] = {s: [] for s in SIDES}
    for k in range(args.rounds):
        for i, (side, rank) in enumerate(SIDES.items()):
            print(f"[lora] round {k + 1}: {side} ({args.steps} steps) ...", flush=True)
            run = run_hpc_rl(make_job(rank, args.steps, model), work / f"round{k}", f"side{i}")
            rows = run["metrics"][1:] or run["metrics"]
            per_side[side].append({
                "step_s": steady(run["step_s"]),
                "push_bytes": statistics.median(r["sync_bytes"] for r in rows),
                "push_s": statistics.median(r["push_seconds"] for r in rows if r.get("push_seconds") is not None),
                "peak_rss_mib": max(r["rank_peak_rss_mib_max"] for r in run["metrics"]),
                "optimizer_bytes_rank0": optimizer_bytes(run["run_dir"])})
    summary = {}
    for side, rs in per_side.items():
        summary[side] = {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        summary[side].update(counts(model, SIDES[side]))
    full = summary["full"]
    for s in summary.values():
        s["ratios"] = {k: s[k] / full[k] for k in ("push_bytes", "optimizer_bytes_rank0", "step_s", "peak_rss_mib",
                                                    "trainable")}
    result = {"machine_before": m0, "machine_after": machine(), "steps": args.steps, "rounds": args.rounds,
              "model_params": param_count(model), "sides": per_side, "summary": summary}
    path = write_result("lora", result)
    print(table(["side", "trainable", "opt state/rank MiB", "peak RSS/rank MiB", "push MiB", "push s", "s/step",
                 "push x full", "opt x full", "step x full"],
                [[s, f"{v['trainable'] / 1e6:.2f}M", f"{v['optimizer_bytes_rank0'] / 2**20:.2f}",
                  f"{v['peak_rss_mib']:.0f}", f"{v['push_bytes'] / 2**20:.2f}", f"{v['push_s']:.3f}",
                  f"{v['step_s']:.3f}", f"{v['ratios']['push_bytes']:.3f}", f"{v['ratios']['optimizer_bytes_rank0']:.3f}",
                  f"{v['ratios']['step_s']:.3f}"] for s, v in summary.items()]))
    for s, v in summary.items():
        if "merged_delta_bytes" in v:
            print(f"{s}: a push of merged deltas (the adapted weights) would carry "
                  f"{v['merged_delta_bytes'] / 2**20:.1f} MiB, the adapters {v['adapter_bytes'] / 2**20:.2f} MiB")
    m1 = result["machine_after"]
    print(f"model {result['model_params'] / 1e6:.1f}M parameters; load avg {m0['load_avg'][0]:.2f} -> "
          f"{m1['load_avg'][0]:.2f}; goals at rank 8: push <= 0.05 x full, optimizer state <= 0.05 x full, step <= "
          f"full; wrote {path.relative_to(REPO)} (run dirs and logs in {work})")
    r8 = summary["lora r8"]["ratios"]
    print(json.dumps({"push_ratio_r8": r8["push_bytes"], "optimizer_ratio_r8": r8["optimizer_bytes_rank0"],
                      "step_ratio_r8": r8["step_s"], "step_ratio_r32": summary["lora r32"]["ratios"]["step_s"],
                      "load_avg": [m0["load_avg"][0], m1["load_avg"][0]]}))


if __name__ == "__main__":
    main()
