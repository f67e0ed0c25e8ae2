"""Overhead of hpc-rl's RL step (P2): one step's wall time / (bare vllm.LLM.generate + bare DeepSpeed ZeRO-3
forward/backward/step of actor and critic), all measured in this one run on the same model, prompts and shapes.

Goal: ratio <= 1.15. Rounds alternate the run and its bare references (run, bare, run, bare), so that load from
other jobs hits both alike; the ratio is the median of the rounds'. Prints the per-phase breakdown (hpc-rl vs bare,
last round) and the ratios.
  python bench/overhead.py                 # PPO (actor + critic + reference), vLLM engine, 8 steps, 2 rounds
  python bench/overhead.py --algo grpo     # GRPO (actor only)
  python bench/overhead.py --quick         # 4 steps, 2 reference repetitions, 1 round
Writes bench/results/overhead.json; the last line printed is one JSON object with `ratio`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, base_job, machine, run_hpc_rl, table, write_result  # noqa: E402


def make_job(algo: str, steps: int) -> dict:
    job = base_job("toy-grpo-vllm-cpu")
    if algo == "ppo":
        ppo = base_job("toy-ppo-cpu")
        job["algorithm"] = ppo["algorithm"]
        job["trainer"].update(prompts_per_step=ppo["trainer"]["prompts_per_step"], lr=ppo["trainer"]["lr"],
                              critic_lr=ppo["trainer"]["critic_lr"])
    job["trainer"]["steps"] = steps
    job["trainer"]["check_sync_every"] = 0  # a correctness probe, not part of a production step
    job["checkpoint"] = {"every": max(1, steps // 2), "keep_last": 1}
    job["name"] = f"overhead-{algo}"
    return job


def bare_generate(run_dir: Path, rows: list[dict], reps: int) -> dict:
    """vllm.LLM.generate of each step's prompts, same n / max tokens / stop / log-probs as the run."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    from vllm import LLM, SamplingParams, TokensPrompt

    from hpc_rl import config
    from hpc_rl.data.datasets import PromptDataset
    from hpc_rl.models.loading import load_tokenizer

    cfg = config.load(run_dir / "job.yaml")
    tok = load_tokenizer(cfg.model.path)
    ds = PromptDataset(cfg.data, tok, cfg.seed)
    by_id = {int(r["id"]): i for i, r in enumerate(ds.rows)}
    from hpc_rl.rollout.server.engine_vllm import kv_cache_bytes

    r = cfg.rollout
    dtype = r.dtype if r.dtype != "auto" else cfg.model.dtype
    # The same KV cache as the project's engine (an absolute size: a fraction depends on the NUMA layout).
    llm = LLM(model=cfg.model.path, dtype=dtype, enforce_eager=True, max_model_len=r.max_model_len,
              gpu_memory_utilization=r.gpu_memory_utilization, kv_cache_memory_bytes=kv_cache_bytes(cfg, "cpu", dtype),
              seed=cfg.seed)
    times, toks = [], []
    steps = (rows * (reps // max(len(rows), 1) + 2))[:reps + 1]
    for k, m in enumerate(steps):
        ps = [TokensPrompt(prompt_token_ids=ds.token_ids[by_id[i]]) for i in m["prompt_ids"]]
        sp = SamplingParams(n=cfg.algorithm.group_size, max_tokens=r.max_new_tokens, temperature=r.temperature,
                            stop_token_ids=[tok.eos_token_id], logprobs=0, seed=k)
        t0 = time.perf_counter()
        out = llm.generate(ps, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        if k:  # the first batch is warm-up
            times.append(dt)
            toks.append(sum(len(c.token_ids) for o in out for c in o.outputs))
    del llm
    return {"gen_s": statistics.median(times), "tokens": statistics.median(toks), "raw": times}


def bare_zero3(run_dir: Path, samples: int, prompt_len: int, response_len: int, reps: int, work: Path) -> dict:
    """The run's ZeRO-3 engines on 2 (= trainer.procs_per_node) ranks, no RL loop: see _bare_zero3.py."""
    from hpc_rl import config
    from hpc_rl.netutil import free_port

    cfg = config.load(run_dir / "job.yaml")
    world = cfg.trainer.procs_per_node
    out = work / "bare_zero3.json"
    port = free_port("127.0.0.1")
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1"}  # as the launcher gives trainer ranks
        procs.append(subprocess.Popen(
            [sys.executable, str(REPO / "bench" / "_bare_zero3.py"), "--run-dir", str(run_dir), "--samples",
             str(samples), "--prompt-len", str(prompt_len), "--response-len", str(response_len), "--reps",
             str(reps), "--out", str(out)], env=env, stdout=open(work / f"bare_zero3-{rank}.log", "wb"),
            stderr=subprocess.STDOUT))
    for p in procs:
        if p.wait(timeout=900) != 0:
            raise RuntimeError(f"bare ZeRO-3 rank exited {p.returncode}; see {work}/bare_zero3-*.log")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algo", choices=["ppo", "grpo"], default="ppo")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=4, help="repetitions of each bare reference")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of run + bare references")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--work", help="keep the run dir and logs here (default: a temp dir)")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.reps = 4, 2
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-overhead-"))
    m0 = machine()
    rounds = [one_round(args, work / f"round{k}") for k in range(1 if args.quick else args.rounds)]
    result = dict(rounds[-1])
    result.update({"machine_before": m0, "machine_after": machine(), "rounds": rounds,
                   "ratio": statistics.median(r["ratio"] for r in rounds),
                   "ratio_incl_nograd_forwards": statistics.median(r["ratio_incl_nograd_forwards"] for r in rounds),
                   "ratio_best": min(r["ratio_best"] for r in rounds)})
    path = write_result("overhead", result)
    print(render(result))
    print(f"wrote {path.relative_to(REPO)} (run dirs and logs in {work})")
    print(json.dumps({"ratio": result["ratio"], "per_round": [r["ratio"] for r in rounds], "goal": 1.15,
                      "load_avg": [m0["load_avg"][0], result["machine_after"]["load_avg"][0]]}))


def one_round(args, work: Path) -> dict:
    """One hpc-rl run, then its bare references on the same model and shapes."""
    job = make_job(args.algo, args.steps)
    print(f"[overhead] {work.name}: hpc-rl run ({args.algo}, vLLM engine, {args.steps} steps) ...", flush=True)
    run = run_hpc_rl(job, work, "run")
    rows = run["metrics"]
    steady = rows[1:]  # step 1 is warm-up
    intervals = run["step_s"][1:]

    def mean(key):
        return statistics.mean(m[key] for m in steady)

    run_dir = Path(run["run_dir"])
    print(f"[overhead] {work.name}: bare vllm.LLM.generate ...", flush=True)
    gen = bare_generate(run_dir, steady, args.reps)
    samples = job["trainer"]["prompts_per_step"] * job["algorithm"]["group_size"]
    from hpc_rl import config
    from hpc_rl.models.loading import load_tokenizer

    cfg = config.load(run_dir / "job.yaml")
    tok = load_tokenizer(cfg.model.path)
    prompt_len = len(tok("copy 7 :", add_special_tokens=False)["input_ids"])  # every toy prompt has this length
    print(f"[overhead] {work.name}: bare DeepSpeed ZeRO-3 ...", flush=True)
    z3 = bare_zero3(run_dir, samples, prompt_len, job["rollout"]["max_new_tokens"], args.reps, work)

    step = statistics.mean(intervals)
    phases = {
        "generate": mean("gen_seconds"),
        "reward": mean("reward_seconds"),
        "old/ref log-probs + values": mean("forward_seconds"),
        "update (PPO epochs)": mean("update_seconds"),
        "weight sync": mean("sync_seconds"),
    }
    phases["advantages, scatter, rest"] = mean("step_seconds") - sum(phases.values())
    phases["logging/checkpoint"] = step - mean("step_seconds")
    bare = {"generate": gen["gen_s"], "old/ref log-probs + values": z3["nograd"], "update (PPO epochs)": z3["train"]}
    denom = gen["gen_s"] + z3["train"]
    return {
        "algo": args.algo, "steps": args.steps, "samples_per_step": samples,
        "response_len": mean("response_len"), "pad_fraction": mean("pad_fraction"), "hpc_rl_phases_s": phases,
        "hpc_rl_step_s": step, "hpc_rl_step_s_all": intervals, "bare_s": bare, "bare_generate": gen,
        "bare_zero3": z3, "ratio": step / denom, "ratio_incl_nograd_forwards": step / (denom + z3["nograd"]),
        # Fastest step over fastest references: the estimate least moved by other jobs' load.
        "ratio_best": min(intervals) / (min(gen["raw"]) + min(z3["raw"]["train"])),
    }


def render(r: dict) -> str:
    rows = [[k, f"{v:.3f}", f"{r['bare_s'][k]:.3f}" if k in r["bare_s"] else "-",
             f"{100 * v / r['hpc_rl_step_s']:.0f}%"] for k, v in r["hpc_rl_phases_s"].items()]
    rows.append(["total step", f"{r['hpc_rl_step_s']:.3f}",
                 f"{r['bare_s']['generate'] + r['bare_s']['update (PPO epochs)']:.3f} (gen+update)", "100%"])
    m0, m1 = r["machine_before"], r["machine_after"]
    per_round = ", ".join(f"{x['ratio']:.2f}" for x in r["rounds"])
    return "\n\n".join([
        table(["phase", "hpc-rl s/step", "bare s", "share"], rows),
        f"ratio step / (bare generate + bare ZeRO-3 fwd/bwd/step) = {r['ratio']:.2f} (median of "
        f"{len(r['rounds'])} round(s): {per_round}; goal <= 1.15); "
        f"counting the bare no-grad forwards too: {r['ratio_incl_nograd_forwards']:.2f}; fastest step / fastest "
        f"references: {r['ratio_best']:.2f}",
        f"{r['algo']}, {r['samples_per_step']} samples/step, mean response {r['response_len']:.1f} tokens, means of "
        f"steps 2..{r['steps']}; machine: {m0['cpu']}, {m0['cores']} cores, load avg {m0['load_avg'][0]:.1f} -> "
        f"{m1['load_avg'][0]:.1f}"])


if __name__ == "__main__":
    main()
