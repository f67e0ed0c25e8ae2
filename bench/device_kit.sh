#!/usr/bin/env bash
# The wheels a lent GPU machine needs for bench/gpu_check.sh and its image lacks, built or downloaded here into an
# ignored folder that travels with the working tree (`carry: [".device-kit"]`; 64 MiB per call in all).
#
# The device image (the device tool's KINDS.md) has Python 3.12, torch 2.11 (CUDA 13), transformers, accelerate, PEFT,
# tokenizers, safetensors, numpy, jinja2, PyYAML, requests, rich, httpx, anyio, click, h11, ninja, psutil, msgpack,
# py-cpuinfo, einops, nvidia-ml-py and cloudpickle, and no hpc-rl, DeepSpeed, submitit, FastAPI, uvicorn or pydantic.
# The kit holds those, at the versions this repo is tested with, each without its dependencies (--no-deps): the
# check at the end names any requirement that neither the kit nor the image holds. vLLM is not in it: its wheel is
# far over the carry limit, so the GPU check generates with the HF engine.
#
#   bash bench/device_kit.sh                        # for the device: CPython 3.12, manylinux x86_64 -> .device-kit/
#   bash bench/device_kit.sh --python 3.11 --out D  # for another CPython (the suite installs and imports it this way)
# There: python3 -m pip install --no-index --no-deps --target /tmp/site .device-kit/*.whl (gpu_check.sh does it).
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=3.12
KIT=.device-kit
LIMIT_MIB=32  # of the call's 64 MiB: the rest is the working tree (~3 MiB) and room
while [ $# -gt 0 ]; do
  case "$1" in
    --python) PYVER=$2; shift 2 ;;
    --out) KIT=$2; shift 2 ;;
    *) echo "device_kit.sh: unknown argument $1 (use --python X.Y, --out DIR)"; exit 2 ;;
  esac
done
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
# Pure-Python wheels and DeepSpeed's sdist build the same for any CPython 3; the binary ones (pydantic-core) are
# downloaded for $PYVER.
PINS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
      annotated-doc==0.0.7 fastapi==0.136.3 starlette==1.10.0 uvicorn==0.55.0 submitit==1.5.4 hjson==3.1.0)
DEEPSPEED=deepspeed==0.19.8
rm -rf "$KIT"
mkdir -p "$KIT"
quiet() { grep -v "^WARNING: Location" || true; }  # the machine's offline indexes warn for packages they lack

echo "device_kit: hpc-rl (this checkout)"
"$PY" -m pip wheel -q --no-deps --no-build-isolation --no-cache-dir -w "$KIT" . 2>&1 | quiet
echo "device_kit: $DEEPSPEED built from its sdist for the CUDA accelerator (no op compiled ahead: they build JIT there)"
DS_ACCELERATOR=cuda DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation --no-cache-dir \
  --no-binary deepspeed -w "$KIT" "$DEEPSPEED" 2>&1 | quiet
echo "device_kit: ${#PINS[@]} wheels for CPython $PYVER"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$KIT" "${PINS[@]}" 2>&1 | quiet
"$PY" bench/_device_kit_check.py "$KIT" "$PYVER" "$LIMIT_MIB"
