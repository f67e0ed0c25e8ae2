"""Data-parallel whitening: two real gloo ranks whiten with the statistics of the global batch."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpc_rl.algos.advantages import discounted_returns, reinforce_pp_advantages
from hpc_rl.algos.utils import masked_whiten

# Rank-local batches of different sizes; rank 1's padding holds garbage that must not leak in.
XS = [
    torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]),
    torch.tensor([[10.0, -3.0, float("nan")]]),
]
MASKS = [
    torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]),
    torch.tensor([[1.0, 1.0, 0.0]]),
]


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        w = masked_whiten(XS[rank], MASKS[rank], distributed=True)
        local = masked_whiten(XS[rank], MASKS[rank], distributed=False)
        rpp = reinforce_pp_advantages(XS[rank], MASKS[rank], gamma=1.0, distributed=True)
        torch.save({"w": w, "local": local, "rpp": rpp}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_distributed_whiten_equals_whitening_the_concatenated_batch(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    full = torch.cat(XS)
    full_mask = torch.cat(MASKS)
    expect = masked_whiten(full, full_mask)
    torch.testing.assert_close(torch.cat([g["w"] for g in got]), expect)
    # The local-only result differs, so the test would catch a missing all-reduce.
    assert not torch.allclose(got[0]["local"], expect[:2])
    # REINFORCE++ with distributed=True whitens the rank-local returns-to-go with global statistics too.
    full_ret = torch.cat([discounted_returns(x, m, 1.0) for x, m in zip(XS, MASKS)])
    torch.testing.assert_close(torch.cat([g["rpp"] for g in got]), masked_whiten(full_ret, full_mask))
