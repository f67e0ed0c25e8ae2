"""The python tool's sandbox: what a call sees and keeps, concurrent calls, the restart of a dead sandbox process,
local IPC channels to listeners outside (tests/sandbox_attacks.py) as root and as an unprivileged user the test
creates, require_isolation where user namespaces are off, and the hostile-code corpus inside a real `hpc-rl run`."""

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from hpc_rl.metrics import read_metrics
from hpc_rl.rollout.environments.sandbox import SandboxLimits, layers, namespaces_available, run_python, sandbox_for, seccomp_unavailable
from tests.envs import HOSTILE_NAMES
from tests.runs import only_run
from tests.sandbox_attacks import REACHED, limits_and_files, listeners, run_attacks

REPO = Path(__file__).resolve().parent.parent
SECRET = "hpc-rl-test-private-key"
SYSTEM_PYTHON = "/usr/bin/python3"  # the unprivileged user cannot execute the venv's (under /root, mode 0700)


def test_namespaces_and_the_ipc_seal_are_available_here():
    # CI machines must isolate model code; a machine without them fails here rather than skipping.
    assert namespaces_available() is None
    assert seccomp_unavailable() is None
    assert all(active for _, active, _ in layers())


def test_a_call_sees_a_fresh_tmp_and_leaves_nothing():
    lim = SandboxLimits(wall_s=10)
    r = run_python("import os\nopen('x.txt', 'w').write('hi')\nprint(sorted(os.listdir('.')), os.getcwd(), "
                   "os.getpid(), sorted(os.listdir('/proc/self/fd')))", lim)
    assert r.ok and r.isolated, r.output
    assert r.output.split() == ["['main.py',", "'x.txt']", "/tmp", "1", "['0',", "'1',", "'2',", "'3']"], r.output
    r = run_python("import os\nprint(sorted(os.listdir('/tmp')), sorted(os.listdir('/dev/shm')))", lim)
    assert r.ok and r.output.strip() == "['main.py'] []", r.output


def test_the_view_is_the_system_and_python_only(tmp_path):
    (tmp_path / "token").write_text("secret")
    cfg = Path(sys.prefix) / "pyvenv.cfg"
    hide = [tmp_path] + ([cfg] if cfg.exists() else [])
    r = run_python(f"import os, sys\nprint(sorted(os.listdir('/')), os.path.exists({str(tmp_path)!r}), "
                   f"os.path.exists(os.path.expanduser('~')), os.path.exists({str(REPO)!r}))\n"
                   f"print(repr(open({str(cfg)!r}).read()) if os.path.exists({str(cfg)!r}) else 'no cfg')\n"
                   "import json, math; print('stdlib ok')", SandboxLimits(wall_s=10), hide=hide)
    assert r.ok, r.output
    lines = r.output.strip().splitlines()
    top = eval(lines[0].rsplit("]", 1)[0] + "]")
    assert set(top) <= {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "usr", "dev", "proc", "tmp"} | {
        Path(p).parts[1] for p in (sys.prefix, sys.base_prefix, os.path.realpath(sys.executable))}, top
    assert lines[0].endswith("False False False") or REPO in Path(sys.prefix).parents, lines[0]
    assert lines[1] in ("''", "no cfg"), lines[1]  # a hidden file inside an allowed folder reads as empty
    assert lines[2] == "stdlib ok"


def test_concurrent_calls_cannot_see_each_other():
    outs = {}

    def call(i):
        outs[i] = run_python(f"import os, time\nopen('mine-{i}', 'w').close()\ntime.sleep(0.5)\n"
                             "print(sorted(os.listdir('.')), sorted(p for p in os.listdir('/proc') if p.isdigit()))",
                             SandboxLimits(wall_s=20))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, r in outs.items():
        assert r.ok and r.output.split() == ["['main.py',", f"'mine-{i}']", "['1']"], r.output


def test_a_dead_sandbox_process_is_restarted():
    sb = sandbox_for([])
    assert run_python("print(1)", SandboxLimits()).ok
    starts = sb.starts
    os.killpg(sb._proc.pid, signal.SIGKILL)
    sb._proc.wait()
    r = run_python("print(2)", SandboxLimits())
    assert r.ok and r.output.strip() == "2" and sb.starts == starts + 1, r.output


def test_limits_hold_and_kill_everything():
    lim = SandboxLimits(wall_s=3, cpu_s=1, output_bytes=1000)
    r = run_python("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent out')", lim)
    assert r.ok and r.output.strip() == "parent out", r  # the orphan died with the call (else: wall time)
    r = run_python("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)", lim)
    assert r.killed == "wall time", r
    # the CPU limit, with wall time to spare (two busy workers may give the loop half a core)
    assert run_python("while True:\n    pass", SandboxLimits(wall_s=60, cpu_s=1)).exit_code == 124
    assert run_python("print('x' * 5000)", lim).killed == "output limit"
    assert run_python("print(1)", lim).ok  # the sandbox serves the next call


def _check_attacks(result: dict) -> None:
    for name, r in result.items():
        assert name.startswith("raw_") or r["outside"].endswith(REACHED), (name, r["outside"])  # the control
        # (a traceback quotes the source line, which names REACHED: only a printed line counts)
        assert REACHED not in r["inside"].splitlines() and not r["received_inside"], (name, r)


def test_local_ipc_outside_is_unreachable(tmp_path, monkeypatch):
    dirs = {"tmp": Path(tempfile.mkdtemp(prefix="hpc-rl-attack-")), "run_parent": tmp_path / "runs",
            "workdir": tmp_path / "work", "home": tmp_path / "home"}
    for d in dirs.values():
        d.mkdir(exist_ok=True)
    monkeypatch.chdir(dirs["workdir"])
    monkeypatch.setenv("HOME", str(dirs["home"]))
    try:
        result = run_attacks(dirs, [dirs["run_parent"] / "run", dirs["run_parent"]])
    finally:
        shutil.rmtree(dirs["tmp"])
    assert len(result) >= 17
    _check_attacks(result)


def test_process_cap_and_unreadable_files_as_root(tmp_path):
    secret = _root_only_file()
    try:
        res = limits_and_files([tmp_path], [secret, "/etc/shadow"])
    finally:
        os.unlink(secret)
    _check_limits(res, secret, tmp_path)  # root's calls run as nobody: root's own files are not theirs


def _root_only_file() -> str:
    # In a folder every call sees (the system's), so that only the file's mode keeps it from the code.
    fd, path = tempfile.mkstemp(prefix="hpc-rl-sandbox-secret-", dir="/usr/local/share")
    os.write(fd, SECRET.encode())
    os.close(fd)
    os.chmod(path, 0o600)
    return path


def _check_limits(res: dict, secret: str, hidden: Path) -> None:
    assert "BlockingIOError: [Errno 11] Resource temporarily unavailable" in res["fork_bomb"]["output"], res
    assert res["fork_bomb"]["killed"] is None  # the cap stopped it, not the wall time
    for f in (secret, "/etc/shadow"):
        assert "PermissionError" in res["reads"][f][0], res["reads"]
    assert "FileNotFoundError" in res["reads"][str(hidden)][0], res["reads"]
    assert res["identity"].split()[1:] == ["1", "['0',", "'1',", "'2',", "'3']"], res["identity"]


@pytest.fixture
def unprivileged_user():
    """A user made for this test (useradd as root), removed afterwards; its home and a copy of hpc_rl it can read."""
    name = f"hpcrl-sbx-{os.getpid()}"
    base = Path(tempfile.mkdtemp(prefix="hpc-rl-unpriv-"))
    os.chmod(base, 0o755)
    subprocess.run(["useradd", "--no-create-home", "--home-dir", str(base / "home"), "--shell", "/usr/sbin/nologin",
                    name], check=True, capture_output=True)
    try:
        pw = pwd.getpwnam(name)
        shutil.copytree(REPO / "hpc_rl", base / "lib" / "hpc_rl", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(REPO / "tests" / "sandbox_attacks.py", base / "lib")
        for sub in ("home", "run_parent", "workdir"):
            (base / sub).mkdir()
            os.chown(base / sub, pw.pw_uid, pw.pw_gid)
        yield pw, base
    finally:
        subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True)
        subprocess.run(["userdel", name], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def test_the_sandbox_as_an_unprivileged_user(unprivileged_user):
    assert Path(SYSTEM_PYTHON).exists(), "install Debian's python3 (install.sh --with-test-cluster does)"
    pw, base = unprivileged_user
    secret = _root_only_file()
    cmd = ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups", "--", SYSTEM_PYTHON,
           str(base / "lib" / "sandbox_attacks.py"), str(base), json.dumps([secret, "/etc/shadow"])]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(base / "home"), "PYTHONPATH": str(base / "lib"), "LANG": "C.UTF-8"}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=base / "workdir")
    finally:
        os.unlink(secret)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["uid"] == pw.pw_uid
    _check_attacks(res["attacks"])
    _check_limits(res["limits"], secret, base / "run_parent")
    assert res["limits"]["identity"].split()[1] == "1"  # PID 1 of its own namespace


REQUIRE_ISOLATION = """
import json
from hpc_rl.errors import ConfigError
from hpc_rl.rollout.environments.sandbox import SandboxLimits, namespaces_available, run_python
out = {"why": namespaces_available()}
try:
    run_python("print(1)", SandboxLimits())
    out["required"] = "ran"
except ConfigError as e:
    out["required"] = str(e)
r = run_python("import socket\\nprint(1, flush=True)\\nsocket.socket(socket.AF_UNIX)", SandboxLimits(), require_isolation=False)
out["plain"] = [r.isolated, r.output.strip().splitlines()[0], r.output.strip().splitlines()[-1]]
print(json.dumps(out))
"""


def test_require_isolation_where_user_namespaces_are_off():
    # A user namespace whose max_user_namespaces is 0 stands for a cluster that disables them.
    p = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c",
                        f"echo 0 > /proc/sys/user/max_user_namespaces && exec {sys.executable} -c '{REQUIRE_ISOLATION}'"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["why"] and "user namespaces are not available" in out["why"]
    assert out["required"].startswith("rollout.sandbox.require_isolation: cannot isolate"), out
    assert "\n" not in out["required"]
    assert out["plain"][:2] == [False, "1"] and out["plain"][2].startswith("PermissionError"), out  # seccomp holds


def test_listeners_record_what_reaches_them():
    # The attack harness itself: a plain connection from here is seen (so "not received" above means something).
    import socket

    with tempfile.TemporaryDirectory() as d, listeners({"x": Path(d)}) as (targets, got):
        s = socket.socket(socket.AF_UNIX)
        s.connect(targets["unix_x"][1])
        s.close()
        for _ in range(50):
            if got:
                break
            threading.Event().wait(0.05)
        assert got == ["unix_x"]


@pytest.mark.slow
def test_hostile_code_corpus_in_a_run(tmp_path):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_rsa").write_text(SECRET)
    outside = tmp_path / "outside" / "pwned.txt"
    outside.parent.mkdir()
    log = tmp_path / "observations.jsonl"
    runs = tmp_path / "runs"
    runs.mkdir()
    env = {"HOME": str(home), "PYTHONPATH": str(REPO)}
    # Listeners on path sockets in the temp dir, the folder of runs, the run's working directory and $HOME, and a
    # FIFO outside: the corpus's unix_sockets and fifo cases try them all.
    tmp_dir = Path(tempfile.mkdtemp(prefix="hpc-rl-attack-"))
    dirs = {"tmp": tmp_dir, "run_parent": runs, "workdir": tmp_path, "home": home}
    try:
        with listeners(dirs) as (targets, got):
            sockets = [targets[f"unix_{k}"][1] for k in dirs]
            r = subprocess.run(
                [sys.executable, "-m", "hpc_rl.cli", "run", str(REPO / "jobs" / "toy-tool-cpu.yaml"),
                 "checkpoint.every=0", "trainer.steps=2", "trainer.prompts_per_step=8", "algorithm.group_size=2",
                 "trainer.mini_batch_size=16", "rollout.env=tests.envs:HostileEnv",
                 f"rollout.env_kwargs={{log: {log}, outside: {outside}, sockets: {json.dumps(sockets)}, "
                 f"fifo: {targets['fifo_write'][1]}}}", "rollout.tool_timeout_s=20",
                 "rollout.sandbox.wall_s=4", "rollout.sandbox.cpu_s=2", "rollout.sandbox.memory_mb=512"],
                capture_output=True, text=True, cwd=tmp_path, timeout=900,
                env={**os.environ, **env, "PYTHONUNBUFFERED": "1"})
            received = list(got)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert received == []
    run = only_run(tmp_path)
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    # Training (2 steps x 16 episodes) and the job's evaluations (before the first step and after the last, 32 held-out
    # prompts each) all run the corpus.
    assert len(rows) == 2 * 16 + 2 * 32 and {x["case"] for x in rows} == set(HOSTILE_NAMES)
    token = (run / "token").read_text()
    for x in rows:
        obs = x["observation"]
        assert "\n" not in obs and obs.startswith("error: python: "), x
        assert token not in obs and SECRET not in obs and "connected" not in obs and "wrote" not in obs, x
    by_case = {x["case"]: x["observation"] for x in rows}
    assert "Resource temporarily unavailable" in by_case["fork_bomb"]
    assert "CPU time limit" in by_case["infinite_loop"] or "wall time" in by_case["infinite_loop"]
    assert "MemoryError" in by_case["alloc_10gb"]
    assert "output exceeded" in by_case["output_100mb"]
    assert "Read-only file system" in by_case["write_outside"] or "No such file" in by_case["write_outside"]
    assert "No such file" in by_case["read_token"] and "No such file" in by_case["read_ssh"]
    assert "unreachable" in by_case["socket_loopback"] and "unreachable" in by_case["socket_server"]
    assert "ProcessLookupError" in by_case["kill_parent"]
    assert "refused: 1 1 1" in by_case["ctypes"]
    assert "unreachable: PermissionError" in by_case["unix_sockets"]
    assert "FileNotFoundError" in by_case["fifo"]
    assert not outside.exists()
    assert (home / ".ssh" / "id_rsa").read_text() == SECRET and (run / "token").read_text() == token
    metrics = read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]  # the trainer and the server went on to the next step
    assert all(m["tool_errors"] == 16 and m["tool_calls_per_sample"] == 1.0 for m in metrics)


def test_a_sandbox_whose_own_limit_is_hit_is_replaced():
    # Its pids cgroup full (CI runs as root, where one is made: see the layers test), it cannot fork a call: that
    # call fails as a setup failure and the next one gets a new sandbox process.
    from hpc_rl.rollout.environments.sandbox import Sandbox

    sb = Sandbox([])
    try:
        assert sb.run("print(1)", SandboxLimits()).ok and sb._cgroup is not None
        (sb._cgroup / "pids.max").write_text("2")
        r = sb.run("print(2)", SandboxLimits())
        assert r.killed == "sandbox setup" and "Resource temporarily unavailable" in r.output, r
        r = sb.run("print(3)", SandboxLimits())
        assert r.ok and r.output.strip() == "3" and sb.starts == 2, r
    finally:
        sb.close()


def test_the_python_tools_error_line_is_the_exception_not_an_interleaved_traceback_start():
    from hpc_rl.rollout.environments.tools import ToolContext, _error_line, python_tool

    lines = ["Traceback (most recent call last):", "BlockingIOError: [Errno 11] Resource temporarily unavailable",
             "Traceback (most recent call last):", '  File "main.py", line 3, in <module>']
    assert _error_line(lines) == "BlockingIOError: [Errno 11] Resource temporarily unavailable"
    assert _error_line(["unreachable: PermissionError"]) == "unreachable: PermissionError"  # SystemExit("...")
    assert python_tool({"code": "import json\njson.loads('x')"}, ToolContext()) == \
        "error: python: json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)"
