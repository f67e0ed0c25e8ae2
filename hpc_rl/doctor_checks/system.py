"""System checks: /dev/shm size, a free master port, a hostname that resolves to a routable address, the sandbox."""

from __future__ import annotations

import errno
import ipaddress
import socket
import threading

from ..config.trainer import node_range
from .base import FAIL, OK, WARN, Ctx, Result, check

MiB = 1 << 20
SHM_FAIL_BELOW = 256 * MiB  # Docker's default 64 MiB breaks NCCL and vLLM workers
SHM_WARN_BELOW = 1024 * MiB


@check("shm")
def check_shm(ctx: Ctx) -> Result:
    try:
        st = ctx.statvfs("/dev/shm")
    except OSError as e:
        return Result("shm", WARN, f"/dev/shm cannot be read ({e.strerror})",
                      "NCCL and vLLM need a shared-memory tmpfs at /dev/shm; ask your admins")
    size = st.f_frsize * st.f_blocks
    msg = f"/dev/shm is {size / MiB:.0f} MiB"
    fix = ("give the job a larger /dev/shm (containers: --shm-size=16g; else ask admins); "
           "NCCL_SHM_DISABLE=1 works around it for NCCL at a speed cost")
    if size < SHM_FAIL_BELOW:
        return Result("shm", FAIL, msg + " (too small: NCCL/vLLM shared memory fails)", fix)
    if size < SHM_WARN_BELOW:
        return Result("shm", WARN, msg + " (under 1 GiB: large batches may fail)", fix)
    return Result("shm", OK, msg)


def port_free(port: int, host: str = "0.0.0.0") -> str | None:
    """None when `port` can be bound (as torch's TCPStore does: SO_REUSEADDR), else the reason."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        return None
    except OSError as e:
        return "in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
    finally:
        s.close()


@check("ports")
def check_ports(ctx: Ctx) -> list[Result]:
    """MASTER_PORT (torch.distributed's rendezvous, default 29500) and a fixed rollout.port must be free."""
    out = []
    raw = ctx.environ.get("MASTER_PORT", "29500")
    ports = []
    try:
        ports.append(("MASTER_PORT", int(raw)))
    except ValueError:
        out.append(Result("port:master", FAIL, f"MASTER_PORT={raw!r} is not a port number", "set MASTER_PORT to 1024-65535"))
    if ctx.job is not None and ctx.job.rollout.port:
        ports.append(("rollout.port", ctx.job.rollout.port))
    for what, port in ports:
        name = "port:master" if what == "MASTER_PORT" else "port:rollout"
        why = port_free(port)
        if why is None:
            out.append(Result(name, OK, f"{what} {port} is free here"))
        else:
            fix = ("export MASTER_PORT=<a free port> (e.g. 29500 + SLURM_JOB_ID % 1000)" if what == "MASTER_PORT"
                   else "set rollout.port: 0 (a free port is picked) or another free port")
            out.append(Result(name, FAIL, f"{what} {port} cannot be bound here ({why})", fix))
    return out


def resolve(name: str, timeout: float = 5.0) -> list[str] | None:
    """IP addresses of `name` (None on failure or after `timeout`: a broken DNS must not hang the doctor)."""
    box: dict = {}

    def work():
        try:
            box["addrs"] = sorted({ai[4][0] for ai in socket.getaddrinfo(name, None)})
        except OSError:
            box["addrs"] = None

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(timeout)
    return box.get("addrs")


def _multi_node(ctx: Ctx) -> bool:
    return ctx.job is not None and node_range(ctx.job.trainer.nodes)[1] + ctx.job.rollout.nodes > 1


@check("hostname")
def check_hostname(ctx: Ctx) -> Result:
    """Multi-node jobs rendezvous by hostname: it must resolve to a non-loopback address.

    A FAIL needs a multi-node job and this node inside a Slurm allocation (SLURM_JOB_ID): on a login
    node or for `hpc-rl run` (one machine) a loopback name is only a warning.
    """
    host = ctx.hostname
    addrs = ctx.resolve(host)
    bad = FAIL if _multi_node(ctx) and ctx.environ.get("SLURM_JOB_ID") else WARN
    scope = "this multi-node job" if _multi_node(ctx) else "multi-node jobs"
    if not addrs:
        return Result("hostname", bad, f"hostname {host!r} does not resolve; {scope} cannot rendezvous by name",
                      "add it to /etc/hosts or DNS (ask admins), or set env.nccl.socket_ifname / MASTER_ADDR explicitly")
    routable = [a for a in addrs if not ipaddress.ip_address(a.split("%")[0]).is_loopback]
    if not routable:
        return Result("hostname", bad, f"hostname {host!r} resolves only to loopback ({', '.join(addrs)}); "
                      f"other nodes cannot reach it in {scope}",
                      "fix /etc/hosts so the hostname maps to the node's network address")
    return Result("hostname", OK, f"{host} -> {', '.join(routable)}")


def _probe_hostname(self: Ctx) -> str:
    return socket.gethostname()


def _probe_resolve(self: Ctx):
    return resolve


Ctx._probe_hostname = _probe_hostname
Ctx._probe_resolve = _probe_resolve


@check("sandbox")
def check_sandbox(ctx: Ctx) -> Result:
    """The python tool's sandbox (multi-turn rollouts): which of its layers are active here, and one real call."""
    from ..rollout.environments.sandbox import SandboxLimits, layers, namespaces_available, run_python

    active = layers()
    summary = "; ".join(f"{name}: {'yes' if on else 'no'} ({detail})" for name, on, detail in active)
    why = namespaces_available()
    if why is not None:
        return Result("sandbox", WARN, f"model-written code cannot be isolated: {why}; layers: {summary}",
                      "only jobs with the python tool need it: ask the admins for unprivileged user namespaces "
                      "(sysctl user.max_user_namespaces > 0), or set rollout.sandbox.require_isolation: false "
                      "(rlimits and the seccomp filter only)")
    r = run_python("print(6 * 7)", SandboxLimits(wall_s=30))
    if not r.ok or r.output.strip() != "42":
        return Result("sandbox", FAIL, f"a sandboxed call failed ({r.killed or r.exit_code}: "
                      f"{r.output.strip()[-200:]}); layers: {summary}",
                      "run with HPC_RL_DEBUG=1 and report the message; rollout.sandbox.require_isolation: false "
                      "runs model code with rlimits and the seccomp filter only")
    missing = [name for name, on, _ in active if not on]
    status = WARN if "IPC seal" in missing else OK
    return Result("sandbox", status, f"the first call (with the sandbox's start) took {r.seconds * 1000:.0f} ms; "
                  f"layers: {summary}",
                  "the IPC seal needs seccomp on x86_64 or aarch64" if status == WARN else "")
