"""The checkpoints folder of a run, without torch: which checkpoints exist and are complete, which is the latest and
which the best, and how they are pruned or set aside. train/checkpoint.py writes and loads them (DeepSpeed).

RUN/checkpoints/step_N/{hf/, deepspeed/, trainer_state.json, pending_batches.json, manifest.json}, written under
`.step_N.tmp` and renamed; `latest` names the newest, `best` (a link) and best.json the best evaluation's. A
manifest of file sizes lets resume reject a checkpoint whose files were cut short (falling back to an older one).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from .rundir import RunDir, read_json, write_json_atomic, write_text_atomic

log = logging.getLogger("hpc_rl")

BEST_JSON = "best.json"
NOT_FINITE_SUFFIX = ".nonfinite"


def step_dir(run: RunDir, step: int) -> Path:
    return run.checkpoints / f"step_{step}"


def manifest(root: Path) -> dict:
    files = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != "manifest.json":
            files[str(p.relative_to(root))] = p.stat().st_size
    return {"files": files}


def verify(path: Path) -> bool:
    """True when every file the manifest lists exists with its recorded size."""
    mf = path / "manifest.json"
    try:
        files = json.loads(mf.read_text())["files"]
    except (OSError, ValueError, KeyError):
        return False
    for rel, size in files.items():
        p = path / rel
        try:
            if p.stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def list_checkpoints(run: RunDir) -> list[Path]:
    return sorted((p for p in run.checkpoints.glob("step_*") if p.is_dir() and p.name[5:].isdigit()),
                  key=lambda p: int(p.name[5:]))


def find_latest(run: RunDir) -> Path | None:
    """The newest complete checkpoint (manifest verifies); an incomplete one falls back to the one before.

    Newest rather than `latest`: a kill between the rename of step_N and the pointer update leaves a
    complete step_N that `latest` does not name yet; the rename is the commit point.
    """
    candidates = list_checkpoints(run)[::-1]
    for c in candidates:
        if verify(c):
            return c
        log.warning("checkpoint %s is incomplete (files missing or cut short); skipping it", c)
    return None


def latest_name(run: RunDir) -> str:
    """The newest complete checkpoint's name, or "none" (for the line a failed run ends with)."""
    latest = find_latest(run)
    return latest.name if latest is not None else "none"


def prune(run: RunDir, keep_last: int, latest: Path) -> None:
    steps = list_checkpoints(run)
    best = best_checkpoint(run)
    for p in steps[:-keep_last]:
        if p != latest and p != best:
            shutil.rmtree(p, ignore_errors=True)


def best_record(run: RunDir) -> dict | None:
    """checkpoints/best.json: {"step", "metric", "value", "mode"} of the best evaluation so far (checkpoint.keep_best)."""
    return read_json(run.checkpoints / BEST_JSON)


def best_checkpoint(run: RunDir) -> Path | None:
    """The checkpoint of the best evaluation, when it was written."""
    rec = best_record(run)
    if rec is None:
        return None
    path = step_dir(run, int(rec["step"]))
    return path if path.is_dir() else None


def link_best(run: RunDir) -> None:
    """Point checkpoints/best at the best evaluation's checkpoint (once it exists); atomic (a new link, renamed)."""
    path = best_checkpoint(run)
    if path is None:
        return
    link = run.checkpoints / "best"
    if link.is_symlink() and os.readlink(link) == path.name:
        return
    tmp = run.checkpoints / ".best.tmp"
    tmp.unlink(missing_ok=True)
    os.symlink(path.name, tmp)
    os.replace(tmp, link)


def record_eval(run: RunDir, row: dict, metric: str, mode: str) -> bool:
    """Keep row's step as the best when its `metric` beats the best so far; True when it does."""
    value = row.get(metric)
    if value is None:
        return False
    rec = best_record(run)
    if rec is not None and rec.get("metric") == metric and \
            not (value > rec["value"] if mode == "max" else value < rec["value"]):
        return False
    run.checkpoints.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run.checkpoints / BEST_JSON, {"step": int(row["step"]), "metric": metric, "value": value,
                                                     "mode": mode})
    link_best(run)
    return True


def set_aside(run: RunDir, version: int) -> list[Path]:
    """Checkpoints of policy `version` or later hold a policy that is not finite: each is renamed step_N.nonfinite
    (kept for a post-mortem, never resumed: the rename takes it out of list_checkpoints) and `latest` names the
    newest one left (or is removed). Returns the new paths, oldest first."""
    moved = []
    for p in list_checkpoints(run):
        if int(p.name[5:]) >= version:
            dst = p.with_name(p.name + NOT_FINITE_SUFFIX)
            shutil.rmtree(dst, ignore_errors=True)
            os.rename(p, dst)
            moved.append(dst)
    if moved:
        left = list_checkpoints(run)
        if left:
            write_text_atomic(run.checkpoints / "latest", left[-1].name)
        else:
            (run.checkpoints / "latest").unlink(missing_ok=True)
        link = run.checkpoints / "best"
        if link.is_symlink() and not link.exists():
            link.unlink()
    return moved


