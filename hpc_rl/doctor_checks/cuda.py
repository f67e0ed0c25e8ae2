"""CUDA checks: driver vs torch's CUDA, the libcudart/libcudnn the process loads, cuDNN, NCCL, visible GPUs."""

from __future__ import annotations

import os
import sys

from .base import FAIL, OK, WARN, Ctx, Result, check
from .probes import find_on_ld_path, lib_version, run_cmd

CPU_OK = "no GPU: CPU stack"
ACTIVATE_FIX = "source envs/activate.sh (it puts the env's libraries first), or drop that folder from LD_LIBRARY_PATH"


def _mm(v: str | None) -> tuple | None:
    """'12.4.127' -> (12, 4)."""
    if not v:
        return None
    parts = [int(p) for p in v.split(".")[:2] if p.isdigit()]
    return tuple(parts) if parts else None


def cudnn_str(v: int | None) -> str | None:
    """torch.backends.cudnn.version() -> 'M.m.p' (cuDNN 9: 90100 -> 9.1.0; cuDNN 8: 8902 -> 8.9.2)."""
    if not v:
        return None
    if v >= 90000:
        return f"{v // 10000}.{(v % 10000) // 100}.{v % 100}"
    return f"{v // 1000}.{(v % 1000) // 100}.{v % 100}"


def _in_env(path: str) -> bool:
    return os.path.realpath(path).startswith(os.path.realpath(sys.prefix).rstrip("/") + "/")


def _probe_loaded_libs(self: Ctx) -> dict:
    """Paths of libcudart/libcudnn/libnccl mapped into this process (after torch's import), from /proc."""
    out = {}
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if line.count(" ") >= 5 else ""
                for stem in ("libcudart", "libcudnn", "libnccl"):
                    if os.path.basename(path).startswith(stem + ".so"):
                        out.setdefault(stem, path)
    except OSError:
        pass
    return out


Ctx._probe_loaded_libs = _probe_loaded_libs


@check("cuda:driver")
def check_driver(ctx: Ctx) -> Result:
    """The driver's CUDA (nvidia-smi) must be >= the CUDA torch was built for."""
    t, smi = ctx.torch, ctx.nvidia_smi
    if not t.get("cuda"):
        if smi and smi.get("gpus"):
            return Result("cuda:driver", WARN, f"{len(smi['gpus'])} GPU(s) here but torch {t.get('version')} is the CPU build",
                          "re-run ./install.sh --cuda X.Y (X.Y <= the driver's CUDA) to use them")
        return Result("cuda:driver", OK, CPU_OK)
    if not smi:
        return Result("cuda:driver", WARN, f"torch is a CUDA {t['cuda']} build but no NVIDIA driver answers "
                      "(nvidia-smi missing or failing): a login node?",
                      "run the doctor on a GPU node: srun --gres=gpu:1 hpc-rl doctor")
    if _mm(smi.get("cuda")) and _mm(smi["cuda"]) < _mm(t["cuda"]):
        return Result("cuda:driver", FAIL, f"driver {smi.get('driver')} supports CUDA {smi['cuda']} but torch "
                      f"{t['version']} needs CUDA {t['cuda']}",
                      f"re-run ./install.sh --cuda X.Y with X.Y <= {smi['cuda']}, or ask admins for a newer driver")
    return Result("cuda:driver", OK, f"driver {smi.get('driver')} (CUDA {smi.get('cuda')}) >= torch's CUDA {t['cuda']}")


def _lib_check(ctx: Ctx, name: str, stem: str, want: str | None, what: str) -> Result:
    """Which `stem` the process loads (mapped, else first on LD_LIBRARY_PATH) and whether it matches `want`."""
    ld = ctx.environ.get("LD_LIBRARY_PATH", "")
    path = ctx.loaded_libs.get(stem)
    source = "loaded"
    if path is None:
        hits = find_on_ld_path(stem, ld)
        path, source = (hits[0], "first on LD_LIBRARY_PATH") if hits else (None, "")
    if not ctx.torch.get("cuda"):
        if path:
            return Result(name, WARN, f"{path} ({source}) is unused by the CPU torch but a GPU job would load it",
                          "keep system CUDA folders off LD_LIBRARY_PATH; " + ACTIVATE_FIX)
        return Result(name, OK, CPU_OK)
    if path is None:
        return Result(name, OK, f"no {stem} on LD_LIBRARY_PATH: torch loads the env's own ({what} {want})")
    have = lib_version(path)
    if want and have and (_mm(have)[0] != _mm(want)[0] or _mm(have) < _mm(want)):
        return Result(name, FAIL, f"{path} ({source}) is {what} {have} but torch needs {what} {want}", ACTIVATE_FIX)
    if not _in_env(path):
        return Result(name, WARN, f"{path} ({source}, {what} {have or '?'}) comes from outside the env {sys.prefix}",
                      ACTIVATE_FIX)
    return Result(name, OK, f"{path} ({source}, {what} {have or '?'})")


@check("cuda:libcudart")
def check_libcudart(ctx: Ctx) -> Result:
    return _lib_check(ctx, "cuda:libcudart", "libcudart", ctx.torch.get("cuda"), "CUDA runtime")


@check("cuda:libcudnn")
def check_libcudnn(ctx: Ctx) -> Result:
    return _lib_check(ctx, "cuda:libcudnn", "libcudnn", cudnn_str(ctx.torch.get("cudnn")), "cuDNN")


SYSTEM_CUDA_HINTS = ("/usr/local/cuda", "/opt/cuda", "/usr/lib/cuda", "/cuda-", "/cuda/")


@check("cuda:ld-path")
def check_ld_path(ctx: Ctx) -> Result:
    """A system CUDA folder on LD_LIBRARY_PATH before the env's own libraries."""
    dirs = [d for d in ctx.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    stray = next((d for d in dirs if not _in_env(d + "/x") and
                  (any(h in d + "/" for h in SYSTEM_CUDA_HINTS) or find_on_ld_path("libcudart", d))), None)
    if stray is None:
        return Result("cuda:ld-path", OK, "no system CUDA on LD_LIBRARY_PATH" if dirs else "LD_LIBRARY_PATH is empty")
    env_first = any(_in_env(d + "/x") for d in dirs[:dirs.index(stray)])
    if env_first:
        return Result("cuda:ld-path", OK, f"system CUDA {stray} comes after the env's libraries")
    status = WARN
    return Result("cuda:ld-path", status, f"LD_LIBRARY_PATH puts a system CUDA ({stray}) before the env's libraries"
                  + (" (unused by the CPU torch)" if not ctx.torch.get("cuda") else ""), ACTIVATE_FIX)


@check("cuda:cudnn")
def check_cudnn(ctx: Ctx) -> Result:
    t = ctx.torch
    if not t.get("cuda"):
        return Result("cuda:cudnn", OK, CPU_OK)
    if not t.get("cudnn"):
        return Result("cuda:cudnn", FAIL, f"torch {t.get('version')} cannot load cuDNN "
                      "(torch.backends.cudnn.version() is None)",
                      "re-run ./install.sh so the nvidia-cudnn wheel matching torch is installed; " + ACTIVATE_FIX)
    if not t.get("cudnn_enabled"):
        return Result("cuda:cudnn", WARN, f"cuDNN {cudnn_str(t['cudnn'])} is disabled (torch.backends.cudnn.enabled=False)",
                      "remove the code or setting that disables cuDNN")
    return Result("cuda:cudnn", OK, f"cuDNN {cudnn_str(t['cudnn'])} enabled")


@check("cuda:visible-devices")
def check_visible_devices(ctx: Ctx) -> Result:
    """CUDA_VISIBLE_DEVICES must name GPUs that exist (indices or UUIDs from nvidia-smi)."""
    cvd = ctx.environ.get("CUDA_VISIBLE_DEVICES")
    smi = ctx.nvidia_smi
    gpus = (smi or {}).get("gpus") or []
    if cvd is None:
        return Result("cuda:visible-devices", OK, f"unset: all {len(gpus)} GPU(s) visible" if gpus else
                      f"unset; {CPU_OK}")
    tokens = [t.strip() for t in cvd.split(",") if t.strip()]
    if not tokens or tokens in (["-1"], ["NoDevFiles"]):
        if gpus:
            return Result("cuda:visible-devices", WARN, f"CUDA_VISIBLE_DEVICES={cvd!r} hides all {len(gpus)} GPU(s)",
                          "unset CUDA_VISIBLE_DEVICES (Slurm sets it from --gres/--gpus-per-node)")
        return Result("cuda:visible-devices", OK, f"CUDA_VISIBLE_DEVICES={cvd!r}; {CPU_OK}")
    if not gpus:
        status = WARN if not ctx.torch.get("cuda") else FAIL
        return Result("cuda:visible-devices", status, f"CUDA_VISIBLE_DEVICES={cvd} but no GPU is visible (nvidia-smi)",
                      "request GPUs from Slurm (--gres=gpu:N) or unset CUDA_VISIBLE_DEVICES on CPU machines")
    uuids = [g["uuid"] for g in gpus]
    bad = []
    for t in tokens:
        if t.isdigit():
            if int(t) >= len(gpus):
                bad.append(t)
        elif t.startswith("GPU-"):
            if not any(u.startswith(t) for u in uuids):
                bad.append(t)
        elif not t.startswith("MIG-"):
            bad.append(t)
    if bad or len(set(tokens)) != len(tokens):
        what = f"names GPUs that do not exist: {', '.join(bad)}" if bad else "repeats a GPU"
        return Result("cuda:visible-devices", FAIL, f"CUDA_VISIBLE_DEVICES={cvd} {what} ({len(gpus)} GPU(s): "
                      f"indices 0-{len(gpus) - 1})", "set CUDA_VISIBLE_DEVICES to existing indices or UUIDs "
                      "(nvidia-smi -L), or leave it to Slurm")
    n = ctx.torch.get("device_count")
    if ctx.torch.get("cuda_available") and n != len(tokens):
        return Result("cuda:visible-devices", WARN, f"CUDA_VISIBLE_DEVICES names {len(tokens)} GPU(s) but torch sees {n}",
                      "check that the process inherited CUDA_VISIBLE_DEVICES before CUDA initialized")
    return Result("cuda:visible-devices", OK, f"CUDA_VISIBLE_DEVICES={cvd}: {len(tokens)} of {len(gpus)} GPU(s)")


@check("cuda:nccl")
def check_nccl(ctx: Ctx) -> Result:
    t = ctx.torch
    if not t.get("cuda"):
        return Result("cuda:nccl", OK, f"{CPU_OK} (torch.distributed uses gloo)")
    if not t.get("nccl"):
        return Result("cuda:nccl", FAIL, f"torch {t.get('version')} reports no NCCL",
                      "re-run ./install.sh so the nvidia-nccl wheel matching torch is installed")
    hits = find_on_ld_path("libnccl", ctx.environ.get("LD_LIBRARY_PATH", ""))
    if hits and not _in_env(hits[0]):
        have = lib_version(hits[0])
        if have and _mm(have) != _mm(t["nccl"]):
            return Result("cuda:nccl", WARN, f"NCCL {t['nccl']} in torch, but {hits[0]} (NCCL {have}) is first on "
                          "LD_LIBRARY_PATH and may be loaded instead", ACTIVATE_FIX)
    return Result("cuda:nccl", OK, f"NCCL {t['nccl']}")


@check("cuda:home")
def check_cuda_home(ctx: Ctx) -> Result:
    """DeepSpeed builds its ops at first use (JIT): on GPU it needs an nvcc of torch's CUDA under CUDA_HOME."""
    t = ctx.torch
    if not t.get("cuda"):
        return Result("cuda:home", OK, f"{CPU_OK} (DeepSpeed's CPU ops build with the host compiler)")
    home = ctx.environ.get("CUDA_HOME") or ctx.environ.get("CUDA_PATH")
    if not home:
        return Result("cuda:home", WARN, "CUDA_HOME is unset: DeepSpeed cannot JIT-build CUDA ops (fused Adam, ...)",
                      "use a conda env (./install.sh --env conda) whose hook sets CUDA_HOME, or export CUDA_HOME "
                      f"to a CUDA {t['cuda']} toolkit")
    nvcc = os.path.join(home, "bin", "nvcc")
    q = run_cmd([nvcc, "--version"], 15) if os.path.exists(nvcc) else None
    if q is None:
        return Result("cuda:home", WARN, f"CUDA_HOME={home} has no bin/nvcc", f"point CUDA_HOME at a CUDA {t['cuda']} toolkit")
    import re
    m = re.search(r"release ([0-9]+\.[0-9]+)", q.stdout)
    if m and _mm(m.group(1)) != _mm(t["cuda"]):
        return Result("cuda:home", WARN, f"CUDA_HOME={home} has nvcc {m.group(1)} but torch is built for CUDA {t['cuda']}",
                      f"point CUDA_HOME at a CUDA {t['cuda']} toolkit (the conda env's hook does)")
    return Result("cuda:home", OK, f"CUDA_HOME={home} (nvcc {m.group(1) if m else '?'})")
