"""The trainer section: the trainer ranks (DeepSpeed actor, critic, reference) and the optimization."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ..errors import ConfigError

if TYPE_CHECKING:
    from .job import JobConfig


def node_range(nodes: int | str) -> tuple[int, int]:
    """(MIN, MAX) of trainer.nodes: N or "MIN-MAX"; ConfigError naming the key."""
    if isinstance(nodes, int):
        return nodes, nodes
    parts = str(nodes).replace(" ", "").split("-")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ConfigError(f"trainer.nodes: {nodes!r} is neither a node count nor a range; use e.g. 2 or \"1-4\"")
    lo, hi = int(parts[0]), int(parts[1])
    if not 1 <= lo <= hi:
        raise ConfigError(f"trainer.nodes: the range {nodes!r} needs 1 <= MIN <= MAX; e.g. \"1-4\"")
    return lo, hi


@dataclass
class TrainerConfig:
    """The trainer ranks (DeepSpeed actor, critic, reference) and the optimization."""

    # Trainer nodes of a Slurm job (a local run uses this machine only); or a range "MIN-MAX": the job starts once
    # MIN are free and takes what Slurm gives up to MAX (each attempt of a requeued job again; a checkpoint resumes
    # on another number of trainer ranks).
    nodes: int | str = 1
    # Trainer ranks per node (one per GPU; on CPU, processes).
    procs_per_node: int = 2
    # Where the ranks compute; auto: cuda when a GPU is visible.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # GPUs of this machine the trainer ranks use in `hpc-rl run` (empty: the first procs_per_node).
    local_devices: list = field(default_factory=list)
    # CPU cores the trainer ranks of `hpc-rl run` are pinned to (empty: not pinned); the ranks share them.
    local_cpus: list = field(default_factory=list)
    # RL steps (each: generate, score, update, push weights).
    steps: int = 50
    # End the run before trainer.steps once, for every metric named here (a metrics.jsonl column), the mean of
    # its last stop_window steps reaches the value, e.g. {reward_mean: 0.8}; the run then ends as at its last
    # step (checkpoint, summary), without the evaluation after the last step unless one is due then. {}: never.
    stop_at: dict = field(default_factory=dict)
    # Steps averaged for stop_at.
    stop_window: int = 5
    # Prompts per step; samples per step = prompts_per_step x algorithm.group_size (SFT: rows per step).
    prompts_per_step: int = 16
    # Samples per optimizer step (over all ranks); must divide the samples per step.
    mini_batch_size: int = 64
    # Samples per forward/backward on one rank (gradient accumulation); 0: the whole per-rank mini-batch.
    # Ignored when max_tokens_per_micro_batch is set.
    micro_batch_size: int = 0
    # Token budget of one forward/backward on one rank (prompt + response tokens, padding included): samples
    # are sorted by length and cut into micro-batches of about this many tokens (verl's dynamic batch size);
    # 0: micro_batch_size samples each. Either way the loss is that of the whole mini-batch (algorithm.loss_agg).
    max_tokens_per_micro_batch: int = 0
    # Actor learning rate (AdamW).
    lr: float = 1e-5
    # Critic learning rate; null: the same as lr.
    critic_lr: float | None = None
    # AdamW weight decay.
    weight_decay: float = 0.0
    # AdamW betas.
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    # Optimizer steps of linear learning-rate warm-up.
    warmup_steps: int = 0
    # Learning rate after warm-up, over the run's optimizer steps: constant, or a linear or cosine decay
    # to min_lr_ratio x lr at the last step (a late decay keeps a converged policy from drifting off).
    # The decay spans trainer.steps: raising trainer.steps on resume stretches the rest of it.
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    # Where linear/cosine decay ends, as a fraction of lr (and of critic_lr).
    min_lr_ratio: float = 0.0
    # Gradient norm clip (0 disables it).
    grad_clip: float = 1.0
    # DeepSpeed ZeRO stage of actor and critic (3: parameters, gradients and optimizer state sharded).
    zero_stage: Literal[0, 1, 2, 3] = 3
    # Stop the run after this many optimizer steps in a row were skipped for a non-finite loss or gradient norm
    # (each is skipped on every rank alike, at every ZeRO stage, and counted in skipped_updates).
    max_skipped_in_a_row: int = 3
    # Merged into the rendered DeepSpeed config (any DeepSpeed key).
    deepspeed: dict = field(default_factory=dict)
    # Timeout of the ranks' collectives (torch.distributed) in seconds.
    dist_timeout_s: int = 600
    # Every N steps, compare the rollout server's log-probs of one sample with the actor's after the
    # weight push (0 = never); a mismatch beyond sync_tolerance stops the run.
    check_sync_every: int = 0
    # Largest accepted |log-prob difference| of that check (fp32: ~1e-4; bf16 engines: ~0.06).
    sync_tolerance: float = 1e-3


def check(cfg: JobConfig, need) -> None:
    t, r = cfg.trainer, cfg.rollout
    lo, hi = node_range(t.nodes)
    need(lo >= 1, f"trainer.nodes must be >= 1; got {t.nodes}")
    need(t.procs_per_node >= 1, f"trainer.procs_per_node must be >= 1; got {t.procs_per_node}")
    need(t.steps >= 1, f"trainer.steps must be >= 1; got {t.steps}")
    need(all(isinstance(k, str) and k and isinstance(v, (int, float)) and not isinstance(v, bool)
             and math.isfinite(v) for k, v in t.stop_at.items()),
         f"trainer.stop_at must map metric names to numbers, e.g. {{reward_mean: 0.8}}; got {t.stop_at}")
    need(t.stop_window >= 1, f"trainer.stop_window must be >= 1; got {t.stop_window}")
    need(t.prompts_per_step >= 1, "trainer.prompts_per_step must be >= 1")
    need(t.lr > 0, f"trainer.lr must be > 0; got {t.lr}")
    need(t.critic_lr is None or t.critic_lr > 0, "trainer.critic_lr must be > 0")
    need(t.warmup_steps >= 0, f"trainer.warmup_steps must be >= 0; got {t.warmup_steps}")
    need(0 <= t.min_lr_ratio <= 1, f"trainer.min_lr_ratio must be in [0, 1]; got {t.min_lr_ratio}")
    need(t.grad_clip >= 0, "trainer.grad_clip must be >= 0 (0 disables clipping)")
    need(t.max_skipped_in_a_row >= 1, f"trainer.max_skipped_in_a_row must be >= 1; got {t.max_skipped_in_a_row}")
    need(t.check_sync_every >= 0 and t.sync_tolerance > 0,
         "trainer.check_sync_every must be >= 0 and trainer.sync_tolerance > 0")
    samples = cfg.samples_per_step
    need(t.mini_batch_size >= 1, "trainer.mini_batch_size must be >= 1")
    need(samples % t.mini_batch_size == 0,
         f"trainer.mini_batch_size ({t.mini_batch_size}) must divide the samples per step "
         f"({'trainer.prompts_per_step' if cfg.algorithm.supervised else 'trainer.prompts_per_step x algorithm.group_size'}"
         f" = {samples})")
    for nodes in range(lo, hi + 1):  # every size a node range may start at
        world = nodes * t.procs_per_node
        of = f" ({nodes} node(s) of trainer.nodes {t.nodes})" if lo != hi else ""
        need(t.mini_batch_size % world == 0,
             f"trainer.mini_batch_size ({t.mini_batch_size}) must be divisible by the number of trainer ranks "
             f"(trainer.nodes x trainer.procs_per_node = {world}{of})")
        if t.micro_batch_size:
            need((t.mini_batch_size // world) % t.micro_batch_size == 0,
                 f"trainer.micro_batch_size ({t.micro_batch_size}) must divide the per-rank mini-batch "
                 f"({t.mini_batch_size // world}{of})")
    need(t.max_tokens_per_micro_batch >= 0,
         f"trainer.max_tokens_per_micro_batch must be >= 0 (0: micro_batch_size samples per micro-batch); "
         f"got {t.max_tokens_per_micro_batch}")
    need(len(t.betas) == 2 and all(isinstance(b, (int, float)) for b in t.betas),
         "trainer.betas must be a list of two numbers, e.g. [0.9, 0.999]")
    for key, cpus in (("trainer.local_cpus", t.local_cpus), ("rollout.local_cpus", r.local_cpus)):
        need(all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in cpus),
             f"{key} must be a list of CPU core numbers, e.g. [0]; got {cpus}")
    if t.local_devices and r.local_devices:
        overlap = sorted(set(map(str, t.local_devices)) & set(map(str, r.local_devices)))
        need(not overlap, f"rollout.local_devices: GPUs {overlap} are also in trainer.local_devices; "
             "give the rollout servers GPUs the trainer does not use")
    if t.local_devices:
        need(len(t.local_devices) == t.procs_per_node,
             f"trainer.local_devices names {len(t.local_devices)} GPUs but trainer.procs_per_node is "
             f"{t.procs_per_node}")
