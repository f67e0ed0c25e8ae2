"""Probes of the real machine for the doctor: cheap, lazy, each with a timeout."""

from __future__ import annotations

import ast
import importlib.util
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger("hpc_rl")


def run_cmd(argv: list[str], timeout: float = 10.0) -> subprocess.CompletedProcess | None:
    """Run a probe command with a timeout; None when it is missing or timed out (never hangs)."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (subprocess.TimeoutExpired, OSError):
        log.debug("doctor: %s did not answer within %.0f s", argv[0], timeout)
        return None




def read_torch_version_file() -> dict | None:
    """{version, cuda} from torch/version.py without importing torch (an import costs seconds)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    vfile = Path(list(spec.submodule_search_locations)[0]) / "version.py"
    out = {"version": None, "cuda": None, "path": str(vfile.parent)}
    try:
        tree = ast.parse(vfile.read_text())
    except (OSError, SyntaxError):
        return out
    for node in tree.body:
        target = None
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            target = node.targets[0].id
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            target = node.target.id
        if target in ("__version__", "cuda") and node.value is not None:
            try:
                out["version" if target == "__version__" else "cuda"] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return out


def torch_facts() -> dict:
    """torch's version, CUDA, cuDNN and NCCL; imports torch only for CUDA builds (cuDNN/NCCL need it)."""
    facts = read_torch_version_file()
    if facts is None:
        return {"installed": False, "version": None, "cuda": None, "cudnn": None, "cudnn_enabled": None,
                "nccl": None, "cuda_available": False, "device_count": 0}
    facts.update(installed=True, cudnn=None, cudnn_enabled=None, nccl=None, cuda_available=False,
                 device_count=0)
    if facts["cuda"]:
        import torch

        facts["cudnn"] = torch.backends.cudnn.version()
        facts["cudnn_enabled"] = bool(torch.backends.cudnn.enabled)
        try:
            v = torch.cuda.nccl.version()
            facts["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # NCCL missing from this build: reported by the nccl check
            facts["nccl"] = None
        facts["cuda_available"] = torch.cuda.is_available()
        facts["device_count"] = torch.cuda.device_count() if facts["cuda_available"] else 0
    return facts


def nvidia_smi_facts() -> dict | None:
    """Driver version, the CUDA version it supports and the GPUs (with their memory), from nvidia-smi (None
    without one)."""
    q = run_cmd(["nvidia-smi", "--query-gpu=index,uuid,name,driver_version,memory.total",
                 "--format=csv,noheader,nounits"], 15)
    if q is None or q.returncode != 0:
        return None
    gpus, driver = [], None
    for line in q.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 4:
            gpus.append({"index": parts[0], "uuid": parts[1], "name": parts[2]})
            driver = parts[3]
            if len(parts) >= 5 and parts[4].isdigit():
                gpus[-1]["memory_mib"] = int(parts[4])
    cuda = None
    head = run_cmd(["nvidia-smi"], 15)
    if head is not None:
        m = re.search(r"CUDA Version:\s*([0-9]+\.[0-9]+)", head.stdout)
        cuda = m.group(1) if m else None
    return {"driver": driver, "cuda": cuda, "gpus": gpus}


_SONAME_VER = re.compile(r"\.so\.([0-9]+(?:\.[0-9]+)*)$")


def lib_version(path: str) -> str | None:
    """'libcudart.so.12.4.127' -> '12.4.127'; follows symlinks (libcudart.so.12 -> the real file)."""
    real = os.path.realpath(path)
    for p in (real, path):
        m = _SONAME_VER.search(os.path.basename(p))
        if m:
            return m.group(1)
    return None


def find_on_ld_path(stem: str, ld_path: str) -> list[str]:
    """Every `stem.so*` in the LD_LIBRARY_PATH folders, in the order the loader searches them."""
    found = []
    for d in [d for d in ld_path.split(":") if d]:
        try:
            names = sorted(os.listdir(d))
        except OSError:
            continue
        for n in names:
            if n == f"{stem}.so" or n.startswith(f"{stem}.so."):
                found.append(os.path.join(d, n))
                break
    return found
