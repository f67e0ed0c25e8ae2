"""Process environment of a job's nodes: NCCL/gloo settings, the node's own address, /dev/shm size."""

from __future__ import annotations

import logging
import os
import socket

from ..config import JobConfig
from ..nccl import nccl_env
from ..netutil import NODE_ADDR_ENV, node_address

log = logging.getLogger("hpc_rl")

# NCCL's shared-memory transport needs room for its buffers per GPU pair; Docker-like 64 MB
# limits make it crash with "unhandled system error" mid-run rather than at start.
SHM_MIN_BYTES = 1 << 30


def shm_problem(path: str = "/dev/shm", min_bytes: int = SHM_MIN_BYTES) -> str | None:
    """A one-line problem + fix when `path` is missing or smaller than `min_bytes`, else None."""
    try:
        st = os.statvfs(path)
    except OSError as e:
        return (f"{path} is not usable ({e.strerror}); NCCL and DataLoader workers need shared memory: "
                "ask the admins for a tmpfs /dev/shm or set NCCL_SHM_DISABLE=1 in env.vars")
    size = st.f_blocks * st.f_frsize
    if size < min_bytes:
        return (f"{path} holds only {size / 2**20:.0f} MiB (< {min_bytes / 2**20:.0f} MiB); NCCL's shared-memory "
                "transport can fail mid-run: ask for a larger /dev/shm or set NCCL_SHM_DISABLE=1 in env.vars")
    return None


def prepare_node_env(cfg: JobConfig) -> dict[str, str]:
    """Set the variables a node needs before its processes start; returns them. The spec wins over
    the submitting shell's environment (sbatch exports it), `env.vars` over everything.
    Checks /dev/shm and logs a warning naming the fix."""
    addr, ifname = node_address()
    wanted = dict(nccl_env(cfg))
    # Per node, never inherited from the submitting shell (sbatch exports its whole environment).
    wanted[NODE_ADDR_ENV] = addr
    if ifname:
        # gloo binds to the interface of the hostname's address; on a node whose hostname resolves
        # elsewhere (or to loopback) ranks on other nodes could not connect back.
        wanted["GLOO_SOCKET_IFNAME"] = ifname
    wanted.update({str(k): str(v) for k, v in cfg.env.vars.items()})
    os.environ.update(wanted)
    used = wanted
    problem = shm_problem()
    if problem:
        log.warning(problem)
    if os.environ.get("HPC_RL_DEBUG") == "1":
        log.info("node %s (%s): %s", socket.gethostname(), addr,
                 " ".join(f"{k}={v}" for k, v in sorted(used.items())))
    return used
