"""Local channels to processes outside the sandbox, each opened by a real listener out here, and model-written code
that tries to reach them. Standard library and hpc_rl's sandbox module only: tests/test_sandbox.py runs it in its own
process as root, and as an unprivileged user with the system's python3 (`python3 sandbox_attacks.py DIR`, printing
one JSON object).

Every attack also runs outside the sandbox first, as a plain process of the same user against the same listeners:
there it must reach its target (else the listener is broken and the sandbox's "unreachable" would prove nothing).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REACHED = "REACHED"
SHM_NAME = "hpc-rl-attack-shm"
SYSV_KEY = 0x48525053  # an IPC key for the System V segment made outside

# {target}: the listener's path. Each prints REACHED when the channel works, else raises (its last line).
CONNECT = "import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({target!r})\nprint('REACHED')"
DGRAM_PAIR = ("import socket\na, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
              "a.sendto(b'x', {target!r})\nprint('REACHED')")
FIFO_WRITE = "import os\nfd = os.open({target!r}, os.O_WRONLY | os.O_NONBLOCK)\nos.write(fd, b'x')\nprint('REACHED')"
FIFO_READ = "import os\nfd = os.open({target!r}, os.O_RDONLY | os.O_NONBLOCK)\nprint('REACHED')"
# (by path: multiprocessing's SharedMemory would have the control's resource tracker unlink the object)
SHM = "print('REACHED' if open('/dev/shm/' + {target!r}, 'rb').read(6) == b'secret' else 'other')"
SYSV = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nid_ = libc.shmget({target}, 0, 0)\n"
        "assert id_ >= 0, 'shmget: errno %d' % ctypes.get_errno()\nprint('REACHED')")
ABSTRACT = "import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({target!r})\nprint('REACHED')"

# Raw system calls (ctypes is importable inside: no layer relies on it being absent). Each prints REACHED if the
# kernel let the call through.
RAW = {
    "unshare_user": "libc.unshare(0x10000000)",
    "mount_tmpfs": "libc.mount(b'x', b'/tmp', b'tmpfs', 0, None)",
    "umount_proc": "libc.umount2(b'/proc', 2)",
    "setns_pid1_net": "libc.setns(os.open('/proc/1/ns/net', os.O_RDONLY), 0)",
    "io_uring_setup": "libc.syscall(425, 8, ctypes.create_string_buffer(120))",
    "ptrace_attach_1": "libc.ptrace(16, 1, 0, 0)",
    "keyctl_session": "libc.syscall(250 if platform.machine() == 'x86_64' else 219, 1, 0)",
    "bpf": "libc.syscall(321 if platform.machine() == 'x86_64' else 280, 0, 0, 0)",
}
RAW_CODE = ("import ctypes, os, platform\nlibc = ctypes.CDLL(None, use_errno=True)\nr = {call}\n"
            "print('REACHED' if r >= 0 else 'refused errno %d' % ctypes.get_errno())")


@contextlib.contextmanager
def listeners(dirs: dict[str, Path]):
    """A UNIX stream listener in each folder of `dirs`, a datagram socket, an abstract socket, a FIFO that holds
    data, a POSIX shared memory object and a System V segment; yields {attack name: (template, target)} and a
    list of what the listeners received."""
    got: list[str] = []
    socks, targets, threads, stop = [], {}, [], threading.Event()
    fifo_dir = Path(tempfile.mkdtemp(prefix="hpc-rl-attack-fifo-"))
    os.chmod(fifo_dir, 0o755)

    def accept(s: socket.socket, name: str):
        s.settimeout(0.2)
        while not stop.is_set():
            try:
                c, _ = s.accept()
                got.append(name)
                c.close()
            except TimeoutError:
                continue
            except OSError:
                return

    def serve(name: str, s: socket.socket):
        s.listen(8)
        t = threading.Thread(target=accept, args=(s, name), daemon=True)
        t.start()
        threads.append(t)

    for where, d in dirs.items():
        path = str(d / f"hpc-rl-attack-{where}.sock")
        s = socket.socket(socket.AF_UNIX)
        s.bind(path)
        os.chmod(path, 0o777)
        socks.append(s)
        serve(f"unix_{where}", s)
        targets[f"unix_{where}"] = (CONNECT, path)
    abstract = f"\0hpc-rl-attack-{os.getpid()}"
    s = socket.socket(socket.AF_UNIX)
    s.bind(abstract)
    socks.append(s)
    serve("abstract", s)
    targets["abstract_socket"] = (ABSTRACT, abstract)
    dgram = str(fifo_dir / "dgram.sock")
    d = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    d.bind(dgram)
    os.chmod(dgram, 0o777)
    socks.append(d)
    targets["dgram_via_socketpair"] = (DGRAM_PAIR, dgram)
    fifo = str(fifo_dir / "fifo")
    os.mkfifo(fifo, 0o666)
    holder = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # a reader is always there (a writer's open succeeds)
    targets["fifo_write"] = (FIFO_WRITE, fifo)
    targets["fifo_read"] = (FIFO_READ, fifo)
    shm = Path("/dev/shm") / f"{SHM_NAME}-{os.getpid()}"
    shm.write_bytes(b"secret" + bytes(4090))
    os.chmod(shm, 0o666)
    targets["dev_shm"] = (SHM, shm.name)
    libc = ctypes.CDLL(None, use_errno=True)
    key = SYSV_KEY + os.getpid()
    seg = libc.shmget(key, 4096, 0o1000 | 0o666)  # IPC_CREAT
    if seg < 0:
        raise OSError(ctypes.get_errno(), "shmget")
    targets["sysv_shm"] = (SYSV, key)
    for name, call in RAW.items():
        targets[f"raw_{name}"] = (RAW_CODE.replace("{call}", call), None)
    try:
        yield targets, got
    finally:
        stop.set()
        for s in socks:
            s.close()
        os.close(holder)
        shm.unlink(missing_ok=True)
        libc.shmctl(seg, 0, None)  # IPC_RMID
        for t in threads:
            t.join(2)
        for p in fifo_dir.iterdir():
            p.unlink()
        fifo_dir.rmdir()
        for d in dirs.values():
            for p in d.glob("hpc-rl-attack-*.sock"):
                p.unlink()


def attack_code(template: str, target) -> str:
    return template.format(target=target) if target is not None else template


def outside(code: str) -> str:
    """Run `code` as a plain process of this user (no sandbox): the control."""
    p = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=30)
    return (p.stdout + p.stderr).strip()


def run_attacks(dirs: dict[str, Path], hide: list[Path], extra: dict[str, tuple[str, object]] | None = None) -> dict:
    """{attack: {"outside": output, "inside": output, "exit": code}} plus what the listeners received from inside."""
    from hpc_rl.rollout.environments.sandbox import SandboxLimits, run_python

    out: dict = {}
    with listeners(dirs) as (targets, got):
        targets.update(extra or {})
        for name, (template, target) in targets.items():
            code = attack_code(template, target)
            n_before = len(got)
            ctl = outside(code) if not name.startswith("raw_") else REACHED
            if name.startswith(("unix_", "abstract")) and ctl.endswith(REACHED):
                deadline = time.monotonic() + 10  # the listener's thread records the control's connection
                while len(got) == n_before and time.monotonic() < deadline:
                    time.sleep(0.01)
            n_before = len(got)
            r = run_python(code, SandboxLimits(wall_s=10), hide)
            time.sleep(0.05)
            out[name] = {"outside": ctl[-300:], "inside": r.output.strip()[-300:], "exit": r.exit_code,
                         "killed": r.killed, "received_inside": len(got) > n_before}
    return out


def limits_and_files(hide: list[Path], secret_files: list[str]) -> dict:
    """The process cap, unreadable files, hidden paths, and what a call sees as itself."""
    from hpc_rl.rollout.environments.sandbox import SandboxLimits, run_python

    lim = SandboxLimits(wall_s=20, processes=8)
    res = {}
    bomb = run_python("import os, time\nwhile True:\n    os.fork()", lim)
    res["fork_bomb"] = {"output": bomb.output[-2000:], "killed": bomb.killed,
                        "exit": bomb.exit_code, "seconds": bomb.seconds}
    reads = {}
    for f in secret_files + [str(h) for h in hide]:
        code = (f"import os\np = {f!r}\nprint(sorted(os.listdir(p)) if os.path.isdir(p) else open(p).read()[:20])")
        r = run_python(code, lim)
        reads[f] = r.output.strip().splitlines()[-1:] or [""]
    res["reads"] = reads
    me = run_python("import os\nprint(os.getuid(), os.getpid(), sorted(os.listdir('/proc/self/fd')))", lim)
    res["identity"] = me.output.strip()
    return res


def main() -> None:
    """As a script (the unprivileged user): listeners in DIR's sub-folders, then the attacks; one JSON object."""
    base = Path(sys.argv[1])
    dirs = {k: base / k for k in ("tmp", "run_parent", "workdir", "home")}
    dirs["tmp"] = Path(tempfile.mkdtemp(prefix="hpc-rl-attack-"))
    hide = [dirs["run_parent"] / "run", dirs["run_parent"]]
    secrets = json.loads(sys.argv[2])
    os.chdir(dirs["workdir"])
    try:
        result = {"attacks": run_attacks(dirs, hide), "limits": limits_and_files(hide, secrets),
                  "uid": os.geteuid()}
    finally:
        dirs["tmp"].rmdir()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
