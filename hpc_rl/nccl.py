"""NCCL / torch.distributed settings from the job spec (`env.nccl`), shared by Slurm jobs and local runs."""

from __future__ import annotations

import os

from .config import JobConfig


def nccl_env(cfg: JobConfig) -> dict[str, str]:
    """NCCL/torch.distributed variables from `env.nccl`, with defaults that are safe on shared clusters.

    Unset spec fields leave NCCL's own detection alone (interface, InfiniBand), except: NCCL_DEBUG
    defaults to WARN (INFO under HPC_RL_DEBUG=1), and async error handling is on so that a peer that
    died makes collectives fail after the timeout instead of hanging the job until its time limit.
    """
    n = cfg.env.nccl
    out: dict[str, str] = {}
    if n.socket_ifname:
        out["NCCL_SOCKET_IFNAME"] = str(n.socket_ifname)
    if n.ib_disable is not None:
        out["NCCL_IB_DISABLE"] = "1" if n.ib_disable else "0"
    out["NCCL_DEBUG"] = n.debug or ("INFO" if os.environ.get("HPC_RL_DEBUG") == "1" else "WARN")
    out["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
    out["HPC_RL_NCCL_TIMEOUT_S"] = str(int(n.timeout_s))
    return out
