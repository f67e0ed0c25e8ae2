"""The LoRA actor and critic under DeepSpeed ZeRO-3 on 2 ranks: each rank holds its shard of the frozen base,
only the adapters (and the critic's value head) train, and the actor with its adapters off is the reference:
its log-probs equal a separately loaded base model's."""

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from hpc_rl import config
from hpc_rl.netutil import free_port

pytestmark = pytest.mark.slow

PROMPTS = [[22, 18, 9, 19], [22, 18, 5, 19]]
RESPONSES = [[9, 9, 9, 1], [5, 30]]


def _job(policy_dir: str) -> config.JobConfig:
    return config.load_dict({"model": {"path": policy_dir, "lora": {"rank": 4, "alpha": 8, "target_modules": ["all-linear"]},
                                       "critic_lora": {"rank": 2, "target_modules": ["q_proj", "v_proj"]}},
                             "algorithm": {"name": "ppo", "kl": {"coef": 0.01}},
                             "trainer": {"device": "cpu", "prompts_per_step": 2, "mini_batch_size": 4,
                                         "lr": 1e-2}})


def _rank(rank: int, world: int, port: int, policy_dir: str, out_dir: str) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    from hpc_rl.train.distributed import init_distributed, shutdown_distributed
    from hpc_rl.train.engines import adapter_state_dict, build_actor, build_critic
    from hpc_rl.train.experience import pack, policy_forward

    cfg = _job(policy_dir)
    init_distributed(cfg)
    torch.manual_seed(0)
    actor = build_actor(cfg, world, "cpu")
    critic = build_critic(cfg, world, "cpu")
    frozen = {n: [int(p.ds_tensor.numel()), int(p.ds_numel)] for n, p in actor.module.named_parameters()
              if not p.requires_grad}
    trained = sorted(n for n, p in actor.module.named_parameters() if p.requires_grad)
    critic_trained = sorted(n for n, p in critic.module.named_parameters() if p.requires_grad)
    opt_params = sum(int(getattr(p, "ds_numel", p.numel())) for g in actor.optimizer.param_groups for p in g["params"]) \
        if hasattr(actor.optimizer, "param_groups") else None
    batch = pack(PROMPTS, RESPONSES, 0)
    initial = adapter_state_dict(actor)
    # One optimizer step moves the adapters (B starts at zero: the adapted model starts as the base).
    actor.train()
    lp, _ = policy_forward(actor, batch)
    before = lp.detach()
    actor.backward(-(lp * batch.response_mask).sum())
    actor.step()
    actor.eval()
    with torch.no_grad():
        adapted, _ = policy_forward(actor, batch)
        with actor.module.disable_adapter():
            ref, _ = policy_forward(actor, batch)
    adapters = adapter_state_dict(actor)
    if rank == 0:
        torch.save({"initial": initial, "after": adapters}, os.path.join(out_dir, "adapters.pt"))
    out = {"frozen": frozen, "trained": trained, "critic_trained": critic_trained, "opt_params": opt_params,
           "before": before.tolist(), "adapted": adapted.tolist(), "ref": ref.tolist(),
           "adapters": sorted(adapters) if adapters is not None else None}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    del actor, critic
    shutdown_distributed()


def test_lora_actor_and_critic_on_two_zero3_ranks(tiny_model, tmp_path):
    from hpc_rl.models import load_causal_lm
    from hpc_rl.train.experience import pack, policy_forward

    world = 2
    mp.spawn(_rank, args=(world, free_port("127.0.0.1"), str(tiny_model), str(tmp_path)), nprocs=world, join=True)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    # Every base weight is frozen and partitioned: each rank holds about half of it.
    assert any("q_proj.base_layer.weight" in n for n in r0["frozen"]) and any("embed_tokens" in n for n in r0["frozen"])
    for name, (local, full) in r0["frozen"].items():
        assert local == (full + world - 1) // world and local < full, (name, local, full)
    # Only adapters train (all-linear: 7 modules x 2 layers x A, B); the output layer keeps no adapter.
    assert r0["trained"] and all(".lora_A." in n or ".lora_B." in n for n in r0["trained"])
    assert len(r0["trained"]) == 2 * 7 * 2 and not any("lm_head" in n for n in r0["trained"])
    # The critic: adapters on q_proj/v_proj and its whole value head.
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in r0["critic_trained"] if "lora" in n} == {"q_proj", "v_proj"}
    assert any(n.endswith("score.weight") for n in r0["critic_trained"])
    # The reference (adapters off) equals the base model loaded on its own; the adapted policy moved away.
    base = load_causal_lm(tiny_model).eval()
    with torch.no_grad():
        want, _ = policy_forward(base, pack(PROMPTS, RESPONSES, 0))
    mask = pack(PROMPTS, RESPONSES, 0).response_mask.bool()
    ref, adapted, before = (torch.tensor(r0[k]) for k in ("ref", "adapted", "before"))
    assert torch.allclose(ref[mask], want[mask], atol=1e-5)
    assert torch.allclose(before[mask], want[mask], atol=1e-5)  # B = 0 at start: adapted == base
    assert (adapted[mask] - want[mask]).abs().max() > 1e-3
    assert torch.allclose(torch.tensor(r1["ref"]), ref, atol=1e-6)
    # Rank 0 gathers the adapters under their wire names; the others get None.
    assert r0["adapters"] and all(n.endswith(("lora_A.weight", "lora_B.weight")) for n in r0["adapters"])
    assert r1["adapters"] is None
    # The ZeRO-3 step equals one step of a plain PeftModel from the same adapters: same loss, AdamW, clipping.
    saved = torch.load(tmp_path / "adapters.pt")
    cfg = _job(str(tiny_model))
    plain = _plain_peft(tiny_model, cfg, saved["initial"])
    params = [p for p in plain.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.trainer.lr, betas=tuple(cfg.trainer.betas), weight_decay=0.0)
    batch = pack(PROMPTS, RESPONSES, 0)
    plain.train()
    lp, _ = policy_forward(plain, batch)
    (-(lp * batch.response_mask).sum()).backward()
    torch.nn.utils.clip_grad_norm_(params, cfg.trainer.grad_clip)
    opt.step()
    from hpc_rl.models.lora import wire_name

    mine = {wire_name(n): p.detach() for n, p in plain.named_parameters() if wire_name(n)}
    assert mine.keys() == saved["after"].keys()
    moved = max(float((saved["after"][n] - saved["initial"][n]).abs().max()) for n in mine)
    diff = max(float((saved["after"][n] - mine[n]).abs().max()) for n in mine)
    assert moved > 1e-3 and diff < 1e-5, (moved, diff)


def _plain_peft(model_dir, cfg, adapters: dict):
    """The tiny model wrapped by PEFT as the trainer wraps it, with `adapters` (wire names) loaded."""
    from hpc_rl.models import load_causal_lm
    from hpc_rl.models.lora import wire_name, with_adapters

    m = with_adapters(load_causal_lm(model_dir), cfg.model.lora, "model.lora")
    with torch.no_grad():
        for n, p in m.named_parameters():
            if wire_name(n):
                p.copy_(adapters[wire_name(n)])
    return m
