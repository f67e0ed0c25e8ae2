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
    result = _gathers_and_forwards(rank, actor, batch, after)
    result |= {"shards": shards, "loss": float(loss), "applied": actor.was_step_applied(),
              "grad_norm": float(actor.get_global_grad_norm()), "values_shape": list(v.shape)}
    if rank == 0:
        result["changed"] = sum(int(not torch.equal(before[k], after[k])) for k in before)
        result["n_params"] = len(before)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _gathers_and_forwards(rank: int, actor, batch, after: dict) -> dict:
    """The push's gather (whole parameters in buckets) against DeepSpeed's module by module, and the forward on the
    gathered weights (rank 0 alone) against the engine's ZeRO-3 forward."""
    from hpc_rl.train import zero3_gather
    from hpc_rl.train.engines import gather_module_by_module, gather_state_dict
    from hpc_rl.train.experience import policy_forward
    from hpc_rl.train.gathered_forward import GatheredPolicy

    reference = gather_module_by_module(actor.module, True)
    everywhere = gather_state_dict(actor, on_rank0_only=False)  # all-gather instead of gather
    whole_bucket = zero3_gather.BUCKET_BYTES
    zero3_gather.BUCKET_BYTES = 4096  # many buckets, some parameters larger than one
    try:
        small = gather_state_dict(actor)
    finally:
        zero3_gather.BUCKET_BYTES = whole_bucket
    actor.eval()
    with torch.no_grad():
        zero_lp = policy_forward(actor, batch)[0]
    out = {"usable": zero3_gather.usable(list(actor.module.parameters())),
           "blocks_whole": sum(bool(getattr(m, "_z3_leaf", False)) for m in actor.module.modules()),
           "everywhere_equal": set(everywhere) >= set(reference) and
           all(torch.equal(everywhere[k], reference[k]) for k in reference)}
    if rank == 0:
        buffers = {n for n, _ in actor.module.named_buffers()}
        out["keys_equal"] = set(after) - buffers == set(reference) and set(small) == set(after)
        out["values_equal"] = all(torch.equal(after[k], reference[k]) and torch.equal(small[k], reference[k])
                                  for k in reference)
        with torch.no_grad():
            lp = policy_forward(GatheredPolicy(actor).on(list(after.items())), batch)[0]
        mask = batch.response_mask > 0
        out["forward_max_diff"] = float((lp - zero_lp)[mask].abs().max())
    return out


@pytest.fixture(scope="module")
def two_ranks(tiny_model, tmp_path_factory):
    """Both ranks' results of one step (one spawn for the tests below: each costs its start-up)."""
    world, out = 2, tmp_path_factory.mktemp("zero3")
    mp.spawn(_rank, args=(world, free_port("127.0.0.1"), str(tiny_model), str(out)), nprocs=world, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def test_two_ranks_hold_half_of_every_parameter(two_ranks):
    world = 2
    r0, r1 = two_ranks
    assert r0["shards"].keys() == r1["shards"].keys()
    for name, (local, full) in r0["shards"].items():
        assert local * world >= full and local < full, (name, local, full)
        assert local == (full + world - 1) // world, name
    assert r0["applied"] and r1["applied"]
    assert torch.isfinite(torch.tensor(r0["grad_norm"])) and r0["grad_norm"] > 0
    assert r0["changed"] == r0["n_params"], "every parameter should move after one AdamW step"
    assert r0["values_shape"] == [2, 3]


def test_the_push_gathers_whole_parameters_in_buckets_as_deepspeed_does(two_ranks):
    """The bucketed gather equals DeepSpeed's module by module (to rank 0, to every rank, in many small buckets),
    the forward on rank 0's gathered weights equals the ZeRO-3 forward, and on CPU each decoder layer is one fetch."""
    r0, r1 = two_ranks
    assert r0["usable"] and r1["usable"]
    assert r0["keys_equal"] and r0["values_equal"]
    assert r0["everywhere_equal"] and r1["everywhere_equal"]
    assert r0["forward_max_diff"] < 1e-6
    assert r0["blocks_whole"] == r1["blocks_whole"] == 2  # the tiny model's two Qwen2DecoderLayers
