"""Checks a device kit (bench/device_kit.sh): one version of each package, every requirement of every wheel held by
the kit or by the lent machine's image, nothing that pins torch, and the total size under the limit. Prints the
kit's wheels and size; exits 1 with one line per problem.

  python bench/_device_kit_check.py KIT_DIR PYTHON_VERSION LIMIT_MIB
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

# The device image's Python packages (the device tool's KINDS.md, "Python packages already there", read 2026-11-17).
DEVICE_IMAGE = set(map(canonicalize_name, """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning
lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson
ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp
""".split()))


def requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [Requirement(m.group(1).strip()) for m in re.finditer(r"^Requires-Dist: (.+)$", text, re.M)]


def check(kit: Path, python_version: str, limit_mib: float) -> list[str]:
    wheels = sorted(kit.glob("*.whl"))
    if not wheels:
        return [f"{kit}: no wheel"]
    problems = []
    names: dict[str, str] = {}
    for w in wheels:
        name, version, *_ = parse_wheel_filename(w.name)
        if name in names:
            problems.append(f"{name}: two versions ({names[name]} and {version}); keep one")
        names[name] = str(version)
    env = {"python_version": python_version, "python_full_version": python_version + ".0", "extra": "",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "os_name": "posix"}
    for w in wheels:
        for req in requirements(w):
            if req.marker is not None and not req.marker.evaluate(env):
                continue  # an extra's, or another platform's
            name = canonicalize_name(req.name)
            if name == "torch" and any(s.operator in ("==", "===", "<", "<=", "~=") for s in req.specifier):
                problems.append(f"{w.name}: requires {req}; the device's torch is another version")
            if name in names:
                if not req.specifier.contains(names[name], prereleases=True):
                    problems.append(f"{w.name}: requires {req}, the kit holds {name} {names[name]}")
            elif name not in DEVICE_IMAGE:
                problems.append(f"{w.name}: requires {req}, which neither the kit nor the device image holds; "
                                "add it to bench/device_kit.sh's PINS")
    size = sum(w.stat().st_size for w in wheels) / 2**20
    for w in wheels:
        print(f"  {w.name} ({w.stat().st_size / 2**20:.1f} MiB)")
    print(f"device_kit: {len(wheels)} wheels, {size:.1f} MiB in {kit} (limit {limit_mib:g} MiB)")
    if size > limit_mib:
        problems.append(f"{kit}: {size:.1f} MiB, over {limit_mib:g} MiB")
    return problems


def main() -> int:
    kit, python_version, limit = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    problems = check(kit, python_version, limit)
    for p in problems:
        print(f"device_kit: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
