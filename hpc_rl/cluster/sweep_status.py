"""`hpc-rl sweep status SWEEP`: one row per point (state, step, last/best reward, KL, last/best held-out pass@1 of
eval.jsonl, run dir),
the last log lines of failed points, `--json` for scripts and `--follow` (rich progress) until all end."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ..logs import tail_lines
from ..metrics import read_metrics
from ..rundir import DEFAULT_SWEEPS_DIR, RunDir, find_sweep, load_state
from . import slurmq
from .status import log_files, run_info

LOG_TAIL_LINES = 4
FOLLOW_POLL_S = 3.0
FOLLOW_TIMEOUT_S = 24 * 3600
UNKNOWN_POLLS = 5
# A point whose job ended: nothing of it will change any more.
_ENDED = slurmq.TERMINAL | {"STOPPED", "UNKNOWN"}


def log_tail(run: RunDir, n: int = LOG_TAIL_LINES) -> list[str]:
    """The last lines of the trainer's log and of the newest Slurm task log ("file: line")."""
    out = []
    trainer = run.logs / "trainer-0.log"
    slurm_logs = [p for p in log_files(run) if p.parent.name == "submitit" and p.exists()]
    newest = max(slurm_logs, key=lambda p: p.stat().st_mtime, default=None)
    for p in (trainer, newest):
        if p is not None:
            out += [f"{p.name}: {line}" for line in tail_lines(p, n)]
    return out


def _curve_stats(run: RunDir) -> dict:
    rows = read_metrics(run.metrics)
    rewards = [r["reward_mean"] for r in rows if isinstance(r.get("reward_mean"), (int, float))]
    last = rows[-1] if rows else {}
    evals = [r["eval/pass@1"] for r in sorted(read_metrics(run.eval_log), key=lambda r: r["step"])
             if r.get("source", "train") == "train" and isinstance(r.get("eval/pass@1"), (int, float))]
    return {"step": last.get("step"), "reward_last": rewards[-1] if rewards else None,
            "reward_best": max(rewards) if rewards else None, "kl": last.get("kl"),
            "eval_pass1_last": evals[-1] if evals else None, "eval_pass1_best": max(evals) if evals else None}


def point_infos(root: Path, state: dict | None = None) -> list[dict]:
    """Status of every point of the sweep (same keys for --json and the table)."""
    state = state or load_state(root)
    out = []
    for p in state["points"]:
        run = RunDir(Path(p["run_dir"]))
        info = run_info(run)
        info.update(_curve_stats(run))
        info.update({"index": p["index"], "overrides": p["overrides"], "label": p["label"],
                     "attempts": len(p.get("job_ids", []))})
        info["log_tail"] = log_tail(run) if info["state"] not in ("COMPLETED", "RUNNING", "PENDING") \
            and info["state"] in _ENDED else []
        out.append(info)
    return out


def _num(v, fmt: str) -> str:
    return fmt.format(v) if isinstance(v, (int, float)) else "-"


def table_rows(root: Path, infos: list[dict]) -> list[list[str]]:
    """Header + one row per point, as printed."""
    rows = [["IDX", "OVERRIDES", "STATE", "JOB", "STEP", "REWARD", "BEST", "KL", "EVAL P@1", "BEST P@1", "RUN DIR"]]
    for i in infos:
        step = "-" if i["step"] is None else f"{i['step']}/{i['steps'] or '?'}"
        try:
            rel = str(Path(i["path"]).relative_to(root))
        except ValueError:
            rel = i["path"]
        rows.append([str(i["index"]), i["label"], i["state"], i["job_id"] or "-", step,
                     _num(i["reward_last"], "{:.3f}"), _num(i["reward_best"], "{:.3f}"), _num(i["kl"], "{:.4f}"),
                     _num(i["eval_pass1_last"], "{:.3f}"), _num(i["eval_pass1_best"], "{:.3f}"), rel])
    return rows


def format_table(root: Path, infos: list[dict]) -> str:
    rows = table_rows(root, infos)
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    for i in infos:
        if i["log_tail"]:
            lines.append(f"\npoint {i['index']} ({i['label']}) {i['state']}; last log lines:")
            lines += [f"  {ln}" for ln in i["log_tail"]]
    return "\n".join(lines)


def _follow(root: Path, state: dict, timeout_s: float) -> list[dict]:
    """Poll until every point ended, showing a rich progress bar of points and training steps."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    infos = point_infos(root, state)
    total_steps = sum(i["steps"] or 0 for i in infos) or 1
    deadline = time.monotonic() + timeout_s
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[detail]}"), TimeElapsedColumn(), transient=False,
                  console=None) as prog:
        points = prog.add_task("points ended", total=len(infos), detail="")
        steps = prog.add_task("training steps", total=total_steps, detail="")
        unknown_polls: dict[int, int] = {}
        while True:
            # UNKNOWN (Slurm does not know the job, no result file) may be a passing squeue hiccup:
            # it counts as ended only when seen UNKNOWN_POLLS times in a row.
            for i in infos:
                unknown_polls[i["index"]] = unknown_polls.get(i["index"], 0) + 1 if i["state"] == "UNKNOWN" else 0
            ended = [i for i in infos if i["state"] in _ENDED - {"UNKNOWN"}
                     or unknown_polls[i["index"]] >= UNKNOWN_POLLS]
            counts: dict[str, int] = {}
            for i in infos:
                counts[i["state"]] = counts.get(i["state"], 0) + 1
            detail = " ".join(f"{k}:{v}" for k, v in sorted(counts.items()))
            prog.update(points, completed=len(ended), detail=detail)
            prog.update(steps, completed=sum(i["step"] or 0 for i in infos))
            if len(ended) == len(infos):
                return infos
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for the points of sweep "
                                   f"{state['name']} to end ({detail})")
            time.sleep(FOLLOW_POLL_S)
            infos = point_infos(root, state)


def show_sweep_status(sweep: str, sweeps_dir: str = DEFAULT_SWEEPS_DIR, as_json: bool = False,
                      follow: bool = False, timeout_s: float = FOLLOW_TIMEOUT_S) -> int:
    """Print the sweep's table (or JSON); with follow, first wait until every point has ended."""
    root = find_sweep(sweep, sweeps_dir)
    state = load_state(root)
    if follow:
        try:
            infos = _follow(root, state, timeout_s)
        except KeyboardInterrupt:
            infos = point_infos(root, state)
    else:
        infos = point_infos(root, state)
    if as_json:
        arrays = [s["array_job_id"] for s in state.get("submissions", [])]
        print(json.dumps({"sweep": state["name"], "path": str(root), "arrays": arrays, "points": infos}, indent=1))
        return 0
    arrays = ", ".join(s["array_job_id"] for s in state.get("submissions", [])) or "none"
    print(f"sweep {state['name']} ({root}): {len(infos)} point(s), array job(s) {arrays}")
    print(format_table(root, infos))
    sys.stdout.flush()
    return 0
