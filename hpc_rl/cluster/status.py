"""`hpc-rl status`, `hpc-rl logs`, `hpc-rl cancel`: a run's state from Slurm and from its own files."""

from __future__ import annotations

import json
import pickle
import sys
import time
from pathlib import Path

import yaml

from ..config.trainer import node_range
from ..errors import ClusterError, HpcRlError
from ..metrics import read_metrics
from ..rundir import RunDir, find, read_json, write_json_atomic
from . import slurmq
from .rollout_jobs import ROLLOUT_SUBMITIT_DIR, active_jobs
from .submit import SLURM_JSON

CANCELLED_JSON = "cancelled.json"
CANCEL_WAIT_S = 90
FOLLOW_POLL_S = 0.5


def last_metrics(path: Path) -> dict | None:
    """The last complete JSON line of metrics.jsonl (reads only the file's tail)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 65536))
            lines = f.read().splitlines()
    except FileNotFoundError:
        return None
    for raw in reversed(lines):
        try:
            row = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue  # a line being written, or the cut first line of the tail
        if isinstance(row, dict):
            return row
    return None


def _submitit_result(run: RunDir, job_id: str) -> str | None:
    """COMPLETED/FAILED from submitit's result file of task 0, None when there is none."""
    path = run.root / "submitit" / f"{job_id}_0_result.pkl"
    try:
        with open(path, "rb") as f:
            outcome = pickle.load(f)[0]  # our own job's file: ("success", value) or ("error", traceback)
    except (FileNotFoundError, EOFError, pickle.UnpicklingError, IndexError, TypeError, ImportError):
        return None
    return "COMPLETED" if outcome == "success" else "FAILED"


def _state_from_files(run: RunDir, job_id: str | None) -> str:
    if (run.root / CANCELLED_JSON).is_file():
        return "CANCELLED"
    if job_id:
        st = _submitit_result(run, job_id)
        if st:
            return st
    done = read_json(run.done_file)
    if done is not None:
        status = str(done.get("status", "")).upper()
        return status if status in slurmq.TERMINAL else ("FAILED" if done.get("error") else "COMPLETED")
    if job_id:
        return "UNKNOWN"  # Slurm forgot the job and it left no result: killed hard, or files lost
    # A local run: alive while its files change.
    newest = max((p.stat().st_mtime for p in (run.metrics, run.logs) if p.exists()), default=0)
    return "RUNNING" if time.time() - newest < 300 else "STOPPED"


def run_info(run: RunDir) -> dict:
    """Everything `status` shows about one run."""
    slurm = read_json(run.root / SLURM_JSON)
    job_id = str(slurm["job_id"]) if slurm else None
    state = slurmq.job_state(job_id) if job_id else None
    source = "slurm" if state else "files"
    if state is None:
        state = _state_from_files(run, job_id)
    try:
        spec = yaml.safe_load(run.job_yaml.read_text()) or {}
    except (OSError, yaml.YAMLError):
        spec = {}
    m = last_metrics(run.metrics) or {}
    attempts = read_json(run.root / "attempts.json") or {}
    evals = read_metrics(run.eval_log)
    ev = evals[-1] if evals else {}  # the newest evaluation, during training or offline (hpc-rl eval)
    return {
        "run": run.name, "path": str(run.root), "kind": "slurm" if slurm else "local", "job_id": job_id,
        "state": state, "state_source": source, "nodes": slurmq.job_nodes(job_id) if job_id else None,
        "step": m.get("step"), "steps": (spec.get("trainer") or {}).get("steps"),
        "reward_mean": m.get("reward_mean"),
        "eval": {"step": ev.get("step"), "source": ev.get("source"), "pass@1": ev.get("eval/pass@1"),
                 "reward_mean": ev.get("eval/reward_mean")} if ev else None,
        # Written by the first node of each attempt (launch._record_attempt): preemptions/time limits survived.
        "requeues": int(attempts.get("requeues", 0)),
        # The trainer nodes of each attempt, oldest first (a node range may give each attempt another count).
        "trainer_nodes": [a.get("trainer_nodes") for a in attempts.get("history", [])],
        # Servers taking work at the last step, and rollout jobs (hpc-rl rollout add) still queued or running.
        "rollout_servers": m.get("rollout_servers"),
        "rollout_jobs": len(active_jobs(run)),
    }


def _all_runs(runs_dir: str | Path) -> list[RunDir]:
    base = Path(runs_dir)
    if not base.is_dir():
        return []
    dirs = [d for d in base.iterdir() if d.is_dir() and (d / "job.yaml").is_file()]
    return [RunDir(d.resolve()) for d in sorted(dirs, key=lambda d: d.stat().st_mtime)]


def _fmt(info: dict) -> list[str]:
    step = "-" if info["step"] is None else f"{info['step']}/{info['steps'] or '?'}"
    reward = info["reward_mean"]
    reward = f"{reward:.3f}" if isinstance(reward, (int, float)) else "-"
    state = info["state"] + (f" (requeued {info['requeues']}x)" if info.get("requeues") else "")
    sizes = info.get("trainer_nodes") or []
    if len(set(sizes)) > 1:  # the trainer's size changed between attempts
        state += f" trainer nodes {' -> '.join(map(str, sizes))}"
    ev = info.get("eval")
    evs = "-"
    if ev and isinstance(ev.get("pass@1"), (int, float)):
        evs = f"{ev['pass@1']:.3f}@{ev['step']}" + ("(offline)" if ev.get("source") == "offline" else "")
    servers = "-" if info.get("rollout_servers") is None else str(int(info["rollout_servers"]))
    if info.get("rollout_jobs"):
        servers += f" (+{info['rollout_jobs']} job{'s' if info['rollout_jobs'] > 1 else ''})"
    return [info["run"], state, info["job_id"] or "local", step, reward, evs, servers, info["nodes"] or ""]


def show_status(run: str | None, runs_dir: str = "runs", as_json: bool = False) -> int:
    """List runs (or one run) with Slurm state, step and last reward."""
    runs = [find(run, runs_dir)] if run else _all_runs(runs_dir)
    infos = [run_info(r) for r in runs]
    if as_json:
        print(json.dumps(infos[0] if run else infos, indent=1))
        return 0
    if not infos:
        print(f"no runs in {runs_dir}/ (start one with `hpc-rl run` or `hpc-rl submit`)")
        return 0
    rows = [["RUN", "STATE", "JOB", "STEP", "REWARD", "EVAL_P@1", "SERVERS", "NODES"]] + [_fmt(i) for i in infos]
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    return 0


# --------------------------------------------------------------------------- logs


def _role_of_log(path: Path, trainer_nodes: int) -> str | None:
    """'trainer'/'rollout'/'reward' for a log file (Slurm's task logs of reward nodes count as rollout: the
    non-trainer side), None for files of the whole job (batch script)."""
    name = path.name
    if path.parent.name == "submitit" and path.parent.parent.name == "rollout_jobs":
        return "rollout"  # a rollout job's Slurm logs (hpc-rl rollout add)
    for role in ("trainer", "rollout", "reward"):
        if role in name:
            return role
    parts = name.split("_")
    if path.parent.name == "submitit" and len(parts) >= 3 and parts[1].isdigit():
        return "trainer" if int(parts[1]) < trainer_nodes else "rollout"  # submitit: JOBID_TASK_log.out
    return None


def log_files(run: RunDir, role: str = "all") -> list[Path]:
    """The run's log files (submitit task logs, then RUN/logs/*) for `role` (trainer, rollout, reward, all)."""
    slurm = read_json(run.root / SLURM_JSON) or {}
    # A node range: the trainer nodes of the newest attempt (launch._record_attempt).
    history = (read_json(run.root / "attempts.json") or {}).get("history") or [{}]
    trainer_nodes = int(history[-1].get("trainer_nodes") or node_range(slurm.get("trainer_nodes", 1))[0])
    files = []
    for folder in (run.root / "submitit", run.root / ROLLOUT_SUBMITIT_DIR):
        files += sorted(folder.glob("*.out")) + sorted(folder.glob("*.err"))
    if run.logs.is_dir():
        files += sorted(p for p in run.logs.rglob("*") if p.is_file())
    if role == "all":
        return files
    return [p for p in files if _role_of_log(p, trainer_nodes) == role]


def _finished(run: RunDir) -> bool:
    return run_info(run)["state"] in slurmq.TERMINAL | {"STOPPED", "UNKNOWN"}


def show_logs(run: str, role: str = "all", follow: bool = False, runs_dir: str = "runs") -> int:
    """Print the run's logs for `role`; with follow, keep printing until the run ends (or Ctrl-C)."""
    rd = find(run, runs_dir)
    offsets: dict[Path, int] = {}
    current: list[Path | None] = [None]

    def pump() -> bool:
        wrote = False
        for p in log_files(rd, role):
            try:
                with open(p, "rb") as f:
                    f.seek(offsets.get(p, 0))
                    data = f.read()
            except OSError:
                continue
            if not data:
                continue
            offsets[p] = offsets.get(p, 0) + len(data)
            if current[0] != p:
                print(f"==> {p.relative_to(rd.root)} <==", flush=True)
                current[0] = p
            sys.stdout.write(data.decode("utf-8", "replace"))
            wrote = True
        sys.stdout.flush()
        return wrote

    pump()
    if not follow:
        if not offsets:
            print(f"no {role if role != 'all' else ''} logs yet in {rd.root}".replace("  ", " "))
        return 0
    try:
        while True:
            finished = _finished(rd)
            time.sleep(FOLLOW_POLL_S)
            if not pump() and finished:
                return 0  # the run ended and its last lines are printed
    except KeyboardInterrupt:
        return 0


# --------------------------------------------------------------------------- cancel


def cancel_run(run: str, runs_dir: str = "runs") -> int:
    """scancel the run's Slurm job (every node, every process) and wait until Slurm says it ended."""
    rd = find(run, runs_dir)
    slurm = read_json(rd.root / SLURM_JSON)
    if not slurm:
        raise HpcRlError(f"run {rd.name} was not submitted to Slurm (no {SLURM_JSON}); stop a local `hpc-rl run` "
                         "with Ctrl-C in its terminal")
    job_id = str(slurm["job_id"])
    for job in active_jobs(rd):  # the run's rollout jobs would otherwise wait for a trainer that is gone
        ok, msg = slurmq.scancel(str(job["job_id"]))
        print(f"cancelled rollout job {job['job_id']} of run {rd.name}" if ok else
              f"scancel of rollout job {job['job_id']} failed: {msg}")
    state = slurmq.job_state(job_id)
    if state in slurmq.TERMINAL or state is None:
        print(f"job {job_id} of run {rd.name} already ended ({state or 'unknown to Slurm'})")
        return 0
    ok, msg = slurmq.scancel(job_id)
    if not ok:
        raise ClusterError(f"scancel {job_id} failed ({msg}); check that the job is yours (`squeue -j {job_id}`)")
    write_json_atomic(rd.root / CANCELLED_JSON, {"job_id": job_id, "time": time.time()})
    deadline = time.monotonic() + CANCEL_WAIT_S
    while time.monotonic() < deadline:
        state = slurmq.job_state(job_id)
        if state is None or state in slurmq.TERMINAL:
            print(f"cancelled job {job_id} of run {rd.name} ({state or 'gone from the queue'})")
            return 0
        time.sleep(0.5)
    raise ClusterError(f"job {job_id} still {state} {CANCEL_WAIT_S}s after scancel; its nodes may be unresponsive: "
                       f"ask the admins, or check `scontrol show job {job_id}`")
