"""ZeRO-3 really partitions: with 2 ranks each holds half of every parameter, and a step trains."""

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from hpc_rl import config
from hpc_rl.netutil import free_port

pytestmark = pytest.mark.slow


def _rank(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    from hpc_rl.train.distributed import shutdown_distributed

    _train_one_step(rank, world, model_dir, out_dir)
    shutdown_distributed()  # as hpc_rl.loop does, once the engines are out of scope


def _train_one_step(rank: int, world: int, model_dir: str, out_dir: str) -> None:
    from hpc_rl.train.distributed import init_distributed
    from hpc_rl.train.engines import build_actor, build_critic, gather_state_dict
    from hpc_rl.train.experience import pack, policy_forward, value_forward

    cfg = config.load_dict({"model": {"path": model_dir}, "trainer": {"device": "cpu", "lr": 1e-3,
                                                                      "prompts_per_step": 2, "mini_batch_size": 16}})
    init_distributed(cfg)
    actor = build_actor(cfg, world, "cpu")
    critic = build_critic(cfg, world, "cpu")
    shards = {n: [int(p.ds_tensor.numel()), int(p.ds_numel)] for n, p in actor.module.named_parameters()}
    # Left-padded prompts of different lengths: padding must not turn gradients into NaN.
    batch = pack([[3, 4, 5], [6]], [[7, 8], [9, 10, 11]], pad_id=0)
    before = gather_state_dict(actor)
    logp, _ = policy_forward(actor, batch)
    loss = -(logp * batch.response_mask).sum() / batch.response_mask.sum()
    actor.backward(loss)
    actor.step()
    v = value_forward(critic, batch)
    critic.backward((v ** 2 * batch.response_mask).mean())
    critic.step()
    after = gather_state_dict(actor)
    result = {"shards": shards, "loss": float(loss), "applied": actor.was_step_applied(),
              "grad_norm": float(actor.get_global_grad_norm()), "values_shape": list(v.shape)}
    if rank == 0:
        result["changed"] = sum(int(not torch.equal(before[k], after[k])) for k in before)
        result["n_params"] = len(before)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def test_two_ranks_hold_half_of_every_parameter(tiny_model, tmp_path):
    world = 2
    mp.spawn(_rank, args=(world, free_port("127.0.0.1"), str(tiny_model), str(tmp_path)), nprocs=world, join=True)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert r0["shards"].keys() == r1["shards"].keys()
    for name, (local, full) in r0["shards"].items():
        assert local * world >= full and local < full, (name, local, full)
        assert local == (full + world - 1) // world, name
    assert r0["applied"] and r1["applied"]
    assert torch.isfinite(torch.tensor(r0["grad_norm"])) and r0["grad_norm"] > 0
    assert r0["changed"] == r0["n_params"], "every parameter should move after one AdamW step"
    assert r0["values_shape"] == [2, 3]
