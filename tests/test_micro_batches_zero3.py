"""Token-budget micro-batches in the real trainer: two ZeRO-3 ranks whose shards need different numbers of
micro-batches take one optimizer step per mini-batch, with the padded path's gradient (actor and critic)."""

import json
import os
import random

import pytest
import torch.multiprocessing as mp

from hpc_rl.netutil import free_port

pytestmark = pytest.mark.slow

SAMPLES = 8  # over both ranks
DEFAULT_CHUNK = 32 * 2**20


def _payload(vocab: int) -> tuple[list, list, list]:
    rnd = random.Random(7)
    prompts = [[rnd.randrange(3, vocab) for _ in range(rnd.randint(2, 5))] for _ in range(SAMPLES)]
    # Rank 0's rows are short, rank 1's long: a token budget cuts them into different numbers of micro-batches.
    lengths = [1, 2, 2, 3, 9, 14, 12, 16]
    responses = [[rnd.randrange(3, vocab) for _ in range(n)] for n in lengths]
    scores = [rnd.uniform(-1, 1) for _ in range(SAMPLES)]
    return prompts, responses, scores


def _rank(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    from hpc_rl.train.distributed import shutdown_distributed

    results = {budget: _one_update(rank, model_dir, out_dir, budget) for budget in (0, 24)}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    shutdown_distributed()


def _one_update(rank: int, model_dir: str, out_dir: str, budget: int) -> dict:
    from hpc_rl import config
    from hpc_rl.orchestrator.batch import RolloutBatch
    from hpc_rl.rundir import RunDir
    from hpc_rl.train import experience
    from hpc_rl.train.distributed import init_distributed
    from hpc_rl.train.trainer import Trainer

    cfg = config.load_dict({
        "model": {"path": model_dir}, "seed": 3,
        "algorithm": {"name": "ppo", "group_size": 1, "kl": {"coef": 0.0}, "entropy_coef": 0.01},
        "trainer": {"device": "cpu", "lr": 1e-3, "prompts_per_step": SAMPLES, "mini_batch_size": SAMPLES,
                    "max_tokens_per_micro_batch": budget}})
    trainer = Trainer(cfg, RunDir(out_dir), init_distributed(cfg))
    vocab = trainer.actor.module.config.vocab_size
    # The token-budget side also runs the output layer in 5-token chunks, recomputed in backward under ZeRO-3's
    # parameter hooks; the padded side in one chunk.
    experience.LOGIT_CHUNK_BYTES = 4 * vocab * 5 if budget else DEFAULT_CHUNK
    prompts, responses, scores = _payload(vocab)
    n = len(prompts)
    batch = RolloutBatch(step=0, prompts=prompts, responses=responses, loss_masks=[[1] * len(r) for r in responses],
                         rollout_logprobs=[[0.0] * len(r) for r in responses], versions=[0] * n, truncated=[False] * n,
                         group_ids=list(range(n)), prompt_ids=list(range(n)))
    shard = trainer.shard(0, batch, scores)
    counts = []  # micro-batches of each planned pass (no-grad forwards, then the one mini-batch)
    plan = trainer.micro_batches
    trainer.micro_batches = lambda batch, rows: counts.append(len(out := plan(batch, rows))) or out
    fwd = trainer.forwards(shard)
    adv, returns = trainer.advantages(shard, fwd)
    stats = trainer.update(0, shard, fwd, adv, returns)
    computed, real = trainer._tokens
    return {"grad_norm": stats["grad_norm"], "critic_grad_norm": float(trainer.critic.get_global_grad_norm()),
            "actor_steps": trainer.actor.global_steps, "critic_steps": trainer.critic.global_steps,
            "skipped": stats["skipped_updates"], "old_logprobs_forward": trainer.old_logprobs_forward,
            "micro_batches": counts, "pad_fraction": 1 - real / computed}


def test_token_budget_update_equals_the_padded_update_on_two_ranks(tiny_model, tmp_path):
    mp.spawn(_rank, args=(free_port("127.0.0.1"), str(tiny_model), str(tmp_path)), nprocs=2, join=True)
    r = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(2)]
    padded, budget = r[0]["0"], r[0]["24"]
    assert not padded["old_logprobs_forward"]  # one epoch, one optimizer step: the update's forward gives them
    # The agreed number of micro-batches is the same on both ranks, and more than one under the budget.
    assert r[0]["24"]["micro_batches"] == r[1]["24"]["micro_batches"]
    assert r[0]["24"]["micro_batches"][-1] >= 3 and padded["micro_batches"][-1] == 1
    for res in (padded, budget):
        assert res["actor_steps"] == 1 and res["critic_steps"] == 1 and res["skipped"] == 0
    assert budget["grad_norm"] == pytest.approx(padded["grad_norm"], rel=1e-4)
    assert budget["critic_grad_norm"] == pytest.approx(padded["critic_grad_norm"], rel=1e-4)
    assert budget["pad_fraction"] < padded["pad_fraction"]
