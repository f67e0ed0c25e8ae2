"""The sandbox's own process (standard library only: it runs as `python -I -S` from its path, not as part of hpc_rl).

Started once per `sandbox.Sandbox` inside new user, network, IPC, PID and mount namespaces (`unshare`), it builds a
read-only root that holds only the allowed folders (the system's and Python's), pivots into it, imports Python's
site once, and then serves calls: for each it forks a child that is PID 1 of a fresh PID namespace, with a mount and
an IPC namespace of its own, an empty tmpfs as /tmp (its working directory) and as /dev/shm, its own /proc, the
call's rlimits, then a nested user namespace without capabilities over any of that and a seccomp
filter, and runs the model's code. `sandbox.py` has the guarantees, layer by layer.

Protocol on the SOCK_SEQPACKET socket (fd in argv): the parent sends b"R" + call id with the fds [request memfd
(JSON: code, limits), output pipe, status pipe], or b"K" + call id to kill a call; the zygote
writes the call's wait status as text to the status pipe when the call's PID 1 has been reaped (b"E" + why, when
it could not start the call). Setup reports b"ready" or b"error: ..." on the socket. Also `--plain WORKDIR LIMITS`:
run main.py there with rlimits and the seccomp filter only (machines without user namespaces,
rollout.sandbox.require_isolation false), and `--check-seccomp`.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import resource
import selectors
import signal
import socket
import struct
import sys

libc = ctypes.CDLL(None, use_errno=True)

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
# statvfs flags -> mount flags a remount must keep (the kernel refuses to drop flags a parent namespace locked).
KEEP_FLAGS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC), (1024, 1024),
              (2048, 2048), (4096, 1 << 21))
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWCGROUP = 0x10000000, 0x20000000, 0x40000000, 0x02000000
MNT_DETACH = 2
SETUP_FAILED = 97
CPU_EXCEEDED = 124

# --------------------------------------------------------------------------- seccomp

# System calls refused with EPERM inside the sandbox: namespaces and mounts (the layers below must stay as built),
# other processes' memory, kernel keyrings, io_uring (its SOCKET/CONNECT operations do not pass through this
# filter), BPF and perf (kernel attack surface), modules, reboot and the like.
DENIED = ("mount", "umount2", "pivot_root", "chroot", "setns", "unshare", "open_tree", "move_mount", "fsopen",
          "fsconfig", "fsmount", "fspick", "mount_setattr", "ptrace", "process_vm_readv", "process_vm_writev", "bpf",
          "perf_event_open", "keyctl", "add_key", "request_key", "userfaultfd", "io_uring_setup", "io_uring_enter",
          "io_uring_register", "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
          "open_by_handle_at", "name_to_handle_at", "acct", "swapon", "swapoff", "reboot", "syslog", "quotactl")
SYSCALLS = {  # numbers per architecture (linux/arch/*/syscall tables); AUDIT_ARCH_* for the filter's arch check
    "x86_64": {"audit_arch": 0xC000003E, "socket": 41, "socketpair": 53, "clone": 56, "clone3": 435, "mount": 165,
               "umount2": 166, "pivot_root": 155, "chroot": 161, "setns": 308, "unshare": 272, "open_tree": 428,
               "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
               "mount_setattr": 442, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "bpf": 321,
               "perf_event_open": 298, "keyctl": 250, "add_key": 248, "request_key": 249, "userfaultfd": 323,
               "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "init_module": 175,
               "finit_module": 313, "delete_module": 176, "kexec_load": 246, "kexec_file_load": 320,
               "open_by_handle_at": 304, "name_to_handle_at": 303, "acct": 163, "swapon": 167, "swapoff": 168,
               "reboot": 169, "syslog": 103, "quotactl": 179},
    "aarch64": {"audit_arch": 0xC00000B7, "socket": 198, "socketpair": 199, "clone": 220, "clone3": 435, "mount": 40,
                "umount2": 39, "pivot_root": 41, "chroot": 51, "setns": 268, "unshare": 97, "open_tree": 428,
                "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
                "mount_setattr": 442, "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "bpf": 280,
                "perf_event_open": 241, "keyctl": 219, "add_key": 217, "request_key": 218, "userfaultfd": 282,
                "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "init_module": 105,
                "finit_module": 273, "delete_module": 106, "kexec_load": 104, "kexec_file_load": 294,
                "open_by_handle_at": 265, "name_to_handle_at": 264, "acct": 89, "swapon": 224, "swapoff": 225,
                "reboot": 142, "syslog": 116, "quotactl": 60},
}
AF_UNIX, AF_INET, AF_INET6, SOCK_STREAM, SOCK_TYPE_MASK = 1, 2, 10, 1, 0xF
NAMESPACE_CLONE_FLAGS = (CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
                         | CLONE_NEWCGROUP)
RET_KILL_PROCESS, RET_ALLOW, RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
EPERM, EACCES, ENOSYS = 1, 13, 38
# classic BPF opcodes
LD_ABS, JEQ, JGE, JSET, RET, AND = 0x20, 0x15, 0x35, 0x45, 0x06, 0x54
X32_SYSCALL_BIT = 0x40000000


def seccomp_program(machine: str | None = None) -> bytes | None:
    """The filter as struct sock_filter[] for this machine's architecture; None where it has no syscall table.

    Sockets: only AF_INET/AF_INET6 (an empty network namespace) and socketpair(AF_UNIX, SOCK_STREAM) (what
    multiprocessing's pipes and queues use); socket(AF_UNIX) is refused, so no path or abstract UNIX socket can be
    reached at all (a connected stream pair cannot be pointed at an address: connect and sendto say EISCONN).
    clone with namespace flags: EPERM; clone3: ENOSYS (its flags sit in memory a filter cannot read; libc falls back
    to clone). Other architectures' system calls (x86's 32-bit entry, x32) kill the process."""
    nr = SYSCALLS.get(machine or platform.machine())
    if nr is None:
        return None
    prog: list[tuple] = []  # (code, jt, jf, k); jt/jf are label names or 0

    def op(code, k=0, jt=0, jf=0):
        prog.append((code, jt, jf, k))

    labels: dict[str, int] = {}

    def label(name):
        labels[name] = len(prog)

    op(LD_ABS, 4)  # seccomp_data.arch
    op(JEQ, nr["audit_arch"], 0, "kill")
    op(LD_ABS, 0)  # seccomp_data.nr
    if "x86" in (machine or platform.machine()):
        op(JGE, X32_SYSCALL_BIT, "kill", 0)
    op(JEQ, nr["socket"], "socket", 0)
    op(JEQ, nr["socketpair"], "socketpair", 0)
    op(JEQ, nr["clone"], "clone", 0)
    op(JEQ, nr["clone3"], "enosys", 0)
    for name in DENIED:
        op(JEQ, nr[name], "eperm", 0)
    op(RET, RET_ALLOW)
    label("socket")
    op(LD_ABS, 16)  # args[0] (low 32 bits): the address family
    op(JEQ, AF_INET, "allow", 0)
    op(JEQ, AF_INET6, "allow", "eacces")
    label("socketpair")
    op(LD_ABS, 16)
    op(JEQ, AF_UNIX, 0, "eacces")
    op(LD_ABS, 24)  # args[1]: the type (with SOCK_CLOEXEC/SOCK_NONBLOCK above the mask)
    op(AND, SOCK_TYPE_MASK)
    op(JEQ, SOCK_STREAM, "allow", "eacces")
    label("clone")
    op(LD_ABS, 16)  # args[0]: the flags
    op(JSET, NAMESPACE_CLONE_FLAGS, "eperm", "allow")
    label("allow")
    op(RET, RET_ALLOW)
    label("eperm")
    op(RET, RET_ERRNO | EPERM)
    label("eacces")
    op(RET, RET_ERRNO | EACCES)
    label("enosys")
    op(RET, RET_ERRNO | ENOSYS)
    label("kill")
    op(RET, RET_KILL_PROCESS)

    out = bytearray()
    for i, (code, jt, jf, k) in enumerate(prog):
        jumps = []
        for j in (jt, jf):
            off = labels[j] - i - 1 if isinstance(j, str) else j
            assert 0 <= off <= 255, (i, j)
            jumps.append(off)
        out += struct.pack("=HBBI", code, jumps[0], jumps[1], k)
    return bytes(out)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


_PROGRAM: list = []  # the filter, built once per process (a call's fork finds it built)


def install_seccomp() -> bool:
    """Install the filter on this process (inherited by everything it starts); False where this architecture has
    no table. Raises OSError where the kernel refuses it."""
    if not _PROGRAM:
        _PROGRAM.append(seccomp_program())
    program = _PROGRAM[0]
    if program is None:
        return False
    buf = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(len(program) // 8, ctypes.addressof(buf))
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS: required to filter without CAP_SYS_ADMIN
        _raise("prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        _raise("prctl(PR_SET_SECCOMP)")
    return True


# --------------------------------------------------------------------------- mounts and namespaces

def _raise(what: str):
    e = ctypes.get_errno()
    raise OSError(e, f"{what}: {os.strerror(e)}")


def mount(src, target, fstype, flags, data=None) -> None:
    def enc(x):
        return None if x is None else x.encode()

    if libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)) != 0:
        _raise(f"mount {target}")


def unshare(flags: int) -> None:
    if libc.unshare(flags) != 0:
        _raise("unshare")


def setns(fd: int, nstype: int) -> None:
    if libc.setns(fd, nstype) != 0:
        _raise("setns")


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _mount_points() -> list[str]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            out.append(line.split()[4].encode().decode("unicode_escape"))
    return out


def build_root(root: str, allowed: list[str], hidden: list[str]) -> None:
    """Make `root` a read-only tree of the `allowed` folders (bound at the same paths, real paths; a top-level
    symlink such as /bin -> usr/bin is recreated), minimal /dev, /proc, empty /tmp and /dev/shm; `hidden` paths
    inside an allowed folder are covered by empty mounts. Then pivot into it and drop the old root."""
    mount("hpc-rl-root", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    bound: list[str] = []
    for p in allowed:
        if os.path.dirname(p) == "/" and os.path.islink(p):  # merged /usr: /bin -> usr/bin
            os.symlink(os.readlink(p), root + p)
            continue
        real = os.path.realpath(p)
        if not os.path.exists(real) or any(_inside(real, b) for b in bound):
            continue
        # Parents are made in the root's own tmpfs: no bound folder lies above `real` (checked just above, and
        # `allowed` is sorted so that parents come first), so nothing is created on a real file system.
        if os.path.isdir(real):
            os.makedirs(root + real, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(root + real), exist_ok=True)
            open(root + real, "w").close()
        mount(real, root + real, None, MS_BIND | MS_REC)
        bound.append(real)
    for p in allowed:  # a folder reached through a symlink (/home -> /gpfs/home): the same symlink in the root
        real = os.path.realpath(p)
        if real == p or any(_inside(p, b) for b in bound) or os.path.lexists(root + p):
            continue
        parent = os.path.dirname(p)
        if os.path.realpath(root + parent).startswith(root + "/") or parent == "/":
            if not any(_inside(root + parent, root + b) for b in bound):
                os.makedirs(root + parent, exist_ok=True)
                os.symlink(real, root + p)
    for h in hidden:
        if not any(_inside(h, b) for b in bound) or not os.path.lexists(root + h):
            continue
        if os.path.isdir(root + h):
            mount("hpc-rl-hidden", root + h, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0555")
        else:
            mount("/dev/null", root + h, None, MS_BIND)
    dev = root + "/dev"
    os.makedirs(dev, exist_ok=True)
    mount("hpc-rl-dev", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
    for node in ("null", "zero", "full", "random", "urandom"):
        open(f"{dev}/{node}", "w").close()
        mount(f"/dev/{node}", f"{dev}/{node}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{dev}/{name}")
    os.mkdir(f"{dev}/shm")
    # The zygote's /proc (its own PID namespace): a call mounts its own over it, which the kernel allows only where
    # a proc mount of the namespace is already fully visible.
    os.makedirs(root + "/proc", exist_ok=True)
    mount("/proc", root + "/proc", None, MS_BIND | MS_REC)
    os.makedirs(root + "/tmp", exist_ok=True)
    for m in _mount_points():
        if not _inside(m, root) or _inside(m, root + "/proc"):
            continue
        try:
            have = os.statvfs(m).f_flag
        except OSError:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | sum(ms for st, ms in KEEP_FLAGS if have & st)
        try:
            mount(None, m, None, flags)
        except OSError:
            if _inside(root + "/dev", m) or m == root:
                raise
    os.chdir(root)
    pivot = {"x86_64": 155, "aarch64": 41}.get(platform.machine())
    if pivot is None or libc.syscall(pivot, b".", b".") != 0:
        _raise("pivot_root")
    if libc.umount2(b".", MNT_DETACH) != 0:
        _raise("umount the old root")
    os.chdir("/")


# --------------------------------------------------------------------------- one call

def _xcpu(*_):
    sys.stderr.write("CPU time limit exceeded\n")
    sys.stderr.flush()
    os._exit(CPU_EXCEEDED)


def _set_limits(limits: dict) -> None:
    mem = limits["memory_mb"] * 2**20
    for res, value in ((resource.RLIMIT_CPU, limits["cpu_s"]), (resource.RLIMIT_AS, mem),
                       (resource.RLIMIT_NPROC, limits["processes"]), (resource.RLIMIT_FSIZE, limits["file_bytes"]),
                       (resource.RLIMIT_NOFILE, limits["open_files"]), (resource.RLIMIT_CORE, 0)):
        # CPU: SIGXCPU at the soft limit (reported as such), SIGKILL one second later.
        resource.setrlimit(res, (value, value + 1 if res == resource.RLIMIT_CPU else value))


def _run_main() -> int:
    """Run ./main.py as __main__; the exit code it asks for (a traceback on stderr and 1 for an exception)."""
    import traceback

    signal.signal(signal.SIGXCPU, _xcpu)
    sys.argv = ["main.py"]
    try:
        with open("main.py", "rb") as f:
            code = compile(f.read(), "main.py", "exec")
        main = type(sys)("__main__")
        main.__file__ = "main.py"
        sys.modules["__main__"] = main
        exec(code, main.__dict__)
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException as e:  # noqa: BLE001 (the model's exception is its output)
        # Without this module's frames: the traceback starts at main.py, as `python main.py` would print it.
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        traceback.print_exception(type(e), e, tb)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 (a closed or broken stream: nothing more to say)
            pass
    return status


def _call(request_fd: int, out_fd: int, uid: int) -> None:
    """The child: PID 1 of its own PID namespace; runs as `uid` of the zygote's user namespace. Never returns."""
    try:
        with os.fdopen(request_fd, "rb") as f:
            req = json.loads(f.read())
        limits = req["limits"]
        os.setsid()
        unshare(CLONE_NEWNS | CLONE_NEWIPC)
        fs = f"size={limits['tmp_bytes']},nr_inodes=4096,uid={uid},gid={uid}"
        mount("hpc-rl-tmp", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0700,{fs}")
        mount("hpc-rl-shm", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0700,{fs}")
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.closerange(3, 1 << 16)
        os.chdir("/tmp")
        with open("main.py", "w") as f:
            f.write(req["code"])
        sys.stdout = open(1, "w", closefd=False, errors="backslashreplace")
        sys.stderr = open(2, "w", closefd=False, errors="backslashreplace", buffering=1)
        if uid != 0:  # the parent runs as root: the code runs as nobody, so root's files are not its own
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        _set_limits(limits)
        # A nested user namespace: the code holds no capability over the namespaces and mounts above.
        unshare(CLONE_NEWUSER)
        install_seccomp()
    except BaseException as e:  # noqa: BLE001
        try:
            os.write(2, f"sandbox setup: {e}\n".encode())
        finally:
            os._exit(SETUP_FAILED)
    os._exit(_run_main())


# --------------------------------------------------------------------------- the serving loop

def serve(sock: socket.socket, uid: int) -> None:
    own_pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY)
    # Calls are reaped on SIGCHLD through a wakeup pipe (pidfds would need Linux 5.3; RHEL 8 clusters run 4.18).
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ, "request")
    sel.register(wake_r, selectors.EVENT_READ, "reap")
    calls: dict[str, tuple[int, int]] = {}  # call id -> (pid, status fd)
    by_pid: dict[int, str] = {}
    while True:
        for key, _ in sel.select():
            if key.data == "reap":
                while os.read(wake_r, 4096) == 4096:
                    pass
                _reap(calls, by_pid)
                continue
            msg, fds, _, _ = socket.recv_fds(sock, 4096, 3)
            if not msg:  # the parent is gone: so are its calls (they die with this PID namespace)
                return
            kind, call_id = msg[:1], msg[1:].decode()
            if kind == b"K":
                if call_id in calls:
                    try:
                        os.kill(calls[call_id][0], signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                continue
            request_fd, out_fd, status_fd = fds
            try:
                unshare(CLONE_NEWPID)
                pid = os.fork()
            except OSError as e:  # a limit of the sandbox itself (its pids cgroup, memory): the parent replaces it
                pid, failure = None, e
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _call(request_fd, out_fd, uid)
            setns(own_pid_ns, CLONE_NEWPID)  # the next fork starts a fresh namespace again
            for fd in (request_fd, out_fd):
                os.close(fd)
            if pid is None:
                os.write(status_fd, f"E{failure}".encode()[:500])
                os.close(status_fd)
                continue
            calls[call_id] = (pid, status_fd)
            by_pid[pid] = call_id
            _reap(calls, by_pid)  # one that ended before it was registered


def _reap(calls: dict, by_pid: dict) -> None:
    """Write the wait status of every call that has ended to its status pipe."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        call_id = by_pid.pop(pid, None)
        if call_id is None:
            continue
        _, status_fd = calls.pop(call_id)
        try:
            os.write(status_fd, str(status).encode())
        except OSError:  # the parent stopped waiting for this call
            pass
        os.close(status_fd)


def zygote_main(argv: list[str]) -> None:
    """A user namespace (the parent writes its id maps), then network, IPC, mount and PID namespaces; this process
    waits while its child, PID 1 of the new PID namespace, builds the root and serves calls."""
    sock = socket.socket(fileno=int(argv[0]))
    root, uid = argv[1], int(argv[2])
    rest = argv[3:]
    cut = rest.index("--")
    allowed, hidden = sorted(rest[:cut]), rest[cut + 1:]
    try:
        unshare(CLONE_NEWUSER)
        sock.send(b"map")
        if sock.recv(16) != b"mapped":
            os._exit(SETUP_FAILED)
        unshare(CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWNS | CLONE_NEWPID)
    except BaseException as e:  # noqa: BLE001
        sock.send(f"error: {e}".encode()[:4000])
        os._exit(SETUP_FAILED)
    pid = os.fork()
    if pid:
        sock.close()  # PID 1 below sees the parent's end close when the parent goes
        _, status = os.waitpid(pid, 0)
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
    try:
        if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG: die with the waiting parent
            _raise("prctl(PR_SET_PDEATHSIG)")
        mount(None, "/", None, MS_REC | MS_PRIVATE)
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # this PID namespace's
        build_root(root, allowed, hidden)
        _PROGRAM.append(seccomp_program())  # built here once, not per call (and a broken table fails here)
        import site  # the site-packages of this Python, as `python -I` has them (paths inside the new root)
        site.main()
        import traceback  # noqa: F401 (imported once here, not in every call)
    except BaseException as e:  # noqa: BLE001
        sock.send(f"error: {e}".encode()[:4000])
        os._exit(SETUP_FAILED)
    import gc
    gc.collect()
    gc.freeze()  # a call's collections then skip the zygote's objects: no copy-on-write of its whole heap
    sock.send(b"ready")
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    serve(sock, uid)


def plain_main(argv: list[str]) -> None:
    """No namespaces here: rlimits (argv[1], JSON) and the filter, then ./main.py in argv[0]."""
    os.chdir(argv[0])
    try:
        _set_limits(json.loads(argv[1]))
        install_seccomp()
    except OSError as e:
        sys.stderr.write(f"sandbox setup: {e}\n")
        os._exit(SETUP_FAILED)
    os._exit(_run_main())


if __name__ == "__main__":
    if sys.argv[1] == "--plain":
        plain_main(sys.argv[2:])
    elif sys.argv[1] == "--check-seccomp":  # one line: "ok" or what does not work
        try:
            if not install_seccomp():
                print(f"no system call table for {platform.machine()}")
                sys.exit(0)
        except OSError as e:
            print(f"the kernel refused the filter: {e}")
            sys.exit(0)
        try:
            socket.socket(socket.AF_UNIX)
            print("socket(AF_UNIX) was allowed behind the filter")
        except PermissionError:
            print("ok")
    else:
        zygote_main(sys.argv[1:])
