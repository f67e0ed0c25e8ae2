#!/usr/bin/env bash
# GPU check (prepared, never required; run only where a GPU is lent). Under 8 minutes, nothing downloaded:
# a random-init Qwen2 model of Qwen2.5-0.5B's shape (tiny vocabulary) is built offline.
# Prints: hpc-rl doctor's checks, DeepSpeed ZeRO-3 step time and MFU (bf16, all visible GPUs), and HF-engine
# generation tokens/s. Writes bench/results/gpu_check.json.
#   bash bench/gpu_check.sh            # PEAK_TFLOPS=989 overrides the per-GPU bf16 dense peak used for MFU
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python
WORK=$(mktemp -d /tmp/gpu-check-XXXX)
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
if [ "$NGPU" -lt 1 ]; then echo "gpu_check: no CUDA GPU visible (torch.cuda.device_count() == 0); run it on a GPU node"; exit 2; fi
echo "== doctor"
timeout 120 "$PY" -m hpc_rl.cli doctor || echo "(doctor reported problems: see above)"

echo "== build a 0.5B-shaped random-init model"
"$PY" - "$WORK" <<'EOF'
import sys
sys.path.insert(0, ".")
from hpc_rl.config import TinyModelConfig
from hpc_rl.models.tiny import build_tiny_model
cfg = TinyModelConfig(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                      intermediate_size=4864, max_position_embeddings=2048)
corpus = [f"{i} + {i + 1} = {2 * i + 1}" for i in range(200)]
print(build_tiny_model(cfg, corpus, sys.argv[1] + "/model"))
EOF

cat > "$WORK/zero3.py" <<'EOF'
"""ZeRO-3 bf16 fwd/bwd/step of the model on every visible GPU (one rank per GPU); prints step time and MFU."""
import json, os, sys, time
import torch, deepspeed
from transformers import AutoModelForCausalLM
from transformers.integrations import HfDeepSpeedConfig
model_dir, out = sys.argv[1], sys.argv[2]
deepspeed.init_distributed(dist_backend="nccl")
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
B, S = 8, 1024
ds = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
      "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
keep = HfDeepSpeedConfig(ds)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
model.config.use_cache = False
n_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
eng, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
ids = torch.randint(3, model.config.vocab_size, (B, S), device="cuda")
times = []
for i in range(8):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    loss = eng(input_ids=ids, labels=ids).loss
    eng.backward(loss); eng.step()
    torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
step = sorted(times[2:])[len(times[2:]) // 2]
L, H = model.config.num_hidden_layers, model.config.hidden_size
flops = (6 * n_params + 12 * L * H * S) * B * S * world  # dense matmuls + attention scores, all ranks
name = torch.cuda.get_device_name(0)
peaks = {"H200": 989, "H100": 989, "A100": 312, "L40S": 362, "A10": 125, "V100": 125, "L4": 121}
peak = float(os.environ.get("PEAK_TFLOPS") or next((v for k, v in peaks.items() if k in name), 0))
mfu = flops / step / (peak * 1e12 * world) if peak else None
if rank == 0:
    r = {"gpu": name, "gpus": world, "params": n_params, "batch": [B, S], "step_s": step, "tokens_per_s": B * S * world / step,
         "peak_tflops_per_gpu": peak, "mfu": mfu, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}
    json.dump(r, open(out, "w"))
    print(f"ZeRO-3 bf16 step: {step:.3f} s for {world} x {B}x{S} tokens ({r['tokens_per_s']:.0f} tok/s), "
          f"{n_params / 1e6:.0f}M params, MFU " + (f"{100 * mfu:.1f}% of {peak:.0f} TFLOPS/GPU" if mfu else "n/a (set PEAK_TFLOPS)")
          + f", peak memory {r['peak_mem_gib']:.1f} GiB")
torch.distributed.destroy_process_group()
EOF
echo "== DeepSpeed ZeRO-3 step on $NGPU GPU(s)"
timeout 300 "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" "$WORK/zero3.py" "$WORK/model" "$WORK/zero3.json"

echo "== HF engine generation"
timeout 180 "$PY" - "$WORK" <<'EOF'
import json, sys, time
sys.path.insert(0, ".")
import torch
from hpc_rl.config import load_dict
from hpc_rl.rollout.wire.sampling import SamplingParams
from hpc_rl.rollout.server.engine_hf import HFEngine
work = sys.argv[1]
cfg = load_dict({"model": {"path": work + "/model"}, "rollout": {"engine": "hf", "dtype": "bfloat16"}})
eng = HFEngine(cfg, "cuda")
vocab = json.load(open(work + "/model/config.json"))["vocab_size"]
g = torch.Generator().manual_seed(0)
ps = [torch.randint(3, vocab, (64,), generator=g).tolist() for _ in range(64)]
sp = SamplingParams(n=1, max_new_tokens=128, seed=0)
eng.generate(ps[:8], sp)  # warm-up
t0 = time.perf_counter()
toks = sum(len(s.token_ids) for o in eng.generate(ps, sp) for s in o)
dt = time.perf_counter() - t0
print(f"HF engine: {toks} tokens in {dt:.2f} s = {toks / dt:.0f} generated tokens/s (64 prompts x 128 new, bf16)")
z = json.load(open(work + "/zero3.json"))
z["hf_gen_tokens_per_s"] = toks / dt
import pathlib
pathlib.Path("bench/results").mkdir(parents=True, exist_ok=True)
json.dump(z, open("bench/results/gpu_check.json", "w"), indent=2)
print("wrote bench/results/gpu_check.json")
EOF
rm -rf "$WORK"
