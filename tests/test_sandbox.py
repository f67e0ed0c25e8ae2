"""The python tool's sandbox against hostile model-written code, inside a real `hpc-rl run`: every case of
tests.envs.HOSTILE ends as a one-line observation, nothing outside the sandbox is written or read, the trainer and
the rollout server keep running, and the next trajectories still work."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_rl.metrics import read_metrics
from hpc_rl.rollout.environments.sandbox import SandboxLimits, namespaces_available, run_python
from tests.envs import HOSTILE_NAMES
from tests.runs import only_run

REPO = Path(__file__).resolve().parent.parent
SECRET = "hpc-rl-test-private-key"


def test_namespaces_are_available_here():
    # CI machines must isolate model code; a machine without user namespaces fails here rather than skipping.
    assert namespaces_available() is None


def test_sandbox_runs_code_and_cleans_up():
    r = run_python("import os\nopen('x.txt', 'w').write('hi')\nprint(sorted(os.listdir('.')), os.getcwd())",
                   SandboxLimits(wall_s=10))
    assert r.ok and r.isolated and "'main.py', 'x.txt'" in r.output
    assert not Path(r.output.split()[-1]).exists()  # the working directory is gone


def test_sandbox_works_when_the_runs_folder_hides_the_temp_dir(tmp_path):
    (tmp_path / "token").write_text("secret")
    r = run_python(f"import os\nprint(os.path.exists({str(tmp_path / 'token')!r}), os.getcwd())",
                   SandboxLimits(wall_s=10), hide=[tmp_path, "/tmp"])
    assert r.ok and r.output.startswith("False "), r.output
    if not any(Path(p).is_relative_to("/tmp") for p in (sys.prefix, sys.base_prefix)):
        # /tmp is hidden whole (a Python installed under /tmp keeps its own folders visible: then /tmp stays)
        assert r.output.startswith("False /dev/shm/"), r.output


@pytest.mark.slow
def test_hostile_code_corpus_in_a_run(tmp_path):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_rsa").write_text(SECRET)
    outside = tmp_path / "outside" / "pwned.txt"
    outside.parent.mkdir()
    log = tmp_path / "observations.jsonl"
    env = {"HOME": str(home), "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "hpc_rl.cli", "run", str(REPO / "jobs" / "toy-tool-cpu.yaml"),
                        "checkpoint.every=0", "trainer.steps=2", "trainer.prompts_per_step=6", "algorithm.group_size=2",
                        "trainer.mini_batch_size=12", "rollout.env=tests.envs:HostileEnv",
                        f"rollout.env_kwargs={{log: {log}, outside: {outside}}}", "rollout.tool_timeout_s=20",
                        "rollout.sandbox.wall_s=4", "rollout.sandbox.cpu_s=2", "rollout.sandbox.memory_mb=512"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=900,
                       env={**os.environ, **env, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = only_run(tmp_path)
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(rows) == 2 * 12 and {x["case"] for x in rows} == set(HOSTILE_NAMES)
    token = (run / "token").read_text()
    for x in rows:
        obs = x["observation"]
        assert "\n" not in obs and obs.startswith("error: python: "), x
        assert token not in obs and SECRET not in obs and "connected" not in obs and "wrote" not in obs, x
    by_case = {x["case"]: x["observation"] for x in rows}
    assert "wall time" in by_case["fork_bomb"] or "Resource temporarily unavailable" in by_case["fork_bomb"]
    assert "CPU time limit" in by_case["infinite_loop"] or "wall time" in by_case["infinite_loop"]
    assert "MemoryError" in by_case["alloc_10gb"]
    assert "output exceeded" in by_case["output_100mb"]
    assert "Read-only file system" in by_case["write_outside"]
    assert "No such file" in by_case["read_token"] and "No such file" in by_case["read_ssh"]
    assert "unreachable" in by_case["socket_loopback"] and "unreachable" in by_case["socket_server"]
    assert "ProcessLookupError" in by_case["kill_parent"]
    assert "ctypes" in by_case["ctypes"]
    assert not outside.exists()
    assert (home / ".ssh" / "id_rsa").read_text() == SECRET and (run / "token").read_text() == token
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]  # the trainer and the server went on to the next step
    assert all(m["tool_errors"] == 12 and m["tool_calls_per_sample"] == 1.0 for m in metrics)
