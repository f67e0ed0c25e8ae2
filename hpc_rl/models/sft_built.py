"""Models a job names by the SFT job that makes them: `sft:JOB.yaml` or `sft:JOB.yaml@STEPS` as model.path or
services.teacher.path. The SFT job runs (to STEPS, else its trainer.steps) in a run dir of its own and its last
checkpoint is exported; like the tiny toys' models the result is built once per cache (HPC_RL_CACHE) and copied into
the run dir. The toy distillation job builds its teacher and its student this way, nothing by hand.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ..config.paths import SFT_PREFIX as PREFIX
from ..errors import ConfigError, HpcRlError

log = logging.getLogger("hpc_rl")

# The sources whose change makes a cached build stale: the SFT path from data to export.
_PKG = Path(__file__).resolve().parents[1]
SOURCES = [_PKG / "sft_loop.py", _PKG / "data" / "sft.py", _PKG / "train" / "sft_update.py",
           _PKG / "train" / "engines.py", _PKG / "train" / "experience.py", _PKG / "models" / "sft_built.py"]


def is_sft_spec(path: str | None) -> bool:
    return isinstance(path, str) and path.startswith(PREFIX)


def parse(spec: str, key: str) -> tuple[Path, int | None]:
    """(the SFT job file, the steps to run or None for its own)."""
    body = spec[len(PREFIX):]
    job, _, steps = body.rpartition("@") if "@" in body else (body, "", "")
    if steps and not steps.isdigit() or steps == "0":
        raise ConfigError(f"{key}: {spec!r}: write sft:JOB.yaml or sft:JOB.yaml@STEPS (STEPS >= 1)")
    path = Path(job)
    if not path.is_file():
        raise ConfigError(f"{key}: {spec!r}: the SFT job {job} does not exist (a relative path is read "
                          "from the directory of the job file that names it, then from the hpc-rl checkout)")
    return path.resolve(), int(steps) if steps else None


def built_sft_model(spec: str, out_dir: Path, key: str) -> Path:
    """The model `spec` names, built (or taken from the cache) into `out_dir`."""
    from .. import config
    from .tiny import build_cached

    job, steps = parse(spec, key)
    overrides = [f"trainer.steps={steps}"] if steps else []
    try:
        cfg = config.load(job, overrides)
    except ConfigError as e:
        raise ConfigError(f"{key}: {spec!r}: {e}") from None
    if not cfg.algorithm.supervised:
        raise ConfigError(f"{key}: {spec!r} names {job.name}, which is not an SFT job (algorithm.name: "
                          f"{cfg.algorithm.name}); name an SFT job or an HF folder")
    n = cfg.trainer.steps
    fields = config.to_dict(cfg)
    fields.pop("output_dir", None)

    def build(out: Path) -> Path:
        log.info("%s: building %s (%d SFT steps of %s; once per cache, HPC_RL_CACHE)", key, spec, n, job.name)
        with tempfile.TemporaryDirectory(prefix="hpc-rl-sft-") as tmp:
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            run = _cli(["run", str(job), *overrides, f"output_dir={tmp}", f"checkpoint.every={n}"], env, spec, key)
            runs = [d for d in Path(tmp).iterdir() if d.is_dir()]
            if len(runs) != 1:
                raise HpcRlError(f"{key}: building {spec!r} left no run dir: {run[-500:]}")
            _cli(["export", str(runs[0]), str(Path(tmp) / "export")], env, spec, key)
            out.mkdir(parents=True, exist_ok=True)
            for f in (Path(tmp) / "export").iterdir():
                os.replace(f, out / f.name)
        return out

    return build_cached("sft", {"job": fields, "sources": [p.read_bytes().hex() for p in SOURCES]}, out_dir, build)


def _cli(args: list[str], env: dict, spec: str, key: str) -> str:
    p = subprocess.run([sys.executable, "-m", "hpc_rl.cli", *args], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        last = [ln for ln in (p.stderr + p.stdout).splitlines() if ln.strip()][-1:] or ["(no output)"]
        raise HpcRlError(f"{key}: building {spec!r} failed at `hpc-rl {args[0]}`: {last[0]}")
    return p.stdout + p.stderr
