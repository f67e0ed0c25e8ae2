"""Whole ZeRO-3 parameters from their partitions in one collective per bucket, for a CPU trainer's weight push.

DeepSpeed's GatheredParameters all-gathers every parameter on its own and partitions it again on exit. A push of the
whole policy, module by module as gather_state_dict did, is then ~3 collectives a parameter: on CPU over gloo each
costs a fixed ~0.2-0.5 ms whatever its size, so the toy's 2-layer model took ~10 ms to gather 1.4 MB. Here each rank
sends its partitions of a bucket of parameters as one flat tensor (gather to rank 0, or all-gather), and the whole
parameters are cut out of the ranks' pieces: ZeRO-3 keeps elements [r * size, (r + 1) * size) of a flattened
parameter on rank r (`ds_tensor`, padded at the end), so the rank-ordered concatenation of the partitions, cut to
`ds_numel`, is the parameter. Nothing on the ranks' ZeRO state changes.
"""

from __future__ import annotations

import torch

# Whole-parameter bytes gathered at once: the peak memory a push adds on rank 0 beyond the copy it sends.
BUCKET_BYTES = 256 * 2**20


def usable(params: list) -> bool:
    """Whether `params` are plain ZeRO-3 partitions of the world group on CPU (no offload to NVMe, no secondary
    partitions of hierarchical schemes): the layout the cut above assumes."""
    if not torch.distributed.is_initialized():
        return False
    world = list(range(torch.distributed.get_world_size()))
    for p in params:
        t = getattr(p, "ds_tensor", None)
        if t is None or t.device.type != "cpu" or getattr(p, "ds_secondary_tensor", None) is not None:
            return False
        group = getattr(p, "ds_process_group", None)  # partition r on global rank r, as the gather reads them
        if group is not None and torch.distributed.get_process_group_ranks(group) != world:
            return False
        if getattr(t, "final_location", None) is not None:  # swapped out to NVMe
            return False
    return True


def buckets(params: list, limit: int) -> list[list]:
    """`params` in order, cut into runs of at most `limit` whole-parameter bytes (a larger one alone) and one dtype."""
    out, cur, size = [], [], 0
    for p in params:
        n = int(p.ds_numel) * p.ds_tensor.element_size()
        if cur and (size + n > limit or p.ds_tensor.dtype != cur[0].ds_tensor.dtype):
            out.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += n
    if cur:
        out.append(cur)
    return out


def gather_whole(params: list, to_rank0_only: bool = True) -> list[torch.Tensor] | None:
    """The whole value of each ZeRO-3 parameter in `params` (detached CPU tensors, in order); collective over the
    world group. None on ranks other than 0 when `to_rank0_only`."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out: list[torch.Tensor] = []
    for bucket in buckets(params, BUCKET_BYTES):
        flat = torch.cat([p.ds_tensor.detach().reshape(-1) for p in bucket])
        if to_rank0_only:
            pieces = [torch.empty_like(flat) for _ in range(world)] if rank == 0 else None
            torch.distributed.gather(flat, pieces, dst=0)
        else:
            pieces = [torch.empty_like(flat) for _ in range(world)]
            torch.distributed.all_gather(pieces, flat)
        if pieces is None:
            continue
        offset = 0
        for p in bucket:
            size = p.ds_tensor.numel()
            whole = torch.cat([piece[offset:offset + size] for piece in pieces])[:int(p.ds_numel)]
            out.append(whole.view(p.ds_shape))
            offset += size
    return out if (rank == 0 or not to_rank0_only) else None
