"""GuardedAdamW (ZeRO stage 0 in float32): the global gradient norm is measured, a non-finite one skips the step
without touching weights or moments, a finite one is clipped to max_norm before AdamW's step."""

import math
from pathlib import Path

import pytest
import torch

from hpc_rl.config import load
from hpc_rl.train.optimizer import GuardedAdamW, guards_itself, make_optimizer

TOY = Path(__file__).resolve().parent.parent / "jobs" / "toy-grpo-cpu.yaml"


def params(*grads):
    out = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros(len(g)))
        p.grad = torch.tensor(g, dtype=torch.float32)
        out.append(p)
    return out


def test_the_norm_is_measured_and_clipped_before_the_step():
    ps = params([3.0, 0.0], [0.0, 4.0])  # global norm 5
    opt = GuardedAdamW(ps, max_norm=1.0, lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    opt.step()
    assert opt._global_grad_norm == pytest.approx(5.0) and opt.overflow is False
    # Clipped to norm 1: (0.6, 0), (0, 0.8); AdamW's first step moves each nonzero coordinate by -lr (m/sqrt(v) = 1).
    assert torch.allclose(ps[0].grad, torch.tensor([0.6, 0.0]))
    assert torch.allclose(ps[1].grad, torch.tensor([0.0, 0.8]))
    assert torch.allclose(ps[0].data, torch.tensor([-0.1, 0.0]), atol=1e-6)
    assert torch.allclose(ps[1].data, torch.tensor([0.0, -0.1]), atol=1e-6)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_norm_skips_the_step(bad):
    ps = params([1.0, bad], [2.0, 2.0])
    opt = GuardedAdamW(ps, max_norm=1.0, lr=0.1)
    assert opt.step() is None
    assert opt.overflow is True and not math.isfinite(opt._global_grad_norm)
    assert all(torch.equal(p.data, torch.zeros(2)) for p in ps) and not opt.state  # no moment was created
    ps[0].grad = torch.tensor([1.0, 0.0])
    opt.step()  # the next finite step applies
    assert opt.overflow is False and opt._global_grad_norm == pytest.approx(3.0)


def test_only_stage_0_float32_guards_itself():
    cfg = load(TOY, ["trainer.zero_stage=0"])
    assert guards_itself(cfg) and isinstance(make_optimizer(torch.nn.Linear(2, 2), 1e-3, cfg), GuardedAdamW)
    for over in (["trainer.zero_stage=3"], ["trainer.zero_stage=0", "model.dtype=bfloat16"]):
        cfg = load(TOY, over)
        assert not guards_itself(cfg) and type(make_optimizer(torch.nn.Linear(2, 2), 1e-3, cfg)) is torch.optim.AdamW


def test_the_finiteness_check_reads_a_zero3_partition_without_its_padding():
    """DeepSpeed's ZeRO-3 partitions are torch.empty of ceil(numel / world) elements and only the real ones are
    written: the padding holds whatever the memory held. The check reads each rank's real elements only (a critic's
    1-element bias over 2 ranks is all padding on rank 1; a NaN there once stopped a healthy run)."""
    from types import SimpleNamespace

    from hpc_rl.train.engines import zero3_owned

    nan = float("nan")
    bias = SimpleNamespace(ds_numel=1, ds_tensor=torch.tensor([nan]))  # rank 1 of 2: padding only
    assert zero3_owned(bias, 1).numel() == 0
    weight = SimpleNamespace(ds_numel=3, ds_tensor=torch.tensor([2.0, nan]))  # 3 over 2 ranks: rank 1 holds [2, pad]
    assert zero3_owned(weight, 1).tolist() == [2.0]
    assert zero3_owned(SimpleNamespace(ds_numel=3, ds_tensor=torch.tensor([0.5, 1.0])), 0).tolist() == [0.5, 1.0]
    real_nan = SimpleNamespace(ds_numel=3, ds_tensor=torch.tensor([nan, 7.0]))  # a real NaN is still seen
    assert torch.isnan(zero3_owned(real_nan, 1)).all()
