"""Failures while a local run trains: a reward function that returns NaN stops the run with one line; a killed
trainer rank fails the job fast, naming the rank and node; one rollout server killed (-9) and another
SIGSTOPped mid-run: the client times out, retries on the remaining server, and the run completes."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_rl.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent
TOY = REPO / "jobs" / "toy-grpo-cpu.yaml"
SMALL = ["trainer.prompts_per_step=8", "trainer.mini_batch_size=32", "logging.tensorboard=false",
         "checkpoint.every=0"]
pytestmark = pytest.mark.slow

NAN_REWARD = '''
calls = 0


def score(prompt, completion, **row):
    """Finite for the 64 samples of step 1, NaN from step 2 on."""
    global calls
    calls += 1
    return float("nan") if calls > 64 else 0.5
'''


def _start(cwd: Path, *overrides: str) -> tuple[subprocess.Popen, Path]:
    log = cwd / "out.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "hpc_rl.cli", "run", str(TOY), *SMALL, *overrides], cwd=cwd,
                         stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return p, log


def _wait_text(proc, log: Path, pattern: str, timeout: float = 400) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if re.search(pattern, log.read_text(errors="replace")):
            return
        if proc.poll() is not None:
            pytest.fail(f"run exited ({proc.returncode}) before {pattern!r}:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"timed out after {timeout}s waiting for {pattern!r}:\n{log.read_text()[-3000:]}")


def _pid_of(cwd: Path, *words: str, env_has: str | None = None) -> int:
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")
            environ = (d / "environ").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(str(cwd) in c for c in cmd) and all(w in cmd for w in words) and (env_has is None or env_has in environ):
            return int(d.name)
    raise AssertionError(f"no process {words} {env_has} under {cwd}")


def _run_dir(cwd: Path) -> Path:
    return next((cwd / "runs").iterdir())


def _no_processes_left(cwd: Path) -> bool:
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and str(cwd).encode() in (d / "cmdline").read_bytes():
                state = (d / "stat").read_text().split(")")[-1].split()[0]
                if state != "Z":
                    return False
        except OSError:
            continue
    return True


def test_reward_returning_nan_stops_the_run_with_one_line(tmp_path):
    (tmp_path / "nan_reward.py").write_text(NAN_REWARD)
    proc, log = _start(tmp_path, "trainer.steps=4", "reward.function=nan_reward:score")
    rc = proc.wait(timeout=600)
    out = log.read_text(errors="replace")
    assert rc == 2, out[-3000:]
    assert "Traceback" not in out
    errors = [ln for ln in out.splitlines() if "error:" in ln]
    assert len(errors) == 1, out[-3000:]
    assert "reward.function nan_reward:score: sample 0 returned nan; rewards must be finite" in errors[0]
    assert [r["step"] for r in read_metrics(_run_dir(tmp_path) / "metrics.jsonl")] == [1]
    assert _no_processes_left(tmp_path)


def test_trainer_rank_death_fails_fast_naming_rank_and_node(tmp_path):
    proc, log = _start(tmp_path, "trainer.steps=40")
    _wait_text(proc, log, r"step 2/40 ")
    os.kill(_pid_of(tmp_path, "hpc_rl.loop", env_has="RANK=1"), signal.SIGKILL)
    t0 = time.time()
    rc = proc.wait(timeout=120)
    took = time.time() - t0
    out = log.read_text(errors="replace")
    assert rc != 0
    assert f"trainer rank 1 was killed by SIGKILL on {os.uname().nodename}; stopping the job" in out, out[-3000:]
    assert took < 30, f"the launcher took {took:.1f}s to notice the dead rank"
    assert _no_processes_left(tmp_path)
    print(f"\nrank death noticed and job stopped in {took:.1f}s")


def test_rollout_server_killed_and_another_stopped_run_completes(tmp_path):
    """Over a minute: the stopped server's share of a step waits out rollout.request_timeout_s (10 s) before it
    moves to a live server, and the run starts three servers."""
    steps = 8
    proc, log = _start(tmp_path, f"trainer.steps={steps}", "rollout.servers_per_node=3",
                       "rollout.request_timeout_s=10", "rollout.retries=2")
    _wait_text(proc, log, r"step 2/8 ")
    os.kill(_pid_of(tmp_path, "hpc_rl.rollout.server", "--index", "0"), signal.SIGKILL)
    stopped = _pid_of(tmp_path, "hpc_rl.rollout.server", "--index", "1")
    os.kill(stopped, signal.SIGSTOP)
    try:
        rc = proc.wait(timeout=600)
    finally:
        try:
            os.kill(stopped, signal.SIGCONT)
        except ProcessLookupError:
            pass
    out = log.read_text(errors="replace")
    assert rc == 0, out[-4000:]
    rows = read_metrics(_run_dir(tmp_path) / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert "rollout server 0" in out and "rollout server 1" in out  # both failures were reported
    # The launcher restarted the killed server on this node (the stopped one is alive, so it stays).
    assert re.search(r"rollout server 0 exited with code -9 on \S+; restarting it \(1/3\)", out), out[-4000:]
    assert "rollout server 1 exited" not in out
    assert _no_processes_left(tmp_path)


def test_all_rollout_servers_gone_stops_with_checkpoint_and_names_them(tmp_path):
    """The only server hangs (SIGSTOP: alive, so the launcher does not restart it) -> past the client's
    timeout and retries, and rollout.wait_for_servers_s, the run stops, keeping a checkpoint of the last finished
    step."""
    proc, log = _start(tmp_path, "trainer.steps=40", "rollout.request_timeout_s=10", "rollout.retries=1",
                       "rollout.wait_for_servers_s=3")
    _wait_text(proc, log, r"step 2/40 ")
    stopped = _pid_of(tmp_path, "hpc_rl.rollout.server", "--index", "0")
    os.kill(stopped, signal.SIGSTOP)
    try:
        rc = proc.wait(timeout=300)
    finally:
        try:
            os.kill(stopped, signal.SIGCONT)
        except ProcessLookupError:
            pass
    out = log.read_text(errors="replace")
    assert rc == 2, out[-3000:]
    assert "Traceback" not in out
    err = [ln for ln in out.splitlines() if "error:" in ln]
    assert len(err) == 1, out[-3000:]
    m = re.search(r"step (\d+): no rollout server answered; checkpoint of step (\d+) kept", err[0])
    assert m, err[0]
    assert "waiting up to 3s (rollout.wait_for_servers_s) for one to come back or join" in out
    tail = err[0].split("logs/rollout-0.log: ")[1]  # the server's last log lines
    assert "weights" in tail or "serving" in tail or "generate" in tail, err[0]
    kept = int(m.group(2))
    run = _run_dir(tmp_path)
    rows = read_metrics(run / "metrics.jsonl")
    assert kept == rows[-1]["step"] >= 2  # every finished step is kept
    from hpc_rl import checkpoints
    from hpc_rl.rundir import RunDir

    assert checkpoints.find_latest(RunDir(run)) == checkpoints.step_dir(RunDir(run), kept)
    assert _no_processes_left(tmp_path)


def test_a_run_waits_for_a_rollout_server_that_comes_back(tmp_path):
    """The only server hangs mid-run; the trainer waits for one (rollout.wait_for_servers_s), the server resumes
    (SIGCONT), gets the current policy and the run completes every step, none skipped."""
    steps = 8
    proc, log = _start(tmp_path, f"trainer.steps={steps}", "rollout.request_timeout_s=10", "rollout.retries=1",
                       "rollout.wait_for_servers_s=300")
    _wait_text(proc, log, r"step 2/8 ")
    stopped = _pid_of(tmp_path, "hpc_rl.rollout.server", "--index", "0")
    os.kill(stopped, signal.SIGSTOP)
    try:
        _wait_text(proc, log, r"waiting up to 300s \(rollout.wait_for_servers_s\)")
        time.sleep(2)  # the trainer is waiting, not yet given up
    finally:
        os.kill(stopped, signal.SIGCONT)
    rc = proc.wait(timeout=300)
    out = log.read_text(errors="replace")
    assert rc == 0, out[-4000:]
    assert re.search(r"rollout server\(s\) http://\S+ answer; the run goes on", out), out[-4000:]
    rows = read_metrics(_run_dir(tmp_path) / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["policy_version"] for r in rows] == list(range(1, steps + 1))
    assert "Traceback" not in out
    assert _no_processes_left(tmp_path)


def test_rollout_server_that_cannot_start_ends_the_run_at_once(tmp_path):
    """A server that exits with a user error (code 2: here it cannot bind rollout.host) is not waited for
    until rollout.startup_timeout_s: the run ends within seconds with one line naming the server, its node
    and its log's error line."""
    t0 = time.time()
    # An address no interface here has: bind() fails at once (EADDRNOTAVAIL); nothing is ever sent to it.
    proc, log = _start(tmp_path, "trainer.steps=4", "rollout.host=192.0.2.1", "rollout.startup_timeout_s=900")
    rc = proc.wait(timeout=300)
    took = time.time() - t0
    out = log.read_text(errors="replace")
    assert rc == 2, out[-3000:]
    assert took < 120, f"the run took {took:.0f}s to give up on a server that cannot start"
    assert "Traceback" not in out
    errors = [ln for ln in out.splitlines() if "error" in ln.lower() and "rollout server 0" in ln]
    assert len(errors) == 1, out[-3000:]
    assert f"rollout server 0 on node {os.uname().nodename} exited with code 2 before it served" in errors[0]
    assert "cannot bind 192.0.2.1" in errors[0]  # the last error line of logs/rollout-0.log
    assert "restarting it" not in out
    assert _no_processes_left(tmp_path)
    print(f"\nserver that cannot start: run ended in {took:.1f}s")


def test_rollout_server_killed_during_startup_is_not_retried(tmp_path):
    """A server that dies before it ever served (here SIGKILL while it loads) ends the run with one line; a
    startup failure would repeat, so it is not restarted (a server that crashes after serving is)."""
    proc, log = _start(tmp_path, "trainer.steps=4")
    deadline = time.time() + 120
    while True:
        try:
            pid = _pid_of(tmp_path, "hpc_rl.rollout.server", "--index", "0")
            break
        except AssertionError:
            assert time.time() < deadline and proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)  # importing torch takes seconds: it has not served yet
    rc = proc.wait(timeout=300)
    out = log.read_text(errors="replace")
    assert rc == 1, out[-3000:]
    assert re.search(r"rollout server 0 on node \S+ was killed by SIGKILL before it served \(a startup failure "
                     r"is not retried\)", out), out[-3000:]
    assert "restarting it" not in out
    assert _no_processes_left(tmp_path)


def test_rollout_server_that_keeps_crashing_after_serving_ends_the_run_after_its_restarts(tmp_path):
    """A server that served and then dies is restarted (3 times); when its restarts are used up the run ends at
    once with one line, instead of waiting for rollout.startup_timeout_s."""
    from hpc_rl.launch import MAX_SERVER_RESTARTS
    from hpc_rl.rundir import read_json

    # Two servers: the other one keeps the run going while server 0 crashes.
    proc, log = _start(tmp_path, "trainer.steps=400", "rollout.servers_per_node=2", "rollout.startup_timeout_s=900")
    _wait_text(proc, log, r"step 1/400 ")
    run = _run_dir(tmp_path)
    killed: set[int] = set()
    for _ in range(MAX_SERVER_RESTARTS + 1):
        deadline = time.time() + 300
        while True:  # the (re)started server serves again: it published its address with a new pid
            info = read_json(run / "rendezvous" / "rollout-0.json") or {}
            if info.get("pid") and info["pid"] not in killed:
                break
            assert time.time() < deadline and proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        killed.add(info["pid"])
        os.kill(info["pid"], signal.SIGKILL)
    t0 = time.time()
    rc = proc.wait(timeout=120)
    out = log.read_text(errors="replace")
    assert rc == 1, out[-3000:]
    assert time.time() - t0 < 60
    assert out.count("restarting it") == MAX_SERVER_RESTARTS, out[-4000:]
    assert re.search(r"rollout server 0 on node \S+ was killed by SIGKILL after it served, out of its 3 restarts", out), \
        out[-3000:]
    assert _no_processes_left(tmp_path)
