#!/usr/bin/env bash
# The GPU check: what only a GPU shows, in one call of under 8 minutes on a lent machine that reaches nothing outside
# (nothing downloaded: the models are random-init, built offline). Never required; nothing depends on it.
#
#   bash bench/device_kit.sh         # here, once: the wheels the machine lacks, into .device-kit/ (carried)
#   bash bench/gpu_check.sh          # there, with the machine's python3 (or .venv/bin/python where it exists)
#   bash bench/gpu_check.sh --dry    # here: every part on the CPU, small (the suite runs it)
#
# Parts, each with its own timeout within the check's budget (GPU_CHECK_BUDGET_S, default 450 s; a part that fails
# or runs out of time is recorded as such, the others still run, and the results file is rewritten after each):
#   doctor    hpc-rl doctor's checks (GPU, CUDA, NCCL, versions)
#   zero3     a DeepSpeed ZeRO-3 bf16 fwd/bwd/step of Qwen2.5-0.5B's shape (random init): step time, tokens/s, MFU
#   generate  HF-engine generation tokens/s (bf16), and engine vs trainer log-probs of 8k sampled tokens (mean and
#             max |d log p|: the mismatch the off-policy correction exists for)
#   toy       the GRPO toy job, 10 steps, through `hpc-rl run` (one trainer rank and one HF server on the GPU): s/step
#             and the weight push (bytes, seconds, transport) against a device-to-device copy of the same bytes
# vLLM is not measured: its wheel is far over what a call carries. Results: $OUT/gpu_check.json when $OUT is set
# (the device tool brings that folder back), else bench/results/gpu_check.json (--dry: gpu_check_dry.json).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
DRY=0
case "${1:-}" in
  --dry) DRY=1 ;;
  "") ;;
  *) echo "gpu_check.sh: unknown argument $1 (use --dry, or nothing)"; exit 2 ;;
esac
RESULTS=${OUT:-$REPO/bench/results}
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=$REPO/.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
if ! "$PY" -c 'import deepspeed, fastapi, submitit, uvicorn' 2>/dev/null; then
  if [ ! -d .device-kit ]; then
    echo "gpu_check: DeepSpeed, FastAPI, submitit or uvicorn is missing and there is no .device-kit/: build it with" \
         "'bash bench/device_kit.sh' and carry it (carry: [\".device-kit\"])"
    exit 2
  fi
  SITE=$(mktemp -d /tmp/hpc-rl-site-XXXX)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .device-kit/*.whl || exit 2
  export PYTHONPATH=$SITE:$PYTHONPATH
  echo "gpu_check: installed the carried kit into $SITE"
fi
if [ "$DRY" = 1 ]; then
  DEVICE=cpu
else
  NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
  if [ "$NGPU" -lt 1 ]; then
    echo "gpu_check: no CUDA GPU visible (torch.cuda.device_count() == 0); run it on a GPU node, or --dry here"
    exit 2
  fi
  DEVICE=cuda
fi
WORK=$(mktemp -d /tmp/gpu-check-XXXX)
trap 'rm -rf "$WORK"' EXIT
PART="$PY $REPO/bench/_gpu_check.py"
DEADLINE=$((SECONDS + ${GPU_CHECK_BUDGET_S:-450}))
# A part's timeout: its own cap, or what is left of the budget (15 s kept for the results file).
cap() { local left=$((DEADLINE - SECONDS - 15)); if [ "$left" -lt "$1" ]; then echo $((left > 1 ? left : 1)); else echo "$1"; fi; }
merge() { $PART merge "$WORK" "$RESULTS" $DRY > /dev/null; }
"$PY" -c 'import sys, torch; print(f"gpu_check: Python {sys.version.split()[0]}, torch {torch.__version__}")'

echo "== doctor"
timeout "$(cap 60)" "$PY" -m hpc_rl.cli doctor || echo "(doctor reported problems: see above)"

echo "== model"
timeout "$(cap 90)" $PART model "$WORK" $DEVICE || { echo "gpu_check: the model could not be built"; merge; exit 1; }

echo "== zero3"
timeout "$(cap 150)" "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 "$REPO/bench/_gpu_check.py" zero3 \
  "$WORK" $DEVICE || echo "(zero3 failed or ran out of time: see above)"
merge

echo "== generate"
timeout "$(cap 100)" $PART generate "$WORK" $DEVICE || echo "(generate failed or ran out of time: see above)"
merge

echo "== toy"
STEPS=10
[ "$DRY" = 1 ] && STEPS=2
timeout "$(cap 150)" "$PY" -m hpc_rl.cli run "$REPO/jobs/toy-grpo-cpu.yaml" "trainer.steps=$STEPS" \
  trainer.procs_per_node=1 "trainer.device=$DEVICE" checkpoint.every=0 "output_dir=$WORK/runs" && \
  timeout "$(cap 30)" $PART toy "$WORK" $DEVICE "$WORK/runs" || echo "(toy failed or ran out of time: see above)"

$PART merge "$WORK" "$RESULTS" $DRY
