"""One rank of bench/overhead.py's DeepSpeed reference: the same ZeRO-3 engines as a run's trainer (its
job.yaml), timed on the same batch shapes with no RL loop around them. Env: RANK, WORLD_SIZE, MASTER_*."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--samples", type=int, required=True, help="samples of one RL step (all ranks)")
    ap.add_argument("--prompt-len", type=int, required=True)
    ap.add_argument("--response-len", type=int, required=True)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from hpc_rl import config
    from hpc_rl.rundir import RunDir
    from hpc_rl.train.distributed import init_distributed, resolve_device_kind
    from hpc_rl.train.engines import build_actor, build_critic, build_reference
    from hpc_rl.train.experience import pack, policy_forward, value_forward

    cfg = config.load(RunDir(args.run_dir).job_yaml)
    dist = init_distributed(cfg)
    kind = resolve_device_kind(cfg)
    actor = build_actor(cfg, dist.world_size, kind)
    critic = build_critic(cfg, dist.world_size, kind) if cfg.algorithm.uses_critic else None
    ref = build_reference(cfg, dist.world_size, kind) if cfg.algorithm.kl.coef > 0 else None
    vocab = actor.module.config.vocab_size
    per_rank = args.samples // dist.world_size
    g = torch.Generator().manual_seed(dist.rank)
    prompts = torch.randint(3, vocab, (per_rank, args.prompt_len), generator=g).tolist()
    resps = torch.randint(3, vocab, (per_rank, args.response_len), generator=g).tolist()
    batch = pack(prompts, resps, 0)
    mb = cfg.trainer.mini_batch_size // dist.world_size
    micro = cfg.trainer.micro_batch_size or mb

    def nograd() -> None:
        with torch.no_grad():
            actor.eval()
            for s in range(0, per_rank, micro):
                policy_forward(actor, batch.slice(slice(s, s + micro)))
                if ref is not None:
                    policy_forward(ref, batch.slice(slice(s, s + micro)))
                if critic is not None:
                    critic.eval()
                    value_forward(critic, batch.slice(slice(s, s + micro)))

    def train() -> None:
        actor.train()
        if critic is not None:
            critic.train()
        for s in range(0, per_rank, micro):
            b = batch.slice(slice(s, s + micro))
            logp, _ = policy_forward(actor, b)
            actor.backward(-(logp * b.response_mask).sum() / b.response_mask.sum())
            actor.step()
            if critic is not None:
                v = value_forward(critic, b)
                critic.backward(((v ** 2) * b.response_mask).sum() / b.response_mask.sum())
                critic.step()

    times = {"nograd": [], "train": []}
    for rep in range(args.reps + 1):  # the first is warm-up
        for name, fn in (("nograd", nograd), ("train", train)):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            fn()
            torch.distributed.barrier()
            if rep:
                times[name].append(time.perf_counter() - t0)
    if dist.rank == 0:
        Path(args.out).write_text(json.dumps({k: statistics.median(v) for k, v in times.items()} | {"raw": times}))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
