"""Run model-written Python in a sandbox: a process started once (the zygote, sandbox_zygote.py), a fresh child of
it per call, kernel namespaces, a seccomp filter, rlimits and a pids cgroup.

The sandbox process starts on the first call of a rollout worker (about 0.1 s) and stays; each call is a fork of it
(Python is already imported: about 5 ms per call here, against about 70 ms for a process per call). It is
restarted when it dies, and replaced when a call's processes outlive a kill. Layers, and what each guarantees:

- **Namespaces** (a user namespace this user may create without root, as the local Slurm cluster of the tests uses
  them): per sandbox a **network** namespace with only a down loopback (no TCP/UDP to 127.0.0.1 or anywhere else,
  no abstract UNIX socket of the host), and a **root of its own**: an empty tmpfs holding, read-only, only the
  system's folders (/usr, /bin, /sbin, /lib*, /etc) and this Python's (its prefixes and the real folder of its
  executable), a /dev with null, zero, full, random and urandom, nothing else. The old root is detached, so the
  home, the run dirs, the shared file systems, the scratch space, /run, /var and /tmp of the host are not there at
  all: a socket, FIFO or file the user keeps anywhere else cannot be named. A path the caller hides (the run dir,
  the folder of runs, the home) that lies inside an allowed folder is covered by an empty mount. Per **call**: a
  PID namespace (the code is PID 1 and sees only its own processes: it cannot signal the trainer, the rollout
  server, the sandbox process or another call, and everything it started dies with it), a mount namespace with an
  empty tmpfs as /tmp (the working directory; deleted with the call) and as /dev/shm, its own /proc, and an IPC
  namespace (no System V IPC or POSIX queue of anyone else). The code then runs in a nested user namespace without
  capabilities over any of that (no unmount or remount). Where the caller is root, calls run as nobody (65534), so
  files only root may read stay unreadable; for an unprivileged user, calls run as that user.
- **The IPC seal, a seccomp filter** (x86_64 and aarch64): socket() only for AF_INET/AF_INET6 (which reach nothing in
  the empty network namespace); no AF_UNIX socket at all except socketpair(AF_UNIX, SOCK_STREAM), which is what
  multiprocessing's pipes and queues use (a connected pair cannot be pointed at an address: EISCONN). So no path
  UNIX socket outside can be connected to even where its path is visible (a munge or slurmstepd socket, vLLM's
  ZMQ ipc:// files, W&B's service, D-Bus). Refused as well: namespaces (unshare, setns, clone with namespace flags,
  clone3), mounts (old and new API), ptrace and process_vm_*, io_uring (its SOCKET/CONNECT operations bypass the
  filter), bpf, perf_event_open, keyrings, userfaultfd, modules, kexec, reboot, swap, syslog, open_by_handle_at.
  Another architecture's system calls (x86's 32-bit and x32 entries) kill the process. This is why the seal is a
  filter and not only empty mounts: a mount cannot know where a user keeps sockets (the shared filesystem, the
  scratch space), a filter does not need to. multiprocessing.Pool/Queue/Pipe work inside; a Manager or a
  forkserver (AF_UNIX listeners) does not.
- **rlimits**: CPU seconds (SIGXCPU, reported as such), address space per process (a 10 GB allocation is a
  MemoryError), processes (a fork bomb stops at the limit: counted in the call's own user namespace, so the
  user's other processes do not count, and enforced for root's calls too since they run as nobody), file size,
  open files, no core files. /tmp and /dev/shm are each at most `SandboxLimits.tmp_bytes`.
- **A pids cgroup** per sandbox where this process may make one (root with cgroup v1, a delegated v2 subtree),
  capped at the process limit times the calls that may run at once, plus the sandbox's own two processes: a bound
  on everything the sandbox runs, whatever happens to the rlimit; elsewhere the rlimit alone.
- **Wall time and output size**, enforced by the caller: past `wall_s`, or past `output_bytes` of stdout+stderr, the
  call's PID namespace is killed (all of it).

Not guaranteed, and why:
- Reading what the allowed folders hold: the system's and Python's files (readable to the user anyway), including
  anything placed inside the Python prefix (a FIFO or socket there could be opened for reading/writing by mode;
  sockets stay sealed by the filter).
- ctypes is importable: the code can make raw system calls. Every layer above holds against them (the tests make
  them); none relies on Python-level restrictions.
- Covert channels between concurrent calls or with outside processes through shared resources: file locks on
  readable files, CPU and memory pressure, timing. No data path, but not nothing.
- Memory: the address-space limit is per process (N processes may use N x the limit; the process limit bounds N);
  no memory cgroup (a user's Slurm job has its own; a nested one needs delegation).
- Kernel bugs: the filter narrows the kernel's surface, it does not remove it.

Without user namespaces (some clusters disable them: /proc/sys/user/max_user_namespaces is 0), only a process
with rlimits and the seccomp filter remains; `rollout.sandbox.require_isolation` (default true) then refuses to
run model code at all, and `hpc-rl doctor` reports which layers are active.
"""

from __future__ import annotations

import atexit
import collections
import functools
import itertools
import json
import logging
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

from ...errors import ConfigError

log = logging.getLogger(__name__)

ZYGOTE = Path(__file__).with_name("sandbox_zygote.py")
# The folders a call sees (read-only), besides Python's own (its prefixes and the real folder of its executable).
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
NOBODY = 65534
STALE_PREFIX = "hpc-rl-sandbox-"  # + pid: the cgroups and mount points a sandbox makes
ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
START_TIMEOUT_S = 60.0
# After the wall time or a kill: how long the call's processes may take to be reaped before the sandbox is replaced.
REAP_TIMEOUT_S = 10.0
SETUP_FAILED = 97
CPU_EXCEEDED = 124

# Sandboxes running at once in this process: more than the cores only stretches each one's wall time (the model's
# code is CPU-bound); the others queue (their wait counts against rollout.tool_timeout_s, not the sandbox's).
_SLOTS_N = max(2, len(os.sched_getaffinity(0)))
_SLOTS = threading.BoundedSemaphore(_SLOTS_N)
_CGROUP_IDS = itertools.count()

NAMESPACE_FLAGS = ["--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--mount", "--ipc",
                   "--mount-proc"]


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

    @property
    def tmp_bytes(self) -> int:
        """Size of the call's /tmp (its working directory) and of its /dev/shm, each."""
        return max(16 << 20, 8 * self.file_bytes)


@dataclass
class SandboxResult:
    """stdout+stderr (cut at the limit), the exit code, and why it ended when not by itself."""

    output: str
    exit_code: int | None
    killed: str | None  # "wall time", "output limit", "sandbox setup" or None
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


@functools.lru_cache(maxsize=1)
def seccomp_unavailable() -> str | None:
    """None when the IPC seal (the seccomp filter) installs and refuses socket(AF_UNIX) here, else why not."""
    try:
        p = subprocess.run([sys.executable, "-I", "-S", str(ZYGOTE), "--check-seccomp"], capture_output=True,
                           text=True, timeout=30, env=ENV)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the seccomp check did not run: {e}"
    line = (p.stdout.strip().splitlines() or [p.stderr.strip()[-200:] or f"exit code {p.returncode}"])[-1]
    return None if line == "ok" else line


def layers() -> list[tuple[str, bool, str]]:
    """Which layers of the sandbox are active on this machine: (layer, active, one line), for `hpc-rl doctor`."""
    ns, sc = namespaces_available(), seccomp_unavailable()
    cg = _pids_cgroup(1)
    _remove_cgroup(cg)
    root = os.geteuid() == 0
    return [
        ("namespaces", ns is None, "user, network, IPC, PID and mount namespaces; the code sees a read-only root of "
         "the system's and Python's folders" if ns is None else ns),
        ("IPC seal", sc is None, "seccomp: no UNIX socket but stream socketpairs, no namespace, mount, ptrace or "
         "io_uring calls" if sc is None else sc),
        ("pids cgroup", cg is not None, "a pids cgroup per sandbox" if cg is not None else
         "no pids cgroup may be made here: RLIMIT_NPROC in the call's own user namespace bounds its processes"),
        ("unprivileged", not root or ns is None,
         (f"running as uid {os.geteuid()}: calls run as this user, without capabilities" if not root else
          "running as root: calls run as nobody (65534)" if ns is None else
          "running as root without namespaces: the code would run as root")),
    ]


def allowed_paths() -> list[str]:
    """The folders a call sees: the system's (/usr, /etc, ...) and this Python's prefixes and executable's folder."""
    paths = {p for p in SYSTEM_DIRS if os.path.lexists(p)}
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
              os.path.dirname(os.path.realpath(sys.executable)), os.path.dirname(os.path.abspath(sys.executable))):
        paths.add(os.path.abspath(p))
    return sorted(paths)


def hidden_paths(extra: list[str | Path]) -> list[str]:
    """`extra` (the run dir, the folder of runs) and the user's home, resolved. They are out of a call's view anyway
    unless they lie inside an allowed folder: then an empty mount covers them."""
    out = set()
    for p in [*map(Path, extra), Path.home()]:
        p = p.resolve()
        if p.exists() and p != Path("/"):
            out.add(str(p))
    return sorted(out)


def _cgroup_parents() -> list[Path]:
    """The folders a pids cgroup of this process's would be made in: beside its own, in each pids hierarchy
    (cgroup v1 `pids`, or cgroup v2)."""
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        own[ctrls] = path
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        fstype, _, opts = (post.split() + ["", "", ""])[:3]
        path = own.get("pids") if fstype == "cgroup" and "pids" in opts.split(",") else \
            own.get("") if fstype == "cgroup2" else None
        if path is not None:
            out.append(Path(pre.split()[4]) / path.lstrip("/"))
    return out


def _pids_cgroup(processes: int) -> Path | None:
    """A pids cgroup of its own capped at `processes`, beside this process's (cgroup v1, or a delegated v2
    subtree); None where this user may not make one (then RLIMIT_NPROC bounds the count)."""
    for parent in _cgroup_parents():
        cg = parent / f"{STALE_PREFIX}{os.getpid()}-{next(_CGROUP_IDS)}"
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


def _rmdir(path) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


def _sweep_stale() -> None:
    """Remove what sandboxes of processes that are gone left (killed before they could: their pids cgroups, empty
    once the sandbox died with them, and setup mount points), so that a long-lived node does not collect them."""
    for place in [Path(tempfile.gettempdir()), *_cgroup_parents()]:
        try:
            entries = list(place.glob(f"{STALE_PREFIX}*"))
        except OSError:
            continue
        for d in entries:
            pid = d.name[len(STALE_PREFIX):].removeprefix("root-").split("-")[0]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                _rmdir(d)


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


_ALL: weakref.WeakSet = weakref.WeakSet()  # every Sandbox of this process, stopped at exit


class SandboxSetupError(RuntimeError):
    """The sandbox's process could not be started (its one-line reason)."""


class Sandbox:
    """One sandbox process (the zygote, sandbox_zygote.py) serving calls, each in a fresh child: started on the
    first call, restarted when it dies, replaced when a call's processes outlive a kill; stopped by `close`."""

    def __init__(self, hide: list[str | Path] = ()):
        self.hidden = hidden_paths(list(hide))
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._root: str | None = None
        self._stderr: collections.deque = collections.deque(maxlen=20)
        self._ids = itertools.count()
        self.starts = 0
        self._cgroup: Path | None = None
        self._cgroup_cap = 2 + _SLOTS_N * SandboxLimits.processes
        _ALL.add(self)

    # ------------------------------------------------------------------ the zygote's life

    def _start(self) -> None:
        _sweep_stale()
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Only a mount point while the sandbox builds its root; removed once it is ready.
        self._root = tempfile.mkdtemp(prefix=f"{STALE_PREFIX}root-{os.getpid()}-")
        uid = NOBODY if os.geteuid() == 0 else 0
        cmd = [sys.executable, "-I", "-S", str(ZYGOTE), str(child.fileno()), self._root, str(uid), *allowed_paths(),
               "--", *self.hidden]
        try:
            proc = subprocess.Popen(cmd, pass_fds=[child.fileno()], env=ENV, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        finally:
            child.close()
        self._proc, self._sock = proc, parent
        self.starts += 1
        self._cgroup = _pids_cgroup(self._cgroup_cap)
        if self._cgroup is not None:  # before the namespaces' first process: everything the sandbox starts is in it
            try:
                (self._cgroup / "cgroup.procs").write_text(str(proc.pid))
            except OSError:
                _remove_cgroup(self._cgroup)
                self._cgroup = None
        threading.Thread(target=self._drain, args=(proc,), daemon=True, name="sandbox-stderr").start()
        try:
            parent.settimeout(START_TIMEOUT_S)
            msg = parent.recv(4096)
            if msg != b"map":
                raise SandboxSetupError(self._why(msg))
            self._write_id_maps(proc.pid)
            parent.send(b"mapped")
            msg = parent.recv(4096)
            if msg != b"ready":
                raise SandboxSetupError(self._why(msg))
            parent.settimeout(None)
            _rmdir(self._root)
            self._root = None
        except (OSError, SandboxSetupError) as e:
            self._stop()
            raise SandboxSetupError(str(e) if isinstance(e, SandboxSetupError) else
                                    f"the sandbox process did not start: {e}; {self._why(b'')}") from None

    def _why(self, msg: bytes) -> str:
        text = msg.decode(errors="replace").strip()
        if text.startswith("error: "):
            return text[len("error: "):]
        tail = " | ".join(x for x in self._stderr if x.strip())[-300:]
        return f"the sandbox process ended during setup ({tail or 'no message'})"

    def _drain(self, proc: subprocess.Popen) -> None:
        for line in proc.stderr:
            self._stderr.append(line.decode(errors="replace").rstrip())

    @staticmethod
    def _write_id_maps(pid: int) -> None:
        """Root in the zygote's user namespace is this user; as root, nobody is mapped too (the calls run as it).
        An unprivileged user may map only itself, after denying setgroups."""
        base = Path(f"/proc/{pid}")
        if os.geteuid() == 0:
            (base / "uid_map").write_text(f"0 0 1\n{NOBODY} {NOBODY} 1\n")
            (base / "gid_map").write_text(f"0 0 1\n{NOBODY} {NOBODY} 1\n")
        else:
            (base / "setgroups").write_text("deny")
            (base / "uid_map").write_text(f"0 {os.geteuid()} 1\n")
            (base / "gid_map").write_text(f"0 {os.getegid()} 1\n")

    def _stop(self) -> None:
        proc, sock, root = self._proc, self._sock, self._root
        self._proc = self._sock = self._root = None
        if sock is not None:
            sock.close()
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its PID namespace (every call) dies with its PID 1
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        _remove_cgroup(self._cgroup)
        self._cgroup = None
        if root is not None:
            _rmdir(root)

    def close(self) -> None:
        """Stop the sandbox process and every call in it."""
        with self._lock:
            self._stop()

    def _send(self, msg: bytes, fds: list[int] = ()) -> None:
        with self._lock:
            if self._sock is None:
                self._start()
            socket.send_fds(self._sock, [msg], list(fds))

    # ------------------------------------------------------------------ one call

    def run(self, code: str, limits: SandboxLimits) -> SandboxResult:
        """Run `code` as main.py in a fresh child of the sandbox; never raises for anything the code does."""
        with _SLOTS:
            t0 = time.monotonic()
            for _ in range(2):
                try:
                    return self._run_once(code, limits, t0)
                except OSError as e:  # the sandbox process died (a broken socket or pipe): a new one, once
                    log.warning("the sandbox process died (%s); restarting it", e)
                    with self._lock:
                        self._stop()
                except SandboxSetupError as e:
                    log.warning("the python tool's sandbox could not be set up: %s", e)
                    return SandboxResult(f"sandbox setup: {e}", None, "sandbox setup", time.monotonic() - t0, True)
            return SandboxResult("sandbox setup: the sandbox process died twice", None, "sandbox setup",
                                 time.monotonic() - t0, True)

    def _run_once(self, code: str, limits: SandboxLimits, t0: float) -> SandboxResult:
        call_id = str(next(self._ids)).encode()
        request = os.memfd_create("hpc-rl-sandbox-call", os.MFD_CLOEXEC)
        out_r, out_w = os.pipe()
        st_r, st_w = os.pipe()
        fds = [request, out_w, st_w]
        self._fit_cgroup(limits)
        try:
            os.write(request, json.dumps({"code": code, "limits": {**asdict(limits),
                                                                    "tmp_bytes": limits.tmp_bytes}}).encode())
            os.lseek(request, 0, os.SEEK_SET)
            try:
                self._send(b"R" + call_id, fds)
            finally:
                for fd in fds:
                    os.close(fd)
            deadline = t0 + limits.wall_s
            out, killed = _collect(out_r, limits.output_bytes, deadline)
            status = None
            if killed is None:
                status = _read_status(st_r, deadline)
                if status is None:
                    killed = "wall time"
            if killed is not None:
                self._kill(call_id)
                status = _read_status(st_r, time.monotonic() + REAP_TIMEOUT_S)
                if status is None:  # the call did not go: a new sandbox process for the next ones
                    log.warning("a sandboxed call outlived its kill by %gs; replacing the sandbox", REAP_TIMEOUT_S)
                    with self._lock:
                        self._stop()
            elif status == "":  # the status pipe closed without a status: the sandbox process died
                raise BrokenPipeError("the sandbox process died during a call")
            elif status.startswith("E"):  # it could not start the call (its own limits): a new one for the next
                log.warning("the sandbox could not start a call (%s); replacing it", status[1:])
                with self._lock:
                    self._stop()
                return SandboxResult(f"sandbox setup: {status[1:]}", None, "sandbox setup", time.monotonic() - t0,
                                     True)
        finally:
            os.close(out_r)
            os.close(st_r)
        exit_code = os.waitstatus_to_exitcode(int(status)) if status else None
        if exit_code == SETUP_FAILED and not killed and out.startswith(b"sandbox setup: "):
            killed = "sandbox setup"
        return SandboxResult(out.decode(errors="replace"), exit_code, killed, time.monotonic() - t0, True)

    def _fit_cgroup(self, limits: SandboxLimits) -> None:
        """The sandbox's pids cgroup holds every call at once: its cap follows the largest process limit asked."""
        cap = 2 + _SLOTS_N * limits.processes  # the two processes of the sandbox itself, then each slot's call
        if cap > self._cgroup_cap:
            self._cgroup_cap = cap
            if self._cgroup is not None:
                try:
                    (self._cgroup / "pids.max").write_text(str(cap))
                except OSError:
                    pass

    def _kill(self, call_id: bytes) -> None:
        try:
            self._send(b"K" + call_id)
        except OSError:
            with self._lock:
                self._stop()


def _read_status(fd: int, deadline: float) -> str | None:
    """The wait status the sandbox wrote for a call ("" if it closed the pipe without one), or None at the
    deadline."""
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    buf = b""
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(timeout=left):
                return None
            chunk = os.read(fd, 64)
            if not chunk:
                return buf.decode()
            buf += chunk
    finally:
        sel.close()


def _collect(fd: int, output_bytes: int, deadline: float) -> tuple[bytes, str | None]:
    """Read `fd` until EOF (every process of the call is gone or closed it), the deadline, or past `output_bytes`."""
    buf, killed = bytearray(), None
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                killed = "wall time"
                break
            if not sel.select(timeout=left):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf += chunk
            if len(buf) > output_bytes:
                killed = "output limit"
                break
    finally:
        sel.close()
    return bytes(buf[:output_bytes]), killed


# --------------------------------------------------------------------------- without namespaces

def _run_plain(code: str, limits: SandboxLimits) -> SandboxResult:
    """No user namespaces here (rollout.sandbox.require_isolation false): a process with rlimits and the seccomp
    filter, in a temporary working directory deleted afterwards."""
    work = tempfile.mkdtemp(prefix="hpc-rl-sandbox-")
    try:
        Path(work, "main.py").write_text(code)
        with _SLOTS:
            t0 = time.monotonic()
            proc = subprocess.Popen([sys.executable, "-I", str(ZYGOTE), "--plain", work,
                                     json.dumps({**asdict(limits), "tmp_bytes": limits.tmp_bytes})], cwd=work,
                                    env={**ENV, "HOME": work, "TMPDIR": work}, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                    close_fds=True)
            try:
                out, killed = _collect(proc.stdout.fileno(), limits.output_bytes, t0 + limits.wall_s)
                if killed is None:
                    try:
                        proc.wait(timeout=max(0.0, t0 + limits.wall_s - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        killed = "wall time"
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
                proc.stdout.close()
        if proc.returncode == SETUP_FAILED and not killed and out.startswith(b"sandbox setup: "):
            killed = "sandbox setup"
        return SandboxResult(out.decode(errors="replace"), proc.returncode, killed, time.monotonic() - t0, False)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------- the entry point

_SANDBOXES: dict[tuple[str, ...], Sandbox] = {}
_SANDBOXES_LOCK = threading.Lock()


def sandbox_for(hide: list[str | Path] = ()) -> Sandbox:
    """This process's sandbox for these hidden paths (one per set: a rollout worker has one)."""
    key = tuple(hidden_paths(list(hide)))
    with _SANDBOXES_LOCK:
        if key not in _SANDBOXES:
            _SANDBOXES[key] = Sandbox(list(key))
        return _SANDBOXES[key]


@atexit.register
def close_all() -> None:
    """Stop every sandbox process of this process (and remove its cgroup)."""
    with _SANDBOXES_LOCK:
        for sb in list(_ALL):
            sb.close()
        _SANDBOXES.clear()


def run_python(code: str, limits: SandboxLimits, hide: list[str | Path] = (), require_isolation: bool = True
               ) -> SandboxResult:
    """Run `code` as a script in the sandbox; never raises for anything the code does."""
    why = namespaces_available()
    if why is not None:
        if require_isolation:
            raise ConfigError(f"rollout.sandbox.require_isolation: cannot isolate model-written code: {why}; enable "
                              "user namespaces or set rollout.sandbox.require_isolation: false (rlimits only)")
        return _run_plain(code, limits)
    return sandbox_for(hide).run(code, limits)
