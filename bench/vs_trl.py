"""hpc-rl vs TRL's GRPOTrainer on this machine, same model, prompts, group size, lengths, batch, lr and steps.

Sides alternate A B A B (so load from other jobs hits both alike); each side is a fresh process, so "end to end"
includes start-up on both. Goal (issue 14, P1): hpc-rl / TRL steady samples/s >= 1.25 on 25M-var48.
  python bench/vs_trl.py            # 25M-var48 (fast layout), 25M-var48-sync, tiny, 50M (~20 min on 2 cores)
  python bench/vs_trl.py --quick    # tiny model only, 1 rep, 3 steps
  python bench/vs_trl.py --trl-vllm # adds TRL with vLLM colocate generation as a third side
Writes bench/results/vs_trl.json; the last line printed is one JSON object with the median ratio per config.
Needs the bench extra: pip install -e '.[bench]'.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    LARGE,
    MEDIUM,
    REPO,
    SMALL,
    base_job,
    build_model,
    fmt_spread,
    machine,
    param_count,
    run_hpc_rl,
    spread,
    steady,
    table,
    write_result,
)

# hpc-rl's fastest layout on one 2-core machine (README "Fastest single-machine layout"): one trainer rank without
# ZeRO partitioning (nothing to partition on one rank), token-budget micro-batches, generation one step ahead
# (the launcher gives the rank every core and the HF server half of them).
FAST_LAYOUT = ["trainer.procs_per_node=1", "trainer.zero_stage=0", "trainer.max_tokens_per_micro_batch=512",
               "rollout.async_steps=1"]
# The fastest synchronous (on-policy, as TRL) layout: the same, generating and training in turn on every core.
SYNC_LAYOUT = ["trainer.procs_per_node=1", "trainer.zero_stage=0", "trainer.max_tokens_per_micro_batch=512"]

# name: model shape, prompts/step, group, max new tokens, lr, steps, reps, hpc-rl's layout (dotted overrides of the
# toy GRPO job; none: the toy job's own, 2 ZeRO-3 ranks)
CONFIGS = {
    # Issue 14's workload: ~25M parameters, responses of variable length up to 48 tokens.
    "25M-var48": dict(model=MEDIUM, prompts=8, group=8, max_new=48, lr=1e-5, steps=6, reps=2, layout=FAST_LAYOUT),
    "25M-var48-sync": dict(model=MEDIUM, prompts=8, group=8, max_new=48, lr=1e-5, steps=6, reps=2,
                           layout=SYNC_LAYOUT),
    "tiny": dict(model=SMALL, prompts=16, group=8, max_new=6, lr=3e-3, steps=8, reps=3, layout=[]),
    "50M": dict(model=LARGE, prompts=4, group=8, max_new=6, lr=1e-4, steps=4, reps=2, layout=[]),
}


def hpc_rl_side(c: dict, model_dir: Path, work: Path, tag: str) -> dict:
    job = base_job("toy-grpo-cpu")
    job["model"] = {"path": str(model_dir), "dtype": "float32"}
    job["trainer"].update(steps=c["steps"], prompts_per_step=c["prompts"], lr=c["lr"],
                          mini_batch_size=c["prompts"] * c["group"])  # one optimizer step per RL step, like TRL
    job["algorithm"]["group_size"] = c["group"]
    job["rollout"]["max_new_tokens"] = c["max_new"]
    job["checkpoint"] = {"every": 0}
    job["rollout"]["max_model_len"] = 16 + c["max_new"] + 8
    r = run_hpc_rl(job, work, tag, overrides=c["layout"])
    resp = [m["response_len"] for m in r["metrics"]]
    return {"wall_s": r["wall_s"], "step_s": r["step_s"], "response_len": sum(resp) / len(resp)}


def trl_side(c: dict, model_dir: Path, work: Path, tag: str, vllm: bool) -> dict:
    out = work / f"{tag}.json"
    cmd = [sys.executable, str(REPO / "bench" / "_trl_grpo.py"), "--model", str(model_dir), "--out", str(out),
           "--steps", str(c["steps"]), "--prompts-per-step", str(c["prompts"]), "--group", str(c["group"]),
           "--max-new", str(c["max_new"]), "--lr", str(c["lr"])] + (["--vllm"] if vllm else [])
    log = work / f"{tag}.log"
    t0 = time.perf_counter()
    with open(log, "wb") as f:
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=1200,
                           env={**__import__("os").environ, "VLLM_CPU_OMP_THREADS_BIND": "0"})
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"TRL side exited {p.returncode}; see {log}:\n" + log.read_text()[-1500:])
    d = json.loads(out.read_text())
    ends = d["step_ends"]
    steps = [b - a for a, b in zip([d["train_start"]] + ends, ends)]
    lens = [x["completions/mean_length"] for x in d["logs"] if "completions/mean_length" in x]
    return {"wall_s": wall, "step_s": steps, "response_len": sum(lens) / max(len(lens), 1)}


def last_error_line(text: str) -> str:
    lines = [x.strip() for x in text.splitlines() if "Error" in x or "error" in x]
    return (lines[-1] if lines else text.strip().splitlines()[-1])[-300:]


def summarize(c: dict, side: dict) -> dict:
    n = c["prompts"] * c["group"]
    per_step = steady(side["step_s"])
    return {"steady_step_s": per_step, "samples_per_s": n / per_step,
            "tokens_per_s": n * side["response_len"] / per_step,
            "e2e_samples_per_s": n * c["steps"] / side["wall_s"], "wall_s": side["wall_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model only, 1 repetition, 3 steps")
    ap.add_argument("--reps", type=int, help="repetitions per side (default per config: 3 tiny, 2 50M)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: " + ",".join(CONFIGS))
    ap.add_argument("--trl-vllm", action="store_true", help="also run TRL with vLLM colocate generation")
    ap.add_argument("--work", help="keep run dirs and logs here (default: a temp dir)")
    args = ap.parse_args()
    names = ["tiny"] if args.quick else args.configs.split(",")
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-vs-trl-"))
    sides = ["hpc-rl", "trl"] + (["trl-vllm"] if args.trl_vllm else [])
    result = {"machine_before": machine(), "configs": {}}
    for name in names:
        c = dict(CONFIGS[name])
        if args.quick:
            c.update(steps=3, reps=1)
        if args.reps:
            c["reps"] = args.reps
        shape = c["model"]
        model_dir = build_model(shape, work / f"model-{shape['hidden_size']}x{shape['num_layers']}")
        runs: dict[str, list] = {s: [] for s in sides}
        failed: dict[str, str] = {}
        for rep in range(c["reps"]):
            for s in sides:  # A B (C) A B (C): alternating
                tag = f"{name}-{s}-{rep}"
                if s in failed:
                    continue
                print(f"[vs_trl] {tag} ...", flush=True)
                try:
                    raw = hpc_rl_side(c, model_dir, work, tag) if s == "hpc-rl" else \
                        trl_side(c, model_dir, work, tag, vllm=(s == "trl-vllm"))
                except RuntimeError as e:
                    if s != "trl-vllm":
                        raise
                    # TRL 1.16 supports vLLM <= 0.31; record why it did not run instead of losing the others.
                    failed[s] = last_error_line(str(e))
                    print(f"[vs_trl] {s} failed: {failed[s]}", flush=True)
                    continue
                runs[s].append({**raw, **summarize(c, raw)})
        res = {"params": param_count(model_dir), **{k: v for k, v in c.items() if k != "model"},
               "model": c["model"], "runs": runs, "ratios": {}}
        res["failed"] = failed
        for s in sides[1:]:
            if s in failed:
                continue
            pairs = list(zip(runs["hpc-rl"], runs[s]))
            res["ratios"][s] = {
                "steady_samples_per_s": spread([a["samples_per_s"] / b["samples_per_s"] for a, b in pairs]),
                "end_to_end": spread([b["wall_s"] / a["wall_s"] for a, b in pairs])}
        result["configs"][name] = res
    result["machine_after"] = machine()
    path = write_result("vs_trl", result)
    print(render(result))
    print(f"wrote {path.relative_to(REPO)} (run dirs and logs in {work})")
    print(json.dumps({"ratio": {name: res["ratios"]["trl"]["steady_samples_per_s"]["median"]
                                for name, res in result["configs"].items() if "trl" in res["ratios"]},
                      "goal": 1.25, "load_avg": [result["machine_before"]["load_avg"][0],
                                                          result["machine_after"]["load_avg"][0]]}))


def render(result: dict) -> str:
    rows = []
    for name, res in result["configs"].items():
        for s, rs in res["runs"].items():
            if not rs:
                rows.append([name, s, 0, "failed: " + res["failed"].get(s, "?")[:90], "", "", ""])
                continue
            rows.append([f"{name} ({res['params'] / 1e6:.2f}M)", s, len(rs),
                         fmt_spread(spread([r["steady_step_s"] for r in rs])),
                         fmt_spread(spread([r["samples_per_s"] for r in rs]), 1),
                         fmt_spread(spread([r["tokens_per_s"] for r in rs]), 0),
                         fmt_spread(spread([r["wall_s"] for r in rs]), 1)])
    out = [table(["model", "side", "reps", "s/step (steady)", "samples/s", "gen tokens/s", "end-to-end s"], rows)]
    rrows = []
    for name, res in result["configs"].items():
        for s, r in res["ratios"].items():
            rrows.append([name, f"hpc-rl / {s}", fmt_spread(r["steady_samples_per_s"]), fmt_spread(r["end_to_end"])])
    out.append(table(["model", "ratio", "samples/s steady: median (min-max)", "end-to-end speed: median (min-max)"],
                     rrows))
    m0, m1 = result["machine_before"], result["machine_after"]
    out.append(f"machine: {m0['cpu']}, {m0['cores']} cores; load avg before {m0['load_avg'][0]:.1f}, "
               f"after {m1['load_avg'][0]:.1f}; steady = median of steps 2..N; goal: steady ratio >= 1.25 on 25M-var48")
    return "\n\n".join(out)


if __name__ == "__main__":
    main()
