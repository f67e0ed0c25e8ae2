"""Job spec: typed dataclasses loaded from YAML, dotted CLI overrides, validation with clear errors.

Every error names the dotted key and the fix; unknown keys suggest the closest valid spelling.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from .algos.registry import ALGORITHMS, algorithm
from .errors import ConfigError, first_line

# --------------------------------------------------------------------------- sections


@dataclass
class TinyModelConfig:
    """A small random-init model built offline (tests and CPU toys); saved as a normal HF folder."""

    # Architecture of the HF model class built from a config.
    arch: Literal["qwen2", "llama"] = "qwen2"
    # Width of the residual stream.
    hidden_size: int = 128
    # Transformer blocks.
    num_layers: int = 2
    # Attention (query) heads.
    num_heads: int = 2
    # Key/value heads (grouped-query attention when fewer than num_heads; must divide it).
    num_kv_heads: int = 2
    # Per-head width; vLLM's CPU attention rejects 16, 64 works on both engines.
    head_dim: int = 64
    # Width of the MLP.
    intermediate_size: int = 256
    # Longest sequence the model's position embeddings cover.
    max_position_embeddings: int = 512
    # Seed of the random initial weights (the tokenizer is trained on the task's symbols).
    init_seed: int = 0
    # Standard deviation of the random initial weights (transformers' initializer_range). A frozen output layer
    # (LoRA) bounds the logits by about init_std^2 x hidden_size x the final norm's width: 0.02 leaves a
    # 128-wide model's policy close to uniform whatever its adapters learn.
    init_std: float = 0.02


@dataclass
class LoraConfig:
    """Low-rank adapters (PEFT LoRA) on linear modules of the body; the base weights stay frozen."""

    # Rank r of each adapter (A: r x in, B: out x r).
    rank: int = 8
    # The adapters' output is scaled by alpha / rank.
    alpha: float = 16.0
    # Dropout on an adapter's input in training (0: none; > 0 costs one more no-grad forward per step).
    dropout: float = 0.0
    # Linear modules to adapt: module names or name suffixes (q_proj, v_proj, ...), or [all-linear] (every
    # linear layer of the body; never the output layer or the critic's value head).
    target_modules: list = field(default_factory=lambda: ["all-linear"])


@dataclass
class ModelConfig:
    """The policy (actor); the critic and the reference start from the same weights unless named."""

    # HF model folder (config.json, weights, tokenizer files) of the policy; or set `tiny` instead.
    path: str | None = None
    # Build a tiny random model offline instead of loading `path` (toys and tests).
    tiny: TinyModelConfig | None = None
    # HF folder the critic starts from (PPO); null: the policy's weights with a fresh value head.
    critic_path: str | None = None
    # Training precision of actor, critic and reference.
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # Attention kernel of the trainer's models (flash_attention_2 needs the flash-attn package and a GPU).
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] = "sdpa"
    # Recompute activations in the backward pass: less memory, ~30% more compute.
    gradient_checkpointing: bool = False
    # Allow code shipped inside the model folder to run (transformers' trust_remote_code).
    trust_remote_code: bool = False
    # Train the actor through LoRA adapters (null: all weights); the reference is then the actor with its
    # adapters off, and weight syncs push only the adapters.
    lora: LoraConfig | None = None
    # Train the critic's body through LoRA adapters (its value head stays fully trained); null: all weights.
    critic_lora: LoraConfig | None = None


@dataclass
class DataConfig:
    """Prompt dataset: `toy:NAME`, a .jsonl/.parquet file, or `hf:NAME` (an HF datasets name or folder)."""

    # Where the prompts come from: toy:NAME, a .jsonl/.parquet file, or hf:NAME.
    source: str = "toy:repeat_digit"
    # The split of an hf: dataset.
    split: str = "train"
    # The row field holding the prompt (a string, or a chat as a list of {role, content}).
    prompt_key: str = "prompt"
    # Longest prompt in tokens; a longer one is an error at load naming its row.
    max_prompt_tokens: int = 128
    # Number of rows a toy: dataset generates.
    toy_size: int = 2000
    # Sample prompts in a seeded random order (false: in file order); either way a resume sees the same data.
    shuffle: bool = True


@dataclass
class RewardModelConfig:
    """A sequence-classification reward model: one score per sample, read at the last real token of prompt + response."""

    # HF folder loaded with AutoModelForSequenceClassification (config.json, weights, tokenizer files).
    path: str | None = None
    # Build the tiny reward model of a toy task offline instead of `path` (e.g. toy:repeat_digit; tests and toys).
    tiny: str | None = None
    # Allow code shipped inside the folder to run (transformers' trust_remote_code).
    trust_remote_code: bool = False
    # Precision of the reward model; null: model.dtype.
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    # The head's output used as the score, for heads with more than one label (null: the head must have one).
    label_index: int | None = None
    # score = transform(scale * (logit - shift)): sigmoid/tanh bound raw logits (a binary head's logits in
    # [-15, -8] would otherwise be dwarfed by the KL penalty).
    transform: Literal["raw", "sigmoid", "tanh"] = "raw"
    # Multiplies the logit (after the shift), before the transform.
    scale: float = 1.0
    # Subtracted from the logit before scaling (e.g. the mean logit of the reward model on reference answers).
    shift: float = 0.0
    # Longest prompt + response in the reward model's tokens; longer ones keep their last max_length tokens.
    max_length: int = 1024
    # Sequences per reward-model forward (on each trainer rank, or per server request).
    batch_size: int = 8
    # trainer: a ZeRO-3 inference engine on the trainer ranks (partitioned like the reference model);
    # server: on the rollout servers' nodes, on a GPU of its own (each server gets tensor_parallel + 1 GPUs).
    placement: Literal["trainer", "server"] = "trainer"


@dataclass
class OverlongConfig:
    """DAPO's soft overlong punishment (https://arxiv.org/abs/2503.14476, eq. 13): a response longer than the length
    budget minus buffer_tokens loses penalty x (its excess / buffer_tokens), linearly up to penalty at the budget."""

    # The last tokens of the budget over which the penalty grows; 0: off.
    buffer_tokens: int = 0
    # The penalty at the budget (DAPO: 1.0, the reward's scale).
    penalty: float = 1.0


@dataclass
class RewardConfig:
    """Rewards: a callable `pkg.mod:fn(prompt, completion, **row_fields) -> float`, a reward model, or both."""

    # The reward callable as pkg.module:function (importable by the trainer ranks); null: the reward model only.
    function: str | None = "hpc_rl.rewards.toy:repeat_digit"
    # Extra keyword arguments passed to every call.
    kwargs: dict = field(default_factory=dict)
    # batched: fn(prompts, completions, **fields_as_lists) -> B floats, for functions that vectorize.
    batched: bool = False
    # A sequence-classification reward model; null: none.
    model: RewardModelConfig | None = None
    # Nodes of their own for the reward model (placement: server): one reward server on each, after the rollout
    # nodes; 0: each rollout server hosts it, on a GPU of its own.
    nodes: int = 0
    # Weights of the parts when both are given: {function: w, model: w} (a missing part weighs 1.0).
    weights: dict = field(default_factory=dict)
    # A rule-based score `pkg.mod:fn(prompt, completion, **row_fields)` (no reward.kwargs) logged as monitor_mean, never
    # trained on.
    monitor: str | None = None
    # Multiply every (combined) reward by this.
    scale: float = 1.0
    # Standardize rewards with running mean/std over the whole run (kept in checkpoints).
    normalize: bool = False
    # Clip rewards to [-clip, clip] after scaling/normalizing; null: no clipping.
    clip: float | None = None
    # DAPO's soft overlong punishment, added to the reward as the part "overlong".
    overlong: OverlongConfig = field(default_factory=OverlongConfig)

    @property
    def parts(self) -> list[str]:
        """The reward's parts that are trained on: 'function', 'model' or both."""
        return [name for name, on in (("function", self.function), ("model", self.model)) if on]

    @property
    def on_rollout_servers(self) -> bool:
        """Whether each rollout server hosts the reward model (placement server without reward nodes)."""
        return self.model is not None and self.model.placement == "server" and not self.nodes


@dataclass
class KLConfig:
    """The KL(policy || reference) penalty; a reference model is built only when coef > 0 or adaptive."""

    # KL coefficient beta (the initial one when adaptive).
    coef: float = 0.0
    # Per-token estimator (Schulman's k1/k2/k3, http://joschu.net/blog/kl-approx.html).
    estimator: Literal["k1", "k2", "k3"] = "k3"
    # Put the KL into the per-token rewards (true) or add it to the loss (false); null: the algorithm's
    # default (PPO and REINFORCE++: rewards; GRPO and RLOO: loss, the only place they allow).
    in_reward: bool | None = None
    # Steer coef toward `target` KL (Ziegler et al. 2019, https://arxiv.org/abs/1909.08593).
    adaptive: bool = False
    # KL the adaptive controller aims for.
    target: float = 0.1
    # Samples over which the adaptive controller moves coef by at most 20%.
    horizon: int = 10000


@dataclass
class DynamicSamplingConfig:
    """DAPO's dynamic sampling (https://arxiv.org/abs/2503.14476, verl's algorithm.filter_groups): groups whose
    rewards (the task's, without reward.overlong's penalty) are all equal teach nothing and are dropped; more
    prompts are generated until the step has trainer.prompts_per_step groups with a reward spread."""

    # Drop groups without a reward spread and generate more.
    enabled: bool = False
    # Generation rounds per step at most (the first included); each round asks for as many prompts as are missing.
    max_gen_batches: int = 4
    # When the rounds run out short of groups: warn (train on the groups there are, padded with dropped ones to
    # keep the batch size) or error (stop with a checkpoint).
    on_exhausted: Literal["warn", "error"] = "warn"


AlgorithmName = Literal[tuple(ALGORITHMS)]  # noqa: PYI047 (the registry's names, checked at load)


@dataclass
class AlgorithmConfig:
    """The RL algorithm (see hpc_rl/algos/registry.py) and its loss settings."""

    # Advantage estimator and what it needs: ppo (GAE + critic), grpo, rloo, reinforce_pp.
    name: AlgorithmName = "grpo"
    # Samples generated per prompt (GRPO/RLOO compare them with each other).
    group_size: int = 8
    # Discount over response tokens (GAE, REINFORCE++).
    gamma: float = 1.0
    # GAE's lambda (PPO).
    lam: float = 0.95
    # PPO clip: the ratio is clipped to [1 - clip_ratio, 1 + clip_ratio].
    clip_ratio: float = 0.2
    # DAPO's decoupled upper clip (https://arxiv.org/abs/2503.14476): the ratio is clipped to
    # [1 - clip_ratio, 1 + clip_ratio_high]; null: the same as clip_ratio.
    clip_ratio_high: float | None = None
    # Clip of the critic's value change per update (PPO); null: no clipping.
    value_clip: float | None = 0.2
    # Weight of the value loss (PPO).
    value_coef: float = 0.5
    # Weight of the entropy bonus (0: none).
    entropy_coef: float = 0.0
    # How token losses become one number: mean over all tokens, or per sequence then over sequences.
    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"
    # GRPO: divide by the group's std (false: Dr. GRPO, https://arxiv.org/abs/2503.20783).
    norm_adv_by_std: bool = True
    # PPO: whiten the GAE advantages over the whole batch.
    whiten_advantages: bool = True
    # Passes over the step's samples (each pass: all mini-batches).
    ppo_epochs: int = 1
    # Off-policy correction between the rollout engine's log-probs and the trainer's (algos/correction.py):
    # tis multiplies each token's policy loss by min(exp(trainer - engine), tis_cap); auto: tis when
    # rollout.async_steps > 0 (samples from older policies), else none.
    rollout_correction: Literal["auto", "none", "tis"] = "auto"
    # The truncation cap C of the importance weight (tis).
    tis_cap: float = 2.0
    # The KL penalty to the reference model.
    kl: KLConfig = field(default_factory=KLConfig)
    # The policy loss (algos/losses.py POLICY_LOSSES): ppo, the clipped surrogate; cispo, MiniMax-M1's clipped
    # importance-sampling weight (stop-gradient) x advantage x log-prob: every token keeps its gradient
    # (https://arxiv.org/abs/2506.13585). Its weight is clipped to [1 - clip_ratio, 1 + clip_ratio_high]; MiniMax-M1
    # sets no lower bound (clip_ratio: 1.0) and tunes the upper one only.
    policy_loss: Literal["ppo", "cispo"] = "ppo"
    # The importance ratio: per token, or GSPO's length-normalized sequence ratio (https://arxiv.org/abs/2507.18071,
    # its GSPO-token form: every token's ratio has the sequence's value and its own gradient). GSPO's clip ranges
    # are about 1000x smaller than PPO's (the paper: clip_ratio 3e-4, clip_ratio_high 4e-4) and it averages per
    # sequence (loss_agg: seq_mean). Needs sequence-level advantages (grpo, rloo).
    ratio: Literal["token", "sequence"] = "token"
    # Leave truncated samples (no stop before the length budget) out of the loss (DAPO's overlong filtering, TRL's
    # mask_truncated_completions); they still count in their group's advantages.
    mask_truncated: bool = False
    # DAPO's dynamic sampling (groups with a reward spread only).
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)

    @property
    def uses_critic(self) -> bool:
        return algorithm(self.name).needs_critic

    def correction(self, async_steps: int) -> str:
        """The rollout correction in effect ("none" or "tis"), resolving auto by the rollout mode."""
        if self.rollout_correction != "auto":
            return self.rollout_correction
        return "tis" if async_steps > 0 else "none"

    @property
    def kl_in_reward(self) -> bool:
        if self.kl.in_reward is not None:
            return self.kl.in_reward
        return algorithm(self.name).kl_in_reward


@dataclass
class TrainerConfig:
    """The trainer ranks (DeepSpeed actor, critic, reference) and the optimization."""

    # Trainer nodes of a Slurm job (a local run uses this machine only).
    nodes: int = 1
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
    # Prompts per step; samples per step = prompts_per_step x algorithm.group_size.
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


@dataclass
class SandboxConfig:
    """Limits of the sandbox that runs model-written code (the python tool); see
    hpc_rl.rollout.environments.sandbox for what each layer guarantees."""

    # Wall-clock seconds of one run (at most rollout.tool_timeout_s).
    wall_s: float = 10.0
    # CPU seconds of one run.
    cpu_s: int = 10
    # Address space of each sandboxed process in MiB.
    memory_mb: int = 1024
    # Processes the sandbox may run at once (a fork bomb stops there).
    processes: int = 16
    # Bytes of stdout+stderr returned to the model (the run is killed past it).
    output_bytes: int = 8192
    # Refuse to run model code where kernel namespaces are unavailable (rlimits alone do not stop reads of the
    # user's files or network access); false: run it with rlimits only.
    require_isolation: bool = True


@dataclass
class RolloutConfig:
    """The rollout servers: engine, sampling, placement, weight sync and timeouts."""

    # Generation engine; auto: vllm when it imports, else the HF engine.
    engine: Literal["auto", "vllm", "hf"] = "auto"
    # Rollout nodes of a Slurm job (0: the servers share the first trainer node).
    nodes: int = 1
    # Rollout servers per rollout node (e.g. one per GPU group of tensor_parallel GPUs). 0 (with nodes 0): none of
    # the job's own; the trainer waits for rollout jobs (`hpc-rl rollout add RUN`).
    servers_per_node: int = 1
    # GPUs of this machine the rollout servers use in `hpc-rl run` (tensor_parallel per server).
    local_devices: list = field(default_factory=list)
    # CPU cores the rollout servers of `hpc-rl run` are pinned to (empty: not pinned), e.g. [1] beside
    # trainer.local_cpus [0] to model a trainer node and a rollout node on one machine.
    local_cpus: list = field(default_factory=list)
    # Address the servers bind; 0.0.0.0 (all interfaces) so that other nodes reach them.
    host: str = "0.0.0.0"
    # Port the servers bind; 0: a free one, published in the run dir.
    port: int = 0
    # Sampling temperature (also applied to the trainer's log-probs).
    temperature: float = 1.0
    # Nucleus sampling mass (1: off).
    top_p: float = 1.0
    # Top-k sampling (-1: off).
    top_k: int = -1
    # Longest response in tokens.
    max_new_tokens: int = 16
    # Strings that end a response (each must be one token).
    stop: list = field(default_factory=list)
    # GPUs per vLLM server (tensor parallelism).
    tensor_parallel: int = 1
    # vLLM: fraction of GPU memory for weights + KV cache (on CPU: of one NUMA node's RAM, used only when
    # kv_cache_bytes is 0).
    gpu_memory_utilization: float = 0.2
    # vLLM's KV cache in bytes (its kv_cache_memory_bytes), on CPU and GPU. null: on CPU derived from the job
    # (concurrent sequences x max_model_len x the model's K/V bytes per token), on GPU sized by vLLM from
    # gpu_memory_utilization; 0: always from gpu_memory_utilization (on CPU a fraction of a NUMA node's RAM).
    kv_cache_bytes: int | None = None
    # Longest prompt + response the engine accepts.
    max_model_len: int = 256
    # vLLM: no CUDA graphs (faster start, slower decode).
    enforce_eager: bool = True
    # Engine precision; auto: bfloat16 for vLLM, the model's for HF.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # How new weights reach the servers: a collective broadcast, a file on the shared filesystem, or HTTP;
    # auto: collective where possible.
    weight_sync: Literal["auto", "collective", "file", "http"] = "auto"
    # Seconds one request (a generation chunk, a weight push) may take before it is retried elsewhere.
    request_timeout_s: float = 300.0
    # Retries of a failed request on other servers.
    retries: int = 2
    # Samples one request may ask a server for (prompts x n); a larger request is refused with 400 (the trainer's
    # client splits its work to fit). Bounds what one request can make a server hold.
    max_samples_per_request: int = 1024
    # Tokens one request may ask for: its prompt tokens plus n x max_new_tokens per prompt; past it, 400. null:
    # max_samples_per_request x max_model_len (no bound beyond the sample count).
    max_tokens_per_request: int | None = None
    # Requests a server holds at once (running or queued); one more is answered 429 with Retry-After, which the
    # client treats as "try another server, or again shortly".
    max_requests_in_flight: int = 256
    # HF engine: samples generated together in one batch; a larger request is generated in chunks of this many,
    # taking turns with other requests, so that one large request cannot starve small ones.
    hf_batch_samples: int = 256
    # Seconds to wait for every rollout server to come up.
    startup_timeout_s: float = 900.0
    # Seconds the trainer waits, with no rollout server left (or none yet: servers_per_node 0), for one to come
    # back or join (a requeued rollout job, `hpc-rl rollout add`) before it stops with a checkpoint; null:
    # startup_timeout_s; 0: stop at once.
    wait_for_servers_s: float | None = None
    # Generation runs this many steps ahead of training (0: generate, then train, in turn). Batch s is
    # generated by policy version max(0, s - async_steps) while the trainer trains the earlier batches,
    # so no sample is more than async_steps versions old (checked every step); see DESIGN.md.
    async_steps: int = 0
    # Multi-turn rollouts: the environment class as pkg.module:Class (hpc_rl.rollout.environments.base has the
    # interface; built in: hpc_rl.rollout.environments.tool_env:ToolCallEnv); null: one completion per prompt.
    env: str | None = None
    # Keyword arguments of the environment's constructor (one instance per trajectory).
    env_kwargs: dict = field(default_factory=dict)
    # Assistant turns per trajectory; each samples at most max_new_tokens.
    max_turns: int = 4
    # Response tokens per trajectory, assistant and observation turns together; 0: max_model_len minus
    # data.max_prompt_tokens.
    max_total_tokens: int = 0
    # Seconds one environment step (a tool call) may take; past it the trajectory ends, counted as a tool error.
    tool_timeout_s: float = 30.0
    # The sandbox of the built-in python tool.
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)

    @property
    def server_wait_s(self) -> float:
        """wait_for_servers_s, its null resolved to startup_timeout_s."""
        return self.startup_timeout_s if self.wait_for_servers_s is None else float(self.wait_for_servers_s)

    def total_tokens(self, max_prompt_tokens: int) -> int:
        """The response budget of one trajectory (max_total_tokens, or what max_model_len leaves)."""
        return self.max_total_tokens or self.max_model_len - max_prompt_tokens


@dataclass
class EvalConfig:
    """Held-out evaluation during training: the policy of a step generates on prompts it never trains on, on the
    rollout servers, with seeds of its own (training samples are the same with evaluation on or off)."""

    # The held-out prompts, in any form data.source takes (toy:NAME, a .jsonl/.parquet file, hf:NAME); null: none.
    source: str | None = None
    # The split of an hf: dataset or of a toy task (toy tasks with held-out prompts have a test split).
    split: str = "test"
    # The row field holding the prompt (null: data.prompt_key).
    prompt_key: str | None = None
    # Evaluate every N steps and after the last step; 0: only after the last step.
    every: int = 0
    # Also evaluate the initial policy (step 0): the baseline the later numbers are read against.
    at_start: bool = True
    # Samples per prompt k: pass@k is reported for k = 1, 2, 4, ... up to it (unbiased estimator).
    samples_per_prompt: int = 1
    # Sampling temperature; 0 is greedy (then samples_per_prompt must be 1).
    temperature: float = 0.0
    # Nucleus sampling mass (1: off).
    top_p: float = 1.0
    # Longest response in tokens; null: rollout.max_new_tokens.
    max_new_tokens: int | None = None
    # Evaluate a fixed, seeded subset of this many prompts; null: all of them.
    max_prompts: int | None = None
    # The scoring function pkg.module:function (as reward.function); null: reward.function with reward.kwargs.
    reward: str | None = None
    # Keyword arguments of eval.reward (only when eval.reward is set).
    reward_kwargs: dict = field(default_factory=dict)
    # A sample passes (pass@k) when its score is >= this.
    pass_threshold: float = 1.0

    @property
    def enabled(self) -> bool:
        return self.source is not None

    def due(self, step: int, last_step: int) -> bool:
        """Whether the policy after `step` steps (0: the initial one) is evaluated."""
        if not self.enabled:
            return False
        if step == 0:
            return self.at_start
        return step == last_step or (self.every > 0 and step % self.every == 0)


@dataclass
class CheckpointConfig:
    """Checkpoints: checkpoints/step_N/{hf,deepspeed}/, written atomically."""

    # Save every N steps (and at the end); 0: only when preempted or stopped.
    every: int = 0
    # Keep the newest K checkpoints.
    keep_last: int = 2
    # Also write the actor as an HF model folder (what `hpc-rl export` and from_pretrained read).
    save_hf: bool = True
    # Keep the checkpoint with the best value of this evaluation metric (e.g. eval/pass@1) besides the newest
    # keep_last, linked as checkpoints/best; a checkpoint is then also written at every evaluated step. null: off.
    keep_best: str | None = None
    # Whether a larger (max) or a smaller (min) keep_best value is better.
    best_mode: Literal["max", "min"] = "max"


@dataclass
class NCCLConfig:
    """NCCL settings exported to every process of the job."""

    # NCCL_SOCKET_IFNAME: the network interface NCCL uses (e.g. ib0); null: NCCL's choice.
    socket_ifname: str | None = None
    # NCCL_IB_DISABLE: true turns InfiniBand off (a broken fabric); null: NCCL's choice.
    ib_disable: bool | None = None
    # NCCL_DEBUG level (e.g. INFO to see the chosen transports); null: WARN.
    debug: str | None = None
    # Seconds a collective may hang before NCCL aborts it (instead of a silent hang).
    timeout_s: int = 1800


@dataclass
class EnvConfig:
    """The environment of every process of the job."""

    # Variables exported to every process (they win over everything else).
    vars: dict = field(default_factory=dict)
    # NCCL settings.
    nccl: NCCLConfig = field(default_factory=NCCLConfig)


@dataclass
class SlurmConfig:
    """What `hpc-rl submit` asks Slurm for."""

    # Partition (#SBATCH --partition); null: the cluster's default.
    partition: str | None = None
    # Account to charge (--account).
    account: str | None = None
    # Quality of service (--qos).
    qos: str | None = None
    # Time limit, Slurm's spelling (HH:MM:SS, D-HH:MM:SS, minutes).
    time: str = "01:00:00"
    # GPUs per node (--gpus-per-node); 0: none.
    gpus_per_node: int = 0
    # CPUs of the one task per node (--cpus-per-task).
    cpus_per_task: int | None = None
    # Memory per node, Slurm's spelling (64G; 0 = the whole node).
    mem: str | None = None
    # Node features (--constraint).
    constraint: str | None = None
    # Whole nodes only (--exclusive).
    exclusive: bool = False
    # Seconds before the time limit (or preemption) Slurm warns the job: checkpoint, then requeue.
    signal_delay_s: int = 120
    # Let Slurm requeue the job (preemption, time limit).
    requeue: bool = True
    # After a crash of the trainer (a rank died, a node was lost), requeue the job up to this many
    # times; it resumes from the latest checkpoint (0 = fail the job).
    requeue_on_failure: int = 0
    # E-mail address for Slurm's notifications.
    mail_user: str | None = None
    # Which notifications (BEGIN, END, FAIL, ALL).
    mail_type: str | None = None
    # Sweeps: at most this many array elements run at once (the %N throttle).
    array_parallelism: int | None = None
    # single: one job of all nodes; hetjob: trainer and rollout nodes as components (own partitions/GPUs).
    layout: Literal["single", "hetjob"] = "single"
    # hetjob: partition of the rollout component; null: `partition`.
    rollout_partition: str | None = None
    # hetjob: GPUs per rollout node; null: gpus_per_node.
    rollout_gpus_per_node: int | None = None
    # Any other #SBATCH option as {name: value} (true: a bare flag).
    additional: dict = field(default_factory=dict)
    # Shell lines run on every node before the job (module load ..., source ...).
    setup: list = field(default_factory=list)


@dataclass
class WandbConfig:
    """Weights & Biases: rank 0 logs metrics.jsonl's metrics (extra `tracking`); offline on nodes without internet."""

    # online: upload while training (needs internet and a login); offline: files in RUN/wandb/, uploaded later
    # with `hpc-rl sync RUN` from a login node; disabled: no W&B.
    mode: Literal["online", "offline", "disabled"] = "disabled"
    # The W&B project.
    project: str = "hpc-rl"
    # The W&B entity (team or user); null: your default entity.
    entity: str | None = None
    # Runs of one group are compared together; null: the sweep's name for a sweep's points, else none.
    group: str | None = None
    # Tags of the run.
    tags: list = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return self.mode != "disabled"


@dataclass
class MlflowConfig:
    """MLflow: rank 0 logs metrics.jsonl's metrics (extra `tracking`); on when experiment or tracking_uri is set."""

    # Tracking URI (http://host:5000, sqlite:///path.db, a folder); null: a file store in RUN/mlruns.
    tracking_uri: str | None = None
    # The experiment; null: the sweep's name for a sweep's points, else the job's name.
    experiment: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.tracking_uri or self.experiment)


@dataclass
class LoggingConfig:
    """Per-step metrics: metrics.jsonl always, TensorBoard when enabled, a step line on the console; W&B, MLflow."""

    # Also write TensorBoard events (RUN/tensorboard/).
    tensorboard: bool = True
    # Print the step line every N steps (metrics.jsonl gets every step).
    every: int = 1
    # Weights & Biases (logging.wandb.mode=offline on compute nodes, then `hpc-rl sync`).
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # MLflow (logging.mlflow.experiment=NAME logs into a file store in the run dir).
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)


@dataclass
class JobConfig:
    """A whole job spec."""

    # Name of the run (the run dir is OUTPUT_DIR/NAME-YYYYmmdd-HHMMSS, the Slurm job name).
    name: str = "job"
    # Seed of data order, sampling and initialization.
    seed: int = 1
    # Folder the run dirs go into.
    output_dir: str = "runs"
    # The policy model.
    model: ModelConfig = field(default_factory=ModelConfig)
    # The prompts.
    data: DataConfig = field(default_factory=DataConfig)
    # The reward function.
    reward: RewardConfig = field(default_factory=RewardConfig)
    # The RL algorithm and its loss.
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    # The trainer ranks and the optimization.
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # The rollout servers.
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    # Held-out evaluation (eval.jsonl, eval/step_N.jsonl).
    eval: EvalConfig = field(default_factory=EvalConfig)
    # Checkpoints.
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # The processes' environment.
    env: EnvConfig = field(default_factory=EnvConfig)
    # Slurm resources.
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    # Metrics and the step line.
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps of the whole run: RL steps x PPO epochs x mini-batches per step."""
        per_step = self.samples_per_step // max(self.trainer.mini_batch_size, 1)
        return self.trainer.steps * self.algorithm.ppo_epochs * per_step

    @property
    def samples_per_step(self) -> int:
        return self.trainer.prompts_per_step * self.algorithm.group_size

    @property
    def world_size(self) -> int:
        return self.trainer.nodes * self.trainer.procs_per_node

    @property
    def gpus_per_rollout_server(self) -> int:
        """GPUs of one rollout server: its tensor-parallel ones, and one more for a reward model it hosts."""
        return self.rollout.tensor_parallel + (1 if self.reward.on_rollout_servers else 0)

    @property
    def response_budget(self) -> int:
        """Response tokens a sample may have: rollout.max_new_tokens, or a multi-turn trajectory's total budget."""
        r = self.rollout
        return r.total_tokens(self.data.max_prompt_tokens) if r.env else r.max_new_tokens

    @property
    def rollout_servers(self) -> int:
        """How many rollout servers the job runs (rollout.nodes=0, or a local run: one node's worth); rollout jobs'
        servers come on top."""
        return max(1, self.rollout.nodes) * self.rollout.servers_per_node


def pass_k_values(k: int) -> list[int]:
    """The k' of the pass@k' an evaluation with k samples per prompt reports: 1, 2, 4, ... below k, and k."""
    ks, j = [], 1
    while j < k:
        ks.append(j)
        j *= 2
    return ks + [k]


def eval_metric_names(k: int) -> list[str]:
    """The eval/ metrics an evaluation with k samples per prompt reports (eval/pass_at_k.py computes them)."""
    return (["eval/reward_mean", f"eval/mean@{k}"] + [f"eval/pass@{j}" for j in pass_k_values(k)]
            + ["eval/response_tokens_mean", "eval/truncated_frac"])


# --------------------------------------------------------------------------- building from dicts


def type_name(tp: Any) -> str:
    """How a config type reads in messages and `hpc-rl config show` ("an integer or null")."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(type_name(a) for a in args) + " or null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false",
            list: "a list", dict: "a mapping"}.get(tp, getattr(tp, "__name__", str(tp)))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`; returns the converted value or raises ConfigError."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], key)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices and type(value) is type(choices[choices.index(value)]):
            return value
        hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        extra = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(f"{key}: {value!r} is not valid; use {type_name(tp)}{extra}")
    if dataclasses.is_dataclass(tp):
        if value is None:  # an empty YAML section (`algorithm:` with all keys commented out): the defaults
            return tp()
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of settings, got {type(value).__name__} {value!r}")
        return _build(tp, value, key)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            # YAML 1.1 reads "1e-6" as a string; accept numeric strings for floats only.
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                raise ConfigError(f"{key}: {value!r} is not a finite number; give a finite value")
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    elif tp is list:
        if isinstance(value, list):
            return value
    elif tp is dict:
        if isinstance(value, dict):
            return value
    else:  # pragma: no cover - a field type this loader does not know is a bug
        raise TypeError(f"unsupported config field type {tp!r} at {key}")
    raise ConfigError(f"{key}: expected {type_name(tp)}, got {type(value).__name__} {value!r}")


# Keys that no longer exist, and what replaces them.
RENAMED = {
    "rollout.max_policy_lag": "replaced by rollout.async_steps (the one bound on how many policy versions a sample "
                              "may lag; 0 = strictly on-policy); remove the key or set rollout.async_steps",
}


# Keys renamed with the same meaning (near enough): read under the new name with a warning, so that the resolved
# job.yaml of a run written by an earlier version still loads (a resume, an offline evaluation, a requeue).
MIGRATED = {
    # now counts optimizer steps skipped in a row rather than RL steps with a skip
    "trainer.max_nonfinite_steps": "max_skipped_in_a_row",
}


def _build(cls: type, data: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if dotted in RENAMED:
            raise ConfigError(f"{dotted}: {RENAMED[dotted]}")
        if dotted in MIGRATED:
            new = MIGRATED[dotted]
            if new in data:
                raise ConfigError(f"{dotted}: renamed {prefix}.{new}, which is also given; remove {dotted}")
            logging.getLogger("hpc_rl").warning("%s is now %s.%s; read as that (rename it in the job file)",
                                                dotted, prefix, new)
            key, dotted = new, f"{prefix}.{new}"
        if key not in names:
            hint = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            fix = f"did you mean '{(prefix + '.') if prefix else ''}{hint[0]}'?" if hint else \
                f"valid keys here: {', '.join(names)}"
            raise ConfigError(f"{dotted}: unknown key; {fix}")
        kwargs[key] = _coerce(value, hints[key], dotted)
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict:
    """The resolved config as plain data (what is written to the run dir as job.yaml)."""
    return dataclasses.asdict(cfg)


# --------------------------------------------------------------------------- overrides


def parse_override(text: str) -> tuple[list[str], Any]:
    """`trainer.lr=1e-6` -> (['trainer', 'lr'], 1e-6); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY=VALUE with a dotted key, e.g. trainer.lr=1e-6")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: the key is empty; use a dotted key such as trainer.lr=1e-6")
    try:
        value = yaml.safe_load(raw) if raw.strip() != "" else None
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply dotted `key=value` overrides to a raw (not yet validated) config mapping."""
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for i, part in enumerate(path[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {text!r}: {'.'.join(path[:i + 1])} is not a section")
            node = nxt
        node[path[-1]] = value
    return data


# --------------------------------------------------------------------------- validation


def validate(cfg: JobConfig) -> JobConfig:
    """Cross-field checks that types alone cannot express; raises ConfigError naming the key."""
    a, t, r, m = cfg.algorithm, cfg.trainer, cfg.rollout, cfg.model

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(msg)

    need(bool(cfg.name) and "/" not in cfg.name and not cfg.name.startswith("."),
         f"name: {cfg.name!r} must be a non-empty name without '/'")
    need(m.path is not None or m.tiny is not None,
         "model.path: no model given; set model.path to an HF model folder (or model.tiny for a toy model)")
    need(m.path is None or m.tiny is None, "model.tiny: set either model.path or model.tiny, not both")
    if m.tiny is not None:
        tm = m.tiny
        need(tm.num_kv_heads > 0 and tm.num_heads % tm.num_kv_heads == 0,
             "model.tiny.num_kv_heads must divide model.tiny.num_heads")
        need(tm.hidden_size > 0 and tm.num_layers > 0 and tm.head_dim > 0, "model.tiny: sizes must be positive")
    need(a.group_size >= 1, "algorithm.group_size must be >= 1")
    if algorithm(a.name).group_baseline:
        need(a.group_size >= 2, f"algorithm.group_size must be >= 2 for {a.name} "
             f"(advantages compare samples of the same prompt); got {a.group_size}")
        need(a.kl.in_reward is not True, f"algorithm.kl.in_reward: {a.name} computes advantages from whole-sequence "
             "scores, so the KL penalty cannot go into per-token rewards; use algorithm.kl.in_reward: false (a loss term)")
    if a.policy_loss == "cispo":  # 1.0: no lower bound on the importance weight
        need(0 < a.clip_ratio <= 1, f"algorithm.clip_ratio must be in (0, 1] with cispo; got {a.clip_ratio}")
    else:
        need(0 < a.clip_ratio < 1, f"algorithm.clip_ratio must be in (0, 1); got {a.clip_ratio}")
    if a.ratio == "sequence":
        need(algorithm(a.name).group_baseline,
             f"algorithm.ratio: sequence (GSPO) weighs whole sequences, so it needs one advantage per sequence (grpo, "
             f"rloo); {a.name} gives per-token advantages: use algorithm.ratio: token, or algorithm.name: grpo")
    ds = a.dynamic_sampling
    if ds.enabled:
        need(ds.max_gen_batches >= 1, f"algorithm.dynamic_sampling.max_gen_batches must be >= 1 (generation rounds per "
             f"step, the first included); got {ds.max_gen_batches}")
        need(a.group_size >= 2, "algorithm.dynamic_sampling needs groups: algorithm.group_size >= 2 (a group of one "
             f"never has a reward spread); got {a.group_size}")
        need(cfg.reward.model is None or cfg.reward.model.placement == "server",
             "algorithm.dynamic_sampling decides on rank 0 before the trainer ranks score: with a reward model use "
             "reward.model.placement: server")
    need(a.value_clip is None or a.value_clip > 0, f"algorithm.value_clip must be > 0 or null (no clipping); got {a.value_clip}")
    need(a.clip_ratio_high is None or 0 < a.clip_ratio_high < 10,
         f"algorithm.clip_ratio_high must be in (0, 10) (DAPO uses 0.28) or null; got {a.clip_ratio_high}")
    need(0 <= a.gamma <= 1, f"algorithm.gamma must be in [0, 1]; got {a.gamma}")
    need(0 <= a.lam <= 1, f"algorithm.lam must be in [0, 1]; got {a.lam}")
    need(a.ppo_epochs >= 1, "algorithm.ppo_epochs must be >= 1")
    need(a.kl.coef >= 0, f"algorithm.kl.coef must be >= 0; got {a.kl.coef}")
    need(a.kl.target > 0 and a.kl.horizon > 0, "algorithm.kl.target and algorithm.kl.horizon must be > 0")
    need(t.nodes >= 1, f"trainer.nodes must be >= 1; got {t.nodes}")
    need(t.procs_per_node >= 1, f"trainer.procs_per_node must be >= 1; got {t.procs_per_node}")
    need(t.steps >= 1, f"trainer.steps must be >= 1; got {t.steps}")
    need(t.prompts_per_step >= 1, "trainer.prompts_per_step must be >= 1")
    need(t.lr > 0, f"trainer.lr must be > 0; got {t.lr}")
    need(t.critic_lr is None or t.critic_lr > 0, "trainer.critic_lr must be > 0")
    need(t.warmup_steps >= 0, f"trainer.warmup_steps must be >= 0; got {t.warmup_steps}")
    need(0 <= t.min_lr_ratio <= 1, f"trainer.min_lr_ratio must be in [0, 1]; got {t.min_lr_ratio}")
    need(t.grad_clip >= 0, "trainer.grad_clip must be >= 0 (0 disables clipping)")
    need(t.max_skipped_in_a_row >= 1, f"trainer.max_skipped_in_a_row must be >= 1; got {t.max_skipped_in_a_row}")
    _validate_reward(cfg, need)
    for key, lora in (("model.lora", m.lora), ("model.critic_lora", m.critic_lora)):
        if lora is None:
            continue
        need(lora.rank >= 1, f"{key}.rank must be >= 1; got {lora.rank}")
        need(lora.alpha > 0, f"{key}.alpha must be > 0; got {lora.alpha}")
        need(0 <= lora.dropout < 1, f"{key}.dropout must be in [0, 1); got {lora.dropout}")
        need(bool(lora.target_modules) and all(isinstance(x, str) and x.strip() for x in lora.target_modules),
             f"{key}.target_modules must be a non-empty list of module names (e.g. [q_proj, v_proj]) or [all-linear]")
        need("all-linear" not in lora.target_modules or len(lora.target_modules) == 1,
             f"{key}.target_modules: all-linear already names every linear module; give it alone")
    need(m.critic_lora is None or a.uses_critic,
         f"model.critic_lora: algorithm {a.name} has no critic; remove model.critic_lora")
    need(t.check_sync_every >= 0 and t.sync_tolerance > 0,
         "trainer.check_sync_every must be >= 0 and trainer.sync_tolerance > 0")
    samples = cfg.samples_per_step
    world = cfg.world_size
    need(t.mini_batch_size >= 1, "trainer.mini_batch_size must be >= 1")
    need(samples % t.mini_batch_size == 0,
         f"trainer.mini_batch_size ({t.mini_batch_size}) must divide the samples per step "
         f"(trainer.prompts_per_step x algorithm.group_size = {samples})")
    need(t.mini_batch_size % world == 0,
         f"trainer.mini_batch_size ({t.mini_batch_size}) must be divisible by the number of trainer ranks "
         f"(trainer.nodes x trainer.procs_per_node = {world})")
    if t.micro_batch_size:
        need((t.mini_batch_size // world) % t.micro_batch_size == 0,
             f"trainer.micro_batch_size ({t.micro_batch_size}) must divide the per-rank mini-batch "
             f"({t.mini_batch_size // world})")
    need(t.max_tokens_per_micro_batch >= 0,
         f"trainer.max_tokens_per_micro_batch must be >= 0 (0: micro_batch_size samples per micro-batch); "
         f"got {t.max_tokens_per_micro_batch}")
    need(len(t.betas) == 2 and all(isinstance(b, (int, float)) for b in t.betas),
         "trainer.betas must be a list of two numbers, e.g. [0.9, 0.999]")
    need(r.nodes >= 0 and r.servers_per_node >= 0, "rollout.nodes and rollout.servers_per_node must be >= 0")
    need(r.servers_per_node >= 1 or r.nodes == 0,
         f"rollout.servers_per_node 0 (no servers of the job's own) goes with rollout.nodes 0; got rollout.nodes "
         f"{r.nodes}: set rollout.servers_per_node >= 1 or rollout.nodes: 0")
    need(r.wait_for_servers_s is None or r.wait_for_servers_s >= 0,
         f"rollout.wait_for_servers_s must be >= 0 (0: stop at once) or null; got {r.wait_for_servers_s}")
    need(r.temperature > 0, f"rollout.temperature must be > 0; got {r.temperature}")
    need(0 < r.top_p <= 1, f"rollout.top_p must be in (0, 1]; got {r.top_p}")
    need(r.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1")
    need(r.max_samples_per_request >= 1, f"rollout.max_samples_per_request must be >= 1; got {r.max_samples_per_request}")
    need(r.max_tokens_per_request is None or r.max_tokens_per_request >= r.max_model_len,
         f"rollout.max_tokens_per_request must be >= rollout.max_model_len ({r.max_model_len}) or null; got "
         f"{r.max_tokens_per_request}")
    need(r.max_requests_in_flight >= 1, f"rollout.max_requests_in_flight must be >= 1; got {r.max_requests_in_flight}")
    need(r.hf_batch_samples >= 1, f"rollout.hf_batch_samples must be >= 1; got {r.hf_batch_samples}")
    need(0 < r.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization must be in (0, 1]")
    need(r.kv_cache_bytes is None or r.kv_cache_bytes >= 0,
         f"rollout.kv_cache_bytes must be >= 0 bytes (null derives it from the job); got {r.kv_cache_bytes}")
    need(r.tensor_parallel >= 1, "rollout.tensor_parallel must be >= 1")
    need(r.max_model_len > cfg.data.max_prompt_tokens,
         f"rollout.max_model_len ({r.max_model_len}) must exceed data.max_prompt_tokens "
         f"({cfg.data.max_prompt_tokens})")
    need(0 <= r.port < 65536, f"rollout.port must be in [0, 65535]; got {r.port}")
    need(0 <= r.async_steps <= 16, f"rollout.async_steps must be in [0, 16] (0: synchronous); got {r.async_steps}")
    if r.env is not None:
        _validate_env(cfg, need)
    if cfg.eval.enabled:
        _validate_eval(cfg, need)
    need(a.tis_cap >= 1, f"algorithm.tis_cap must be >= 1 (the importance weight's truncation); got {a.tis_cap}")
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
    need(cfg.checkpoint.every >= 0 and cfg.checkpoint.keep_last >= 1,
         "checkpoint.every must be >= 0 and checkpoint.keep_last >= 1")
    if cfg.checkpoint.keep_best is not None:
        need(cfg.eval.enabled, f"checkpoint.keep_best: {cfg.checkpoint.keep_best!r} is an evaluation metric but the "
             "job has no evaluation; set eval.source (held-out prompts) or remove checkpoint.keep_best")
        names = eval_metric_names(cfg.eval.samples_per_prompt)
        need(cfg.checkpoint.keep_best in names, f"checkpoint.keep_best: {cfg.checkpoint.keep_best!r} is not an "
             f"evaluation metric of this job; use one of {', '.join(names)}")
    need(cfg.logging.every >= 1, f"logging.every must be >= 1; got {cfg.logging.every}")
    need(bool(cfg.logging.wandb.project) and "/" not in cfg.logging.wandb.project,
         f"logging.wandb.project: {cfg.logging.wandb.project!r} must be a non-empty name without '/'")
    need(all(isinstance(t, str) and t and len(t) <= 64 for t in cfg.logging.wandb.tags),
         f"logging.wandb.tags must be a list of names of 1-64 characters; got {cfg.logging.wandb.tags}")
    need(cfg.logging.mlflow.experiment is None or bool(str(cfg.logging.mlflow.experiment).strip()),
         "logging.mlflow.experiment must be a non-empty name or null")
    need(cfg.slurm.signal_delay_s >= 0, "slurm.signal_delay_s must be >= 0")
    need(cfg.slurm.requeue_on_failure >= 0, "slurm.requeue_on_failure must be >= 0 (0 disables it)")
    need(cfg.slurm.gpus_per_node >= 0, "slurm.gpus_per_node must be >= 0")
    if cfg.slurm.gpus_per_node and cfg.trainer.device != "cpu":
        need(t.procs_per_node <= cfg.slurm.gpus_per_node,
             f"trainer.procs_per_node ({t.procs_per_node}) exceeds slurm.gpus_per_node "
             f"({cfg.slurm.gpus_per_node}): one trainer rank per GPU")
        need(r.tensor_parallel * r.servers_per_node <= (cfg.slurm.rollout_gpus_per_node or cfg.slurm.gpus_per_node),
             f"rollout.tensor_parallel x rollout.servers_per_node ({r.tensor_parallel * r.servers_per_node}) "
             "exceeds the GPUs of a rollout node")
    return cfg


def _validate_env(cfg: JobConfig, need) -> None:
    r, sb = cfg.rollout, cfg.rollout.sandbox
    need(isinstance(r.env, str) and ":" in r.env and all(r.env.split(":", 1)),
         f"rollout.env: {r.env!r} is not pkg.module:Class; e.g. hpc_rl.rollout.environments.tool_env:ToolCallEnv")
    need(r.max_turns >= 1, f"rollout.max_turns must be >= 1; got {r.max_turns}")
    budget = r.total_tokens(cfg.data.max_prompt_tokens)
    need(r.max_total_tokens >= 0 and budget >= 1 and
         budget <= r.max_model_len - cfg.data.max_prompt_tokens,
         f"rollout.max_total_tokens ({r.max_total_tokens}) must be in [1, rollout.max_model_len - "
         f"data.max_prompt_tokens = {r.max_model_len - cfg.data.max_prompt_tokens}] (0: all of it)")
    need(r.tool_timeout_s > 0, f"rollout.tool_timeout_s must be > 0; got {r.tool_timeout_s}")
    need(0 < sb.wall_s <= r.tool_timeout_s, f"rollout.sandbox.wall_s must be in (0, rollout.tool_timeout_s = "
         f"{r.tool_timeout_s}]; got {sb.wall_s}")
    for key in ("cpu_s", "memory_mb", "processes", "output_bytes"):
        need(getattr(sb, key) >= 1, f"rollout.sandbox.{key} must be >= 1; got {getattr(sb, key)}")


def _validate_eval(cfg: JobConfig, need) -> None:
    e = cfg.eval
    need(bool(str(e.source).strip()), "eval.source must name held-out prompts (toy:NAME, a file, hf:NAME) or be null")
    need(e.every >= 0, f"eval.every must be >= 0 (0: only after the last step); got {e.every}")
    need(e.every <= cfg.trainer.steps, f"eval.every ({e.every}) is beyond trainer.steps ({cfg.trainer.steps}): "
         "it would never run; lower it, or use eval.every: 0 (after the last step only)")
    need(e.samples_per_prompt >= 1, f"eval.samples_per_prompt must be >= 1 (the k of pass@k); got {e.samples_per_prompt}")
    need(e.temperature >= 0, f"eval.temperature must be >= 0 (0: greedy); got {e.temperature}")
    need(e.temperature > 0 or e.samples_per_prompt == 1,
         f"eval.samples_per_prompt is {e.samples_per_prompt} but eval.temperature is 0 (greedy): every sample "
         "would be the same; set eval.temperature > 0 (e.g. 0.6) or eval.samples_per_prompt: 1")
    need(0 < e.top_p <= 1, f"eval.top_p must be in (0, 1]; got {e.top_p}")
    need(e.max_new_tokens is None or e.max_new_tokens >= 1, f"eval.max_new_tokens must be >= 1; got {e.max_new_tokens}")
    need(e.max_new_tokens is None or e.max_new_tokens < cfg.rollout.max_model_len - cfg.data.max_prompt_tokens + 1,
         f"eval.max_new_tokens ({e.max_new_tokens}) does not fit rollout.max_model_len - data.max_prompt_tokens "
         f"({cfg.rollout.max_model_len - cfg.data.max_prompt_tokens})")
    need(e.max_prompts is None or e.max_prompts >= 1, f"eval.max_prompts must be >= 1 or null (all); got {e.max_prompts}")
    need(e.reward is not None or cfg.reward.function is not None,
         "eval.reward: this job has no reward.function to score held-out samples with; name a scoring function "
         "(pkg.module:function, e.g. a strict exact match)")
    need(e.reward is not None or not e.reward_kwargs,
         "eval.reward_kwargs are the arguments of eval.reward, which is not set; set eval.reward or remove them")
    need(cfg.rollout.env is None, "eval: evaluation of multi-turn jobs (rollout.env) is not supported yet; "
         "remove the eval section or evaluate the exported model with a single-turn job")


def _validate_reward(cfg: JobConfig, need) -> None:
    rw, rm = cfg.reward, cfg.reward.model
    need(rw.clip is None or rw.clip > 0, f"reward.clip must be > 0 (or null); got {rw.clip}")
    ol = rw.overlong
    need(ol.buffer_tokens >= 0 and ol.penalty >= 0, "reward.overlong.buffer_tokens and reward.overlong.penalty must be "
         f">= 0; got {ol.buffer_tokens} and {ol.penalty}")
    budget = cfg.response_budget
    need(ol.buffer_tokens <= budget, f"reward.overlong.buffer_tokens ({ol.buffer_tokens}) exceeds the response budget "
         f"({budget} tokens: {'rollout.max_total_tokens' if cfg.rollout.env else 'rollout.max_new_tokens'}); make "
         "it a part of the budget, e.g. a quarter")
    env = cfg.rollout.env
    need(bool(rw.parts) or bool(env), "reward: neither reward.function nor reward.model is set (nor rollout.env); "
         "give a reward function (pkg.module:function), a reward model (reward.model.path), or both")
    for key, w in rw.weights.items():
        need(key in ("function", "model", "environment"),
             f"reward.weights.{key}: unknown part; the parts are 'function', 'model' and 'environment'")
        need(isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w),
             f"reward.weights.{key}: expected a finite number, got {w!r}")
        need(key in rw.parts or (key == "environment" and env), f"reward.weights.{key}: this job has no reward "
             f"{key}; remove the weight or set {'rollout.env' if key == 'environment' else 'reward.' + key}")
    need(rw.nodes >= 0, f"reward.nodes must be >= 0; got {rw.nodes}")
    need(not rw.nodes or (rm is not None and rm.placement == "server"),
         "reward.nodes: nodes of their own serve a reward model; set reward.model with placement: server, or "
         "reward.nodes: 0")
    if rm is None:
        return
    need((rm.path is None) != (rm.tiny is None), "reward.model: set exactly one of reward.model.path (an HF folder "
         "with a sequence-classification head) and reward.model.tiny (a toy task's tiny reward model)")
    need(rm.label_index is None or rm.label_index >= 0, f"reward.model.label_index must be >= 0; got {rm.label_index}")
    need(rm.max_length >= 2, f"reward.model.max_length must be >= 2 tokens; got {rm.max_length}")
    need(rm.batch_size >= 1, f"reward.model.batch_size must be >= 1; got {rm.batch_size}")
    need(rm.scale != 0, "reward.model.scale must not be 0 (every sample would score the same)")
    r, s = cfg.rollout, cfg.slurm
    if rw.nodes:
        need(not r.local_devices or (len(r.local_devices) - rw.nodes) % r.tensor_parallel == 0 and
             len(r.local_devices) > rw.nodes,
             f"rollout.local_devices: with reward.nodes {rw.nodes} its last {rw.nodes} GPU(s) go to the reward "
             f"servers and the rest to rollout servers of rollout.tensor_parallel {r.tensor_parallel} GPUs each; "
             f"got {len(r.local_devices)}")
        return
    per = cfg.gpus_per_rollout_server
    if rw.on_rollout_servers and s.gpus_per_node and cfg.trainer.device != "cpu":
        gpus = s.rollout_gpus_per_node or s.gpus_per_node
        need(per * r.servers_per_node <= gpus,
             f"reward.model.placement: server gives each rollout server a GPU of its own for the reward model "
             f"((rollout.tensor_parallel + 1) x rollout.servers_per_node = {per * r.servers_per_node}"
             f" GPUs) but a rollout node has {gpus}; lower rollout.servers_per_node or use placement: trainer")
    if rw.on_rollout_servers and r.local_devices:
        need(len(r.local_devices) % per == 0,
             "rollout.local_devices: with reward.model.placement server each rollout server takes "
             f"rollout.tensor_parallel + 1 = {per} GPUs (the last for the reward model); "
             f"got {len(r.local_devices)}")


# --------------------------------------------------------------------------- entry points


def load_dict(data: dict, overrides: list[str] | None = None) -> JobConfig:
    """Build and validate a JobConfig from a raw mapping plus dotted overrides."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"job spec: the top level must be a mapping of sections, got {type(data).__name__}")
    data = apply_overrides(data, list(overrides or []))
    cfg = _build(JobConfig, data, "")
    return validate(cfg)


def load(path: str | Path, overrides: list[str] | None = None) -> JobConfig:
    """Load a job spec YAML file, apply dotted overrides, validate; ConfigError on any problem."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{path}: job spec not found; pass the path of a YAML file such as jobs/toy-grpo-cpu.yaml")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; save the job spec as UTF-8 YAML") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or first_line(e)
        raise ConfigError(f"{path}:{where}: invalid YAML ({problem}); fix the syntax there") from None
    return load_dict(data, overrides)


def dump(cfg: JobConfig) -> str:
    """YAML text of the fully resolved config."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
