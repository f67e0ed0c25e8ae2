"""SIGKILL survival of `hpc-rl run`: the launcher's process group is killed at seeded points (start-up, mid-step,
mid-checkpoint); each time no process of the run survives, at most one step of work is lost, the resume
loads the newest complete checkpoint, and the last resume finishes with the full step count and data order."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_rl import checkpoints, config
from hpc_rl.data.sampler import indices_for_step
from hpc_rl.metrics import read_metrics
from hpc_rl.rundir import RunDir

from .local_run import poll, procs_of

REPO = Path(__file__).resolve().parent.parent
TOY = REPO / "jobs" / "toy-grpo-cpu.yaml"
STEPS = 24
OVERRIDES = [f"trainer.steps={STEPS}", "checkpoint.every=1", "checkpoint.keep_last=2", "trainer.prompts_per_step=8",
             "trainer.mini_batch_size=32", "logging.tensorboard=false"]
# 10 kill points: 2 during start-up, 2 while a checkpoint is being written, 6 at random times inside steps.
MODES = ["startup"] * 2 + ["checkpoint"] * 2 + ["step"] * 6
pytestmark = pytest.mark.slow


def _start(cwd: Path, log: Path, resume: Path | None) -> subprocess.Popen:
    args = [sys.executable, "-m", "hpc_rl.cli", "run", str(TOY), *OVERRIDES]
    if resume is not None:
        args += ["--resume", str(resume)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(args, cwd=cwd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def _last_metrics_step(run: RunDir) -> int:
    rows = read_metrics(run.metrics) if run.metrics.exists() else []
    return max((r["step"] for r in rows), default=0)


def _tmp_dirs(run: RunDir) -> set:
    out = set()
    for p in run.checkpoints.glob(".step_*.tmp"):
        try:
            st = p.stat()
        except OSError:
            continue
        out.add((p.name, st.st_ino, st.st_ctime_ns))
    return out


def _ckpt_step(path) -> int:
    return int(path.name[5:]) if path is not None else 0


def test_sigkill_at_seeded_points_resumes_exactly(tmp_path):
    """~130 s on 2 cores: eleven starts of the same run (ten killed at seeded points, one that finishes), each
    paying the start-up of a launcher, a server and two ranks; the kill points need a real run to hit."""
    rng = random.Random(20261202)
    modes = MODES[:]
    rng.shuffle(modes)
    run: RunDir | None = None
    lost, kills = [], []
    for i, mode in enumerate(modes):
        log = tmp_path / f"attempt-{i}.log"
        before = _ckpt_step(checkpoints.find_latest(run)) if run else 0
        proc = _start(tmp_path, log, run.root if run else None)
        t0 = time.time()
        if run is None:
            found = poll("the run dir", lambda: [d for d in (tmp_path / "runs").glob("*/job.yaml")], 120, proc, log)
            run = RunDir(found[0].parent)
        if mode == "startup":
            time.sleep(rng.uniform(1.0, 15.0))
        elif mode == "checkpoint":
            # A killed save leaves its .tmp behind until the next save replaces it: wait for a new one.
            stale = _tmp_dirs(run)
            poll("a checkpoint being written", lambda run=run, stale=stale: _tmp_dirs(run) - stale, 300, proc, log, every=0.005)
        else:
            pat = re.compile(rf"step {before + 1}/{STEPS} ")
            poll(f"step {before + 1}", lambda pat=pat, log=log: pat.search(log.read_text(errors="replace")), 300, proc, log)
            time.sleep(rng.uniform(0.0, 1.0))
        assert proc.poll() is None, f"attempt {i} ended before its kill:\n{log.read_text()[-3000:]}"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        kills.append((mode, round(time.time() - t0, 1)))

        # Ranks and rollout servers die with the launcher (they run in sessions of their own).
        deadline = time.time() + 15
        while procs_of(run.root) and time.time() < deadline:
            time.sleep(0.2)
        assert procs_of(run.root) == [], f"orphans after kill {i} ({mode})"

        # At most one step of work lost: the newest complete checkpoint is at most one step behind the
        # last step that finished (its metrics row is written just before its checkpoint).
        latest = checkpoints.find_latest(run)
        done = _last_metrics_step(run)
        assert latest is None or checkpoints.verify(latest)
        assert _ckpt_step(latest) >= before, "a kill destroyed an older complete checkpoint"
        assert done - _ckpt_step(latest) <= 1, (i, mode, done, latest)
        lost.append(done - _ckpt_step(latest))

        # The attempt resumed from what find_latest picked before it started (never a corrupt one).
        text = log.read_text(errors="replace")
        m = re.search(r"resumed from (\S+) \(step (\d+)\)", text)
        if before and m:
            assert int(m.group(2)) == before and m.group(1).endswith(f"step_{before}")
        assert "Traceback" not in text

    log = tmp_path / "final.log"
    proc = _start(tmp_path, log, run.root)
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    assert procs_of(run.root) == []
    rows = read_metrics(run.metrics)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    cfg = config.load(run.job_yaml)
    for r in rows:  # the same data order as an uninterrupted run
        assert r["prompt_ids"] == indices_for_step(cfg.data.toy_size, 8, cfg.seed, r["step"] - 1)
        assert r["policy_version"] == r["step"]
    assert json.loads(run.done_file.read_text())["step"] == STEPS
    assert checkpoints.find_latest(run) == checkpoints.step_dir(run, STEPS)
    print(f"\nkill points survived: {len(kills)} {kills}; steps lost per kill: {lost} (max {max(lost)})")
    assert len(kills) == 10
