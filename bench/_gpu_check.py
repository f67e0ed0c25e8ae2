"""The parts of bench/gpu_check.sh, one subcommand each; each writes one JSON file of numbers into the work folder.

  model WORK DEVICE        a random-init Qwen2 model (Qwen2.5-0.5B's shape on cuda; the tiny toy shape on cpu)
  zero3 WORK DEVICE        (under torch.distributed.run) DeepSpeed ZeRO-3 fwd/bwd/step: step time, tokens/s, MFU
  generate WORK DEVICE     HF-engine generation tokens/s, and engine vs trainer log-probs of the sampled tokens
  toy WORK DEVICE RUN      the GRPO toy run's s/step, weight push (bytes, seconds, transport) vs a device copy
  merge WORK RESULTS_DIR   every part's JSON into RESULTS_DIR/gpu_check.json (or gpu_check_dry.json)
The shell script runs them with timeouts; --dry (cpu) runs every part small, so that a lent call does not fail on
a typo.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

# bf16 dense peak per GPU (TFLOP/s), for MFU; PEAK_TFLOPS overrides.
PEAKS = {"H200": 989, "H100": 989, "A100": 312, "L40S": 362, "A10": 125, "V100": 125, "L4": 121}


def dump(work: Path, part: str, data: dict) -> None:
    (work / f"{part}.json").write_text(json.dumps(data, indent=2))
    print(f"{part}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in data.items()))


def model(work: Path, device: str) -> None:
    from hpc_rl.config import TinyModelConfig
    from hpc_rl.models.tiny import build_tiny_model

    if device == "cuda":
        cfg = TinyModelConfig(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                              intermediate_size=4864, max_position_embeddings=2048)
    else:
        cfg = TinyModelConfig()
    corpus = [f"{i} + {i + 1} = {2 * i + 1}" for i in range(200)]
    path = build_tiny_model(cfg, corpus, work / "model")
    dump(work, "model", {"path": str(path), "hidden_size": cfg.hidden_size, "layers": cfg.num_layers})


def zero3(work: Path, device: str) -> None:
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    gpu = device == "cuda"
    deepspeed.init_distributed(dist_backend="nccl" if gpu else "gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    B, S, steps = (8, 1024, 8) if gpu else (2, 32, 3)
    ds = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "bf16": {"enabled": gpu}, "zero_optimization": {"stage": 3}}
    keep = HfDeepSpeedConfig(ds)  # noqa: F841 - ZeRO-3 init of from_pretrained while it lives
    m = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.bfloat16 if gpu else torch.float32,
                                             attn_implementation="sdpa")
    m.config.use_cache = False
    n_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in m.parameters())
    eng, *_ = deepspeed.initialize(model=m, optimizer=torch.optim.AdamW(m.parameters(), lr=1e-5), config=ds)
    ids = torch.randint(3, m.config.vocab_size, (B, S), device=eng.device)
    times = []
    for _ in range(steps):
        if gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = eng(input_ids=ids, labels=ids).loss
        eng.backward(loss)
        eng.step()
        if gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step = statistics.median(times[1:])
    L, H = m.config.num_hidden_layers, m.config.hidden_size
    flops = (6 * n_params + 12 * L * H * S) * B * S * world  # dense matmuls + attention scores, all ranks
    name = torch.cuda.get_device_name(0) if gpu else "cpu"
    peak = float(os.environ.get("PEAK_TFLOPS") or next((v for k, v in PEAKS.items() if k in name), 0))
    if rank == 0:
        dump(work, "zero3", {"gpu": name, "ranks": world, "params": n_params, "batch": f"{B}x{S}", "step_s": step,
                             "tokens_per_s": B * S * world / step, "peak_tflops_per_gpu": peak,
                             "mfu": flops / step / (peak * 1e12 * world) if peak else None,
                             "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None})
    torch.distributed.destroy_process_group()


def generate(work: Path, device: str) -> None:
    """Generation speed, then the mismatch the off-policy correction exists for: the engine's log-probs of its
    sampled tokens against the trainer's computation of them (a full-sequence forward in the training dtype,
    log-softmax in fp32: train/experience.token_logprobs), on the same weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from hpc_rl.config import load_dict
    from hpc_rl.rollout.server.engine_hf import HFEngine
    from hpc_rl.rollout.wire.sampling import SamplingParams
    from hpc_rl.train.experience import token_logprobs

    gpu = device == "cuda"
    dtype = "bfloat16" if gpu else "float32"
    cfg = load_dict({"model": {"path": str(work / "model")}, "rollout": {"engine": "hf", "dtype": dtype}})
    eng = HFEngine(cfg, device)
    vocab = json.loads((work / "model" / "config.json").read_text())["vocab_size"]
    prompts, new = (64, 128) if gpu else (8, 16)
    g = torch.Generator().manual_seed(0)
    ps = [torch.randint(3, vocab, (64 if gpu else 8,), generator=g).tolist() for _ in range(prompts)]
    sp = SamplingParams(n=1, max_new_tokens=new, seed=0)
    eng.generate(ps[:4], sp)  # warm-up
    t0 = time.perf_counter()
    outs = [o[0] for o in eng.generate(ps, sp)]
    dt = time.perf_counter() - t0
    toks = sum(len(s.token_ids) for s in outs)
    del eng
    trainer = AutoModelForCausalLM.from_pretrained(work / "model", dtype=getattr(torch, dtype)).to(device).eval()
    diffs = []
    with torch.no_grad():
        for p, s in zip(ps, outs):
            if not s.token_ids:
                continue
            ids = torch.tensor([p + s.token_ids], device=device)
            logits = trainer(input_ids=ids).logits[:, len(p) - 1:-1]
            lp, _ = token_logprobs(logits, ids[:, len(p):])
            diffs += (lp[0].cpu() - torch.tensor(s.logprobs)).abs().tolist()
    dump(work, "generate", {"engine_dtype": dtype, "prompts": prompts, "max_new_tokens": new, "tokens": toks,
                            "tokens_per_s": toks / dt, "logprob_tokens": len(diffs),
                            "logprob_abs_diff_mean": statistics.fmean(diffs), "logprob_abs_diff_max": max(diffs)})


def toy(work: Path, device: str, run_root: str) -> None:
    """The toy run's steady s/step and its weight push, against a device-to-device copy of the same bytes (the
    floor of moving them; a push also stages, serializes and loads them)."""
    import torch

    runs = sorted(Path(run_root).glob("*/metrics.jsonl"))
    if not runs:
        raise SystemExit(f"toy: no metrics.jsonl under {run_root}; see the run's log above")
    rows = [json.loads(line) for line in runs[-1].read_text().splitlines() if line.strip()]
    steady = rows[1:] or rows
    nbytes = int(statistics.median(r.get("sync_bytes") or 0 for r in steady))
    push_s = statistics.median(r["push_seconds"] for r in steady if r.get("push_seconds") is not None)
    transport = next((line.split("weight sync: ", 1)[1].strip() for log in Path(run_root).glob("*/logs/trainer-0.log")
                      for line in log.read_text(errors="replace").splitlines() if "weight sync: " in line), None)
    copy_s = None
    if nbytes and device == "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            dst.copy_(src)
        torch.cuda.synchronize()
        copy_s = (time.perf_counter() - t0) / 10
    dump(work, "toy", {"steps": len(rows), "s_per_step": statistics.median(r["step_seconds"] for r in steady),
                       "reward_first": rows[0].get("reward_mean"), "reward_last": rows[-1].get("reward_mean"),
                       "push_bytes": nbytes, "push_s": push_s, "push_transport": transport,
                       "device_copy_s": copy_s, "push_vs_copy": push_s / copy_s if copy_s else None})


def merge(work: Path, results: Path, dry: bool) -> None:
    from _common import machine

    out = {"dry": dry, "machine": machine()}
    for part in ("zero3", "generate", "toy"):
        f = work / f"{part}.json"
        out[part] = json.loads(f.read_text()) if f.exists() else {"error": "did not finish, or not run yet (see the output)"}
    out["vllm"] = "not measured: vLLM's wheel is far over what a lent call carries; generation used the HF engine"
    results.mkdir(parents=True, exist_ok=True)
    path = results / ("gpu_check_dry.json" if dry else "gpu_check.json")
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


def main() -> None:
    cmd, work = sys.argv[1], Path(sys.argv[2])
    if cmd == "merge":
        merge(work, Path(sys.argv[3]), sys.argv[4] == "1")
    elif cmd == "toy":
        toy(work, sys.argv[3], sys.argv[4])
    else:
        {"model": model, "zero3": zero3, "generate": generate}[cmd](work, sys.argv[3])


if __name__ == "__main__":
    main()
