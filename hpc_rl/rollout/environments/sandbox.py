"""Run model-written Python in a sandbox: its own process, kernel namespaces where the machine allows them, rlimits.

Layers, and what each guarantees (and does not):

- **A process of its own** (`python -I`: no user site-packages, no PYTHON* variables), in a fresh temporary working
  directory that is deleted afterwards, with an environment of HOME=TMPDIR=that directory and PATH only. A crash,
  `sys.exit` or `os._exit` ends that process, never the caller.
- **rlimits**: CPU seconds, address space (a 10 GB allocation is a MemoryError), processes (a fork bomb stops at
  the limit), file size (writes past it fail), open files, no core files. They bound one process each (the address
  space limit is per process, so N processes may use N x the limit: the process limit bounds N). The kernel does not
  enforce the process limit for real uid 0; where this process may make a pids cgroup (root with cgroup v1, a
  delegated v2 subtree) the sandbox gets one capped at the same count, which holds for root too.
- **Wall time and output size**, enforced by the caller: past `wall_s`, or past `output_bytes` of stdout+stderr,
  everything the sandbox started is killed (its PID namespace, else its process group).
- **Namespaces** (`unshare` of util-linux in a user namespace; no root needed, as the local Slurm cluster of the
  tests uses them): a network namespace with only a down loopback (no socket reaches 127.0.0.1 or any other address),
  a PID namespace (the code sees only its own processes: it cannot signal the trainer or the rollout server, and all
  of it dies with the sandbox), an IPC namespace, and a mount namespace in which every mount is read-only except
  the working directory, and the hidden paths (the run directory, which holds the token; the user's home, except
  the folders that hold Python itself) are covered by empty read-only mounts. The code then runs in a nested user
  namespace without capabilities, so it cannot unmount or remount any of that.
- Not provided: a seccomp filter (no maintained Python library ships one as a wheel: libseccomp's bindings come
  from the distribution), cgroup memory limits (a user's Slurm job has its own cgroup; a nested one needs
  delegation). Files this user can read outside the hidden paths stay readable (read-only): the Python installation,
  datasets, other users' world-readable files.

Without user namespaces (some clusters disable them: /proc/sys/user/max_user_namespaces is 0) only the process,
rlimits, wall time and output limits apply; `rollout.sandbox.require_isolation` (default true) then refuses to run
model code at all, and `hpc-rl doctor` says so.
"""

from __future__ import annotations

import functools
import itertools
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ...errors import ConfigError

# Run inside the sandbox before the model's code: ctypes would let code call libc directly (the namespaces still
# hold, but there is no reason to offer it).
_BOOT = """\
import os, signal, sys
def _xcpu(*_):
    sys.stderr.write("CPU time limit exceeded\\n")
    os._exit(124)
signal.signal(signal.SIGXCPU, _xcpu)
del _xcpu
for _m in ("ctypes", "_ctypes"):
    sys.modules[_m] = None
del _m
sys.argv = ["main.py"]
import runpy
runpy.run_path("main.py", run_name="__main__")
"""

# The mount-namespace setup, run as root of a new user namespace (python -I -S: our code, not the model's): hide
# paths, make every mount read-only except the working directory, then enter a nested user namespace without
# capabilities (which locks all of that) and run the boot script. One process and mount(2) calls: a shell running
# `mount` per mount point cost ~0.5 s a call.
_SETUP = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
KEEP = ((os.ST_NOSUID, NOSUID), (os.ST_NODEV, NODEV), (os.ST_NOEXEC, NOEXEC), (1024, 1024), (2048, 2048),
        (4096, 1 << 21))
def mount(src, target, fstype, flags, data=None, strict=True):
    enc = lambda x: None if x is None else x.encode()
    if libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)) != 0 and strict:
        sys.stderr.write(f"sandbox setup: mount {target}: {os.strerror(ctypes.get_errno())}\n")
        os._exit(97)
work, rest = sys.argv[1], sys.argv[2:]
cut = rest.index("--")
hidden, cmd = rest[:cut], rest[cut + 1:]
mount(None, "/", None, REC | PRIVATE)
for p in hidden:
    if os.path.isdir(p):
        mount("hpc-rl-hidden", p, "tmpfs", RDONLY | NOSUID | NODEV, "size=4k,mode=0555")
    elif os.path.exists(p):
        mount("/dev/null", p, None, BIND)
mount(work, work, None, BIND)
for line in open("/proc/self/mountinfo"):
    m = line.split()[4].encode().decode("unicode_escape")
    if m == work or m == "/proc" or m.startswith("/proc/"):
        continue
    try:
        have = os.statvfs(m).f_flag
    except OSError:
        continue
    # A remount must keep the flags the parent namespace locked (nosuid, nodev, ...), or the kernel refuses it.
    flags = REMOUNT | BIND | RDONLY | sum(ms for st, ms in KEEP if have & st)
    mount(None, m, None, flags, strict=False)
os.chdir(work)
if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER: the code keeps no capability over these mounts
    sys.stderr.write("sandbox setup: unshare: " + os.strerror(ctypes.get_errno()) + "\n")
    os._exit(97)
os.execv(cmd[0], cmd)
"""

# Sandboxes running at once in this process: more than the cores only stretches each one's wall time (the model's
# code is CPU-bound); the others queue (their wait counts against rollout.tool_timeout_s, not the sandbox's).
_SLOTS = threading.BoundedSemaphore(max(2, len(os.sched_getaffinity(0))))
_CGROUP_IDS = itertools.count()

NAMESPACE_FLAGS = ["--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--mount", "--ipc",
                   "--mount-proc"]
SETUP_FAILED = 97


@dataclass
class SandboxLimits:
    """Limits of one sandboxed run."""

    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    processes: int = 16
    output_bytes: int = 8192
    file_bytes: int = 1 << 20
    open_files: int = 64


@dataclass
class SandboxResult:
    """stdout+stderr (cut at the limit), the exit code, and why it ended when not by itself."""

    output: str
    exit_code: int | None
    killed: str | None  # "wall time", "output limit" or None
    seconds: float
    isolated: bool

    @property
    def ok(self) -> bool:
        return self.killed is None and self.exit_code == 0


@functools.lru_cache(maxsize=1)
def namespaces_available() -> str | None:
    """None when user/net/pid/mount namespaces work here, else why not (one line)."""
    exe = shutil.which("unshare")
    if exe is None:
        return "the unshare command (util-linux) is not installed"
    try:
        p = subprocess.run([exe, *NAMESPACE_FLAGS, "sh", "-c", "mount -t tmpfs none /mnt 2>/dev/null || "
                            "mount -t tmpfs none /tmp; exec unshare --user true"],
                           capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare failed: {e}"
    if p.returncode != 0:
        msg = (p.stderr.decode(errors="replace").strip().splitlines() or ["no message"])[-1]
        return f"user namespaces are not available ({msg}); see /proc/sys/user/max_user_namespaces"
    return None


def hidden_paths(extra: list[str | Path]) -> list[Path]:
    """`extra` (e.g. the run dir and the folder of runs) and the user's home; where Python itself lives under a
    hidden folder, that folder's other entries are hidden one by one instead."""
    keep = [Path(p).resolve() for p in {sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable))}]
    out: list[Path] = []
    for p in [*map(Path, extra), Path.home()]:
        p = p.resolve()
        if not p.exists() or p == Path("/"):
            continue
        inside = [k for k in keep if k == p or p in k.parents]
        if not inside:
            out.append(p)
            continue
        out.extend(_hide_around(p, inside))
    return sorted(set(out))


def _hide_around(folder: Path, keep: list[Path]) -> list[Path]:
    """Every entry of `folder` except the ones on the way to the `keep` paths (recursively)."""
    out = []
    for child in folder.iterdir():
        on_way = [k for k in keep if k == child or child in k.parents]
        if not on_way:
            out.append(child)
        elif child not in on_way and child.is_dir() and not child.is_symlink():
            out.extend(_hide_around(child, on_way))
    return out


def _work_base(hidden: list[Path]) -> str:
    """Where the working directory goes: the temp dir, unless a hidden path covers it (e.g. runs written to /tmp),
    then /dev/shm."""
    for base in (tempfile.gettempdir(), "/dev/shm"):
        b = Path(base).resolve()
        if not any(h == b or h in b.parents for h in hidden):
            return str(b)
    raise ConfigError("rollout.sandbox: the temp dir and /dev/shm are both hidden from the sandbox (the run dir or "
                      "its parent covers them); set output_dir elsewhere or TMPDIR to a folder outside it")


def _pids_cgroup(processes: int) -> Path | None:
    """A pids cgroup of its own capped at `processes`, beside this process's (cgroup v1, or a delegated v2
    subtree); None where this user may not make one (then RLIMIT_NPROC bounds the count, except for root)."""
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        own[ctrls] = path
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        fstype, _, opts = (post.split() + ["", "", ""])[:3]
        if fstype == "cgroup" and "pids" in opts.split(","):
            mounts.append((Path(pre.split()[4]), own.get("pids")))
        elif fstype == "cgroup2":
            mounts.append((Path(pre.split()[4]), own.get("")))
    for mount, path in mounts:
        if path is None:
            continue
        cg = mount / path.lstrip("/") / f"hpc-rl-sandbox-{os.getpid()}-{next(_CGROUP_IDS)}"
        try:
            cg.mkdir()
        except OSError:
            continue
        try:
            (cg / "pids.max").write_text(str(processes))
            return cg
        except OSError:
            _remove_cgroup(cg)
    return None


def _remove_cgroup(cg: Path | None) -> None:
    for _ in range(50):  # the last processes of a killed PID namespace take a moment to go
        try:
            if cg is not None:
                cg.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)


def _limit(limits: SandboxLimits, cgroup: Path | None):
    def preexec():
        os.setsid()
        if cgroup is not None:
            with open(cgroup / "cgroup.procs", "w") as f:
                f.write(str(os.getpid()))
        mem = limits.memory_mb * 2**20
        for res, value in ((resource.RLIMIT_CPU, limits.cpu_s), (resource.RLIMIT_AS, mem),
                           (resource.RLIMIT_NPROC, limits.processes), (resource.RLIMIT_FSIZE, limits.file_bytes),
                           (resource.RLIMIT_NOFILE, limits.open_files), (resource.RLIMIT_CORE, 0)):
            # CPU: SIGXCPU at the soft limit (the boot script reports it), SIGKILL one second later.
            resource.setrlimit(res, (value, value + 1 if res == resource.RLIMIT_CPU else value))
    return preexec


def run_python(code: str, limits: SandboxLimits, hide: list[str | Path] = (), require_isolation: bool = True
               ) -> SandboxResult:
    """Run `code` as a script in the sandbox; never raises for anything the code does."""
    why = namespaces_available()
    if why is not None and require_isolation:
        raise ConfigError(f"rollout.sandbox.require_isolation: cannot isolate model-written code: {why}; enable "
                          "user namespaces or set rollout.sandbox.require_isolation: false (rlimits only)")
    hidden = hidden_paths(list(hide)) if why is None else []
    work = tempfile.mkdtemp(prefix="hpc-rl-sandbox-", dir=_work_base(hidden))
    try:
        Path(work, "main.py").write_text(code)
        cmd = [sys.executable, "-I", "-c", _BOOT]
        if why is None:
            cmd = [shutil.which("unshare"), *NAMESPACE_FLAGS, sys.executable, "-I", "-S", "-c", _SETUP, work,
                   *map(str, hidden), "--", *cmd]
        env = {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
        with _SLOTS:
            # unshare and the sandbox's first process come on top of the code's processes.
            cgroup = _pids_cgroup(limits.processes + 2)
            try:
                t0 = time.monotonic()
                proc = subprocess.Popen(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, preexec_fn=_limit(limits, cgroup), close_fds=True)
                out, killed = _collect(proc, limits)
            finally:
                _remove_cgroup(cgroup)
        code_ = proc.returncode
        if code_ == SETUP_FAILED and why is None and not out.strip():
            killed = "sandbox setup"
        return SandboxResult(out.decode(errors="replace"), code_, killed, time.monotonic() - t0, why is None)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _collect(proc: subprocess.Popen, limits: SandboxLimits) -> tuple[bytes, str | None]:
    """Read stdout until the process ends, the wall time passes or the output exceeds its limit (then kill)."""
    deadline = time.monotonic() + limits.wall_s
    buf, killed = bytearray(), None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                killed = "wall time"
                break
            if not sel.select(timeout=min(left, 0.5)):
                if proc.poll() is not None:
                    break
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            buf += chunk
            if len(buf) > limits.output_bytes:
                killed = "output limit"
                break
    finally:
        sel.close()
        if killed is not None or proc.poll() is None:
            _kill(proc)
        proc.wait()
        proc.stdout.close()
    return bytes(buf[:limits.output_bytes]), killed


def _kill(proc: subprocess.Popen) -> None:
    # The process group: unshare --kill-child takes the PID namespace (and all in it) down with it.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
