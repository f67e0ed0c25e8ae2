"""A checkpoint written by W trainer ranks loads on W' (train/reshape.py): at the resume point the optimizer state
gathered to full tensors (fp32 weights, both Adam moments, its step) and the LR schedule equal those written, exactly,
for ZeRO-3 (actor and critic), ZeRO-3 under LoRA (frozen base weights not in the checkpoint) and ZeRO-2. (The stage itself cannot change on
resume: DeepSpeed's stage 1-2 loader does not read a stage-3 checkpoint's files; test_config checks the refusal.)"""

import os

import pytest
import torch
import torch.multiprocessing as mp

from hpc_rl import config
from hpc_rl.netutil import free_port

pytestmark = pytest.mark.slow

PROMPTS, RESPONSES = [[3, 4, 5], [6], [7, 8], [9]], [[7, 8], [9, 10, 11], [12], [13, 14]]


def _job(model_dir: str, extra: dict):
    spec = {"model": {"path": model_dir}, "algorithm": {"name": "ppo", "group_size": 1},
            "trainer": {"device": "cpu", "lr": 1e-2, "prompts_per_step": 4, "mini_batch_size": 4,
                        "warmup_steps": 5, "steps": 10}}
    for section, values in extra.items():
        spec.setdefault(section, {}).update(values)
    return config.load_dict(spec)


def _full_state(engines: dict) -> dict:
    """Every trainable parameter's fp32 weight and Adam moments as full tensors (collective), the optimizer's step
    count and the LR scheduler's position, per engine."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, engine in engines.items():
        tensors = {}
        for pname, p in engine.module.named_parameters():
            if not p.requires_grad:
                continue
            tensors[pname] = [safe_get_full_fp32_param(p).clone(), safe_get_full_optimizer_state(p, "exp_avg").clone(),
                              safe_get_full_optimizer_state(p, "exp_avg_sq").clone()]
        inner = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
        steps = sorted({int(s["step"]) for s in inner.state.values() if "step" in s})
        out[name] = {"tensors": tensors, "steps": steps, "lr_epoch": engine.lr_scheduler.last_epoch,
                     "lr": engine.lr_scheduler.get_last_lr(), "global_steps": engine.global_steps}
    return out


def _rank(rank: int, world: int, port: int, model_dir: str, extra: dict, ckpt: str, out_dir: str, phase: str):
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    from pathlib import Path

    from hpc_rl.rundir import RunDir
    from hpc_rl.train import checkpoint
    from hpc_rl.train.distributed import init_distributed, shutdown_distributed
    from hpc_rl.train.engines import build_actor, build_critic
    from hpc_rl.train.experience import pack, policy_forward, value_forward

    torch.manual_seed(0)  # the critic's value head: the same on both sides
    cfg = _job(model_dir, extra)
    init_distributed(cfg)
    engines = {"actor": build_actor(cfg, world, "cpu"), "critic": build_critic(cfg, world, "cpu")}
    run = RunDir(Path(ckpt))
    if phase == "write":
        per = len(PROMPTS) // world
        batch = pack(PROMPTS[rank * per:(rank + 1) * per], RESPONSES[rank * per:(rank + 1) * per], pad_id=0)
        for _ in range(3):
            logp, _ = policy_forward(engines["actor"], batch)
            engines["actor"].backward(-(logp * batch.response_mask).sum() / batch.response_mask.sum())
            engines["actor"].step()
            v = value_forward(engines["critic"], batch)
            engines["critic"].backward((v ** 2 * batch.response_mask).mean())
            engines["critic"].step()
        state = _full_state(engines)
        checkpoint.save(run, 3, engines, {"step": 3, "world_size": world, "zero_stage": cfg.trainer.zero_stage}, None,
                        None, None, keep_last=2, rank=rank)
    else:
        checkpoint.load(run.checkpoints / "step_3", engines, world, rank)
        state = _full_state(engines)
    if rank == 0:
        torch.save(state, os.path.join(out_dir, f"{phase}.pt"))
    del engines
    shutdown_distributed()


def _spawn(world: int, *args):
    mp.spawn(_rank, args=(world, free_port("127.0.0.1"), *args), nprocs=world, join=True)


Z3, Z2, LORA = {"zero_stage": 3}, {"zero_stage": 2}, {"lora": {"rank": 4}, "critic_lora": {"rank": 4}}


@pytest.mark.parametrize("written,resumed,stages,model", [
    (2, 1, (3, 3), {}),
    (1, 2, (3, 3), {}),
    (2, 1, (3, 3), LORA),
    (2, 1, (2, 2), {}),
], ids=["zero3-2to1", "zero3-1to2", "zero3-lora-2to1", "zero2-2to1"])
def test_optimizer_state_at_the_resume_point_equals_the_written_one(tiny_model, tmp_path, written, resumed, stages,
                                                                    model):
    ckpt = tmp_path / "run"
    (ckpt / "checkpoints").mkdir(parents=True)
    for world, stage, phase in ((written, stages[0], "write"), (resumed, stages[1], "load")):
        extra = {"trainer": {"zero_stage": stage}, "model": model}
        _spawn(world, str(tiny_model), extra, str(ckpt), str(tmp_path), phase)
    want, got = torch.load(tmp_path / "write.pt"), torch.load(tmp_path / "load.pt")
    assert (ckpt / "checkpoints" / "step_3" / "universal" / "actor" / "state" / "zero").is_dir()
    for name in ("actor", "critic"):
        w, g = want[name], got[name]
        assert w["steps"] == g["steps"] == [3], (name, w["steps"], g["steps"])
        # Warm-up over 5 steps: the schedule's position matters (lr 3/5 -> 4/5 of the base at the next step).
        assert (g["lr_epoch"], g["lr"], g["global_steps"]) == (w["lr_epoch"], w["lr"], w["global_steps"]) == \
            (3, [pytest.approx(1e-2 * 4 / 5)], 3)
        assert w["tensors"].keys() == g["tensors"].keys() and w["tensors"]
        for pname, (fp32, m, v) in w["tensors"].items():
            gf, gm, gv = g["tensors"][pname]
            assert torch.equal(fp32, gf) and torch.equal(m, gm) and torch.equal(v, gv), pname
            assert float(m.abs().max()) > 0, pname  # the moments were written by real steps
