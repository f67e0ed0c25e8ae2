"""Helpers for tests that run real rollout servers: a run dir for a model folder, a server subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from ..config import dump, load_dict
from ..rundir import RunDir, create, read_json


def make_run(output_dir: str | Path, model_path: str | Path, name: str = "rollout-test", reward: dict | None = None,
             model: dict | None = None, **rollout) -> RunDir:
    """A fresh run dir (token 0600) whose job.yaml serves `model_path` with the HF engine on 127.0.0.1:0 (and the
    `reward` section, e.g. a reward model placed on the server; `model`: more model settings, e.g. lora)."""
    settings = {"engine": "hf", "host": "127.0.0.1", "port": 0, **rollout}
    data = {"max_prompt_tokens": min(128, settings.get("max_model_len", 256) // 2)}
    cfg = load_dict({"name": name, "model": {"path": str(model_path), **(model or {})}, "data": data, "rollout": settings,
                     **({"reward": reward} if reward else {})})
    run = create(output_dir, name)
    run.job_yaml.write_text(dump(cfg))
    return run


def spawn_server(run: RunDir, index: int = 0, env: dict | None = None) -> subprocess.Popen:
    """Start `python -m hpc_rl.rollout.server` (output in RUN/logs/rollout-K.log) without waiting."""
    run.logs.mkdir(parents=True, exist_ok=True)
    log = open(run.logs / f"rollout-{index}.log", "ab")
    full_env = {**os.environ, "HPC_RL_ROLLOUT_THREADS": "1", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "hpc_rl.rollout.server", "--run-dir", str(run.root),
                             "--index", str(index), "--device", "cpu"],
                            stdout=log, stderr=subprocess.STDOUT, env=full_env)
    log.close()
    return proc


def wait_rendezvous(run: RunDir, index: int, proc: subprocess.Popen, timeout_s: float = 120.0) -> dict:
    """The server's rendezvous info once written; RuntimeError with its log tail if it dies or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = read_json(run.rollout_file(index))
        if info and info.get("pid") == proc.pid:
            return info
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    tail = (run.logs / f"rollout-{index}.log").read_text(errors="replace")[-2000:]
    raise RuntimeError(f"rollout server {index} did not write its rendezvous file within {timeout_s}s "
                       f"(exit code {proc.poll()}); log tail:\n{tail}")


def start_server(run: RunDir, index: int = 0, timeout_s: float = 120.0,
                 env: dict | None = None) -> tuple[subprocess.Popen, dict]:
    """spawn_server + wait_rendezvous."""
    proc = spawn_server(run, index, env)
    return proc, wait_rendezvous(run, index, proc, timeout_s)


def stop_server(proc: subprocess.Popen, timeout_s: float = 15.0) -> int:
    """SIGTERM, then SIGKILL after `timeout_s`; returns the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait(timeout_s)
