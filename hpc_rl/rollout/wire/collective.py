"""Collective weight sync, the wire: trainer rank 0 broadcasts the actor's tensors to every rollout worker.

A group made for weight sync only (gloo on CPU, NCCL on GPU), built directly from a TCPStore hosted by
the sender, so it lives beside the trainer's own torch.distributed world (init_process_group/new_group
cannot span separate jobs). Rank 0 is the sender; each server's workers take ranks
`base_rank + tp_rank`. Per update, the sender POSTs the bucket plan to every server (which starts its
receive and answers at once), broadcasts a header then one flat buffer per bucket, and polls until
every server has loaded the version. The two ends: client/transports/collective.py (trainer), server/collective_receiver.py
(the rollout server's /collective/* routes).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch

from ...errors import RolloutError, first_line
from .weights import BUCKET_BYTES

log = logging.getLogger("hpc_rl")

STORE_PREFIX = "hpc_rl_weight_sync"


class CollectiveError(RolloutError):
    """The weight-sync group could not be formed or a broadcast failed."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make_plan(specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]], bucket_bytes: int = BUCKET_BYTES) -> list:
    """Buckets of one dtype each, in the given order: [{"dtype": "bfloat16", "items": [[name, shape], ...]}]."""
    plan: list[dict] = []
    cur: dict[str, dict] = {}  # dtype -> open bucket
    size: dict[str, int] = {}
    for name, shape, dtype in specs:
        dn = dtype_name(dtype)
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        if dn in cur and size[dn] + nbytes > bucket_bytes:
            plan.append(cur.pop(dn))
        if dn not in cur:
            cur[dn], size[dn] = {"dtype": dn, "items": []}, 0
        cur[dn]["items"].append([name, [int(s) for s in shape]])
        size[dn] += nbytes
    plan.extend(cur.values())
    return plan


def plan_hash(plan: list) -> int:
    """63-bit digest of the plan, sent in the header so both sides agree on the layout."""
    return int.from_bytes(hashlib.sha256(json.dumps(plan).encode()).digest()[:8], "big") >> 1


def plan_bytes(plan: list) -> int:
    total = 0
    for b in plan:
        es = torch.empty((), dtype=getattr(torch, b["dtype"])).element_size()
        total += sum(int(torch.Size(s).numel()) for _, s in b["items"]) * es
    return total


def broadcast_from_rank0(pg, tensor: torch.Tensor):
    """Start a broadcast of `tensor` from the group's rank 0 (the sender); returns the work handle."""
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return pg.broadcast([tensor], opts)


class SyncGroup:
    """A backend process group plus its TCPStore (kept alive: on rank 0 it is the store's server)."""

    def __init__(self, pg, store):
        self.pg, self.store = pg, store

    def broadcast(self, tensors, opts):
        return self.pg.broadcast(tensors, opts)

    def allreduce(self, tensors, opts):
        return self.pg.allreduce(tensors, opts)

    def shutdown(self) -> None:
        shut = getattr(self.pg, "shutdown", None)
        if callable(shut):
            shut()
        self.pg = self.store = None


def leave_group(pg) -> None:
    """Leave a weight-sync process group; a group already broken by a dead peer is simply dropped."""
    if pg is not None:
        try:
            pg.shutdown()
        except Exception:
            pass


def host_store(master_addr: str, world_size: int, timeout_s: float):
    """Rank 0's TCPStore on a port the OS picks while binding (its .port): a port found free first and bound
    later can be taken in between (EADDRINUSE, seen in CI)."""
    from torch.distributed import TCPStore

    try:
        return TCPStore(master_addr, 0, world_size, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    except Exception as e:  # RuntimeError / DistStoreError
        raise CollectiveError(f"weight sync: cannot host the group's store on {master_addr} ({first_line(e)}); "
                              "check that this address belongs to the trainer's node") from None


def join_group(master_addr: str, master_port: int, world_size: int, rank: int, backend: str,
               timeout_s: float, device: str = "cpu", store=None):
    """Join the weight-sync group (rank 0 hosts the TCPStore, or passes the one host_store made); returns the
    backend ProcessGroup."""
    from torch.distributed import PrefixStore, TCPStore

    timeout = timedelta(seconds=timeout_s)
    try:
        if store is None:
            store = TCPStore(master_addr, master_port, world_size, rank == 0, timeout=timeout,
                             wait_for_workers=False)
    except Exception as e:  # RuntimeError / DistStoreError: refused, timed out, address in use
        raise CollectiveError(f"weight sync: rank {rank} could not reach the store at {master_addr}:{master_port} "
                              f"within {timeout_s:.0f}s ({first_line(e)}); check that the trainer's "
                              "address is reachable from the rollout nodes") from None
    prefix = PrefixStore(STORE_PREFIX, store)
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        pg = ProcessGroupGloo(prefix, rank, world_size, timeout)
    elif backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        torch.cuda.set_device(torch.device(device))
        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = ProcessGroupNCCL(prefix, rank, world_size, opts)
    else:
        raise CollectiveError(f"weight sync: backend {backend!r} is not supported; use gloo (CPU) or nccl (GPU)")
    pg = SyncGroup(pg, store)
    # A first collective proves every rank is in before anyone relies on the group.
    probe = torch.ones(1, device=device)
    opts_ar = torch.distributed.AllreduceOptions()
    pg.allreduce([probe], opts_ar).wait(timeout)
    if int(probe.item()) != world_size:
        raise CollectiveError(f"weight sync: the group's first all-reduce saw {int(probe.item())} of {world_size} ranks")
    return pg


def receive_buckets(pg, plan: list, version: int, device: str = "cpu") -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Receive the header, then each bucket of `plan`, yielding its (name, tensor) views (one bucket ahead)."""
    hdr = torch.zeros(3, dtype=torch.int64, device=device)
    broadcast_from_rank0(pg, hdr).wait()
    got = [int(x) for x in hdr.tolist()]
    want = [int(version), len(plan), plan_hash(plan)]
    if got != want:
        raise CollectiveError(f"weight sync: header {got} does not match the announced update {want} "
                              "(version, buckets, plan digest); the sender and this server disagree")

    def post(b):
        n = sum(int(torch.Size(s).numel()) for _, s in b["items"])
        buf = torch.empty(n, dtype=getattr(torch, b["dtype"]), device=device)
        return buf, broadcast_from_rank0(pg, buf)

    pending = post(plan[0]) if plan else None
    for i, b in enumerate(plan):
        buf, work = pending
        work.wait()
        # Post the next receive before loading this bucket: the network and the copy overlap.
        pending = post(plan[i + 1]) if i + 1 < len(plan) else None
        out, off = [], 0
        for name, shape in b["items"]:
            n = int(torch.Size(shape).numel())
            out.append((name, buf[off:off + n].view(shape)))
            off += n
        yield out


def broadcast_buckets(pg, plan: list, tensors: dict[str, torch.Tensor], version: int, device: str = "cpu") -> None:
    """Rank 0: send the header, then each bucket flattened into one buffer (the next one built meanwhile)."""
    try:
        hdr = torch.tensor([int(version), len(plan), plan_hash(plan)], dtype=torch.int64, device=device)
        broadcast_from_rank0(pg, hdr).wait()
        prev = None
        for b in plan:
            dt = getattr(torch, b["dtype"])
            buf = torch.cat([tensors[name].detach().to(device=device, dtype=dt).reshape(-1)
                             for name, _ in b["items"]])
            work = broadcast_from_rank0(pg, buf)
            if prev is not None:
                prev[1].wait()
            prev = (buf, work)
        if prev is not None:
            prev[1].wait()
    except RuntimeError as e:  # gloo/NCCL: a peer left (it logs why) or the group timed out
        raise CollectiveError(f"weight sync: broadcast of version {version} failed "
                              f"({first_line(e)}); see the rollout server's log") from None


def gpu_uuid(device) -> str | None:
    """The UUID of the GPU `device` (a torch.device or "cuda:K") is in this process, or None (a CPU, or an engine
    whose GPUs are its workers', as vLLM's): NCCL refuses a group with two ranks on one GPU, so the trainer compares
    it with its own before it picks the collective."""
    if device is None or not isinstance(device, (str, torch.device)) or not str(device).startswith("cuda"):
        return None
    if not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_properties(torch.device(device)).uuid)
