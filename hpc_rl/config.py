"""Job spec: typed dataclasses loaded from YAML, dotted CLI overrides, validation with clear errors.

Every error names the dotted key and the fix; unknown keys suggest the closest valid spelling.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from .errors import ConfigError, first_line

# --------------------------------------------------------------------------- sections


@dataclass
class TinyModelConfig:
    """A small random-init model built offline (tests and CPU toys); saved as a normal HF folder."""

    arch: Literal["qwen2", "llama"] = "qwen2"
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 2
    # vLLM's CPU attention rejects head_dim 16; 64 works on both engines.
    head_dim: int = 64
    intermediate_size: int = 256
    max_position_embeddings: int = 512
    init_seed: int = 0


@dataclass
class ModelConfig:
    """The policy (actor); the critic and the reference start from the same weights unless named."""

    path: str | None = None
    tiny: TinyModelConfig | None = None
    critic_path: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] = "sdpa"
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False


@dataclass
class DataConfig:
    """Prompt dataset: `toy:NAME`, a .jsonl/.parquet file, or `hf:NAME` (an HF datasets name or folder)."""

    source: str = "toy:repeat_digit"
    split: str = "train"
    prompt_key: str = "prompt"
    max_prompt_tokens: int = 128
    toy_size: int = 2000
    shuffle: bool = True


@dataclass
class RewardConfig:
    """A reward is a callable `pkg.mod:fn(prompt, completion, **row_fields) -> float`."""

    function: str = "hpc_rl.rewards.toy:repeat_digit"
    kwargs: dict = field(default_factory=dict)
    # batched: fn(prompts, completions, **fields_as_lists) -> B floats, for functions that vectorize.
    batched: bool = False
    scale: float = 1.0
    normalize: bool = False
    clip: float | None = None


@dataclass
class KLConfig:
    coef: float = 0.0
    estimator: Literal["k1", "k2", "k3"] = "k3"
    # PPO puts KL into the per-token reward; GRPO adds it to the loss.
    in_reward: bool | None = None
    adaptive: bool = False
    target: float = 0.1
    horizon: int = 10000


@dataclass
class AlgorithmConfig:
    name: Literal["ppo", "grpo", "rloo", "reinforce_pp"] = "grpo"
    group_size: int = 8
    gamma: float = 1.0
    lam: float = 0.95
    clip_ratio: float = 0.2
    value_clip: float = 0.2
    value_coef: float = 0.5
    entropy_coef: float = 0.0
    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"
    norm_adv_by_std: bool = True
    whiten_advantages: bool = True
    ppo_epochs: int = 1
    kl: KLConfig = field(default_factory=KLConfig)

    @property
    def uses_critic(self) -> bool:
        return self.name == "ppo"

    @property
    def kl_in_reward(self) -> bool:
        if self.kl.in_reward is not None:
            return self.kl.in_reward
        return self.name in ("ppo", "reinforce_pp")


@dataclass
class TrainerConfig:
    nodes: int = 1
    procs_per_node: int = 2
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # GPUs of this machine the trainer ranks use in `hpc-rl run` (empty: the first procs_per_node).
    local_devices: list = field(default_factory=list)
    steps: int = 50
    prompts_per_step: int = 16
    mini_batch_size: int = 64
    micro_batch_size: int = 0
    lr: float = 1e-5
    critic_lr: float | None = None
    weight_decay: float = 0.0
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0
    grad_clip: float = 1.0
    zero_stage: Literal[0, 1, 2, 3] = 3
    max_nonfinite_steps: int = 3
    deepspeed: dict = field(default_factory=dict)
    dist_timeout_s: int = 600
    # Every N steps, compare the rollout server's log-probs of one sample with the actor's after the
    # weight push (0 = never); a mismatch beyond sync_tolerance stops the run.
    check_sync_every: int = 0
    sync_tolerance: float = 1e-3


@dataclass
class RolloutConfig:
    engine: Literal["auto", "vllm", "hf"] = "auto"
    nodes: int = 1
    servers_per_node: int = 1
    local_devices: list = field(default_factory=list)
    host: str = "0.0.0.0"
    port: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16
    stop: list = field(default_factory=list)
    tensor_parallel: int = 1
    gpu_memory_utilization: float = 0.2
    # vLLM's KV cache in bytes (its kv_cache_memory_bytes), on CPU and GPU. null: on CPU derived from the job
    # (concurrent sequences x max_model_len x the model's K/V bytes per token), on GPU sized by vLLM from
    # gpu_memory_utilization; 0: always from gpu_memory_utilization (on CPU a fraction of a NUMA node's RAM).
    kv_cache_bytes: int | None = None
    max_model_len: int = 256
    enforce_eager: bool = True
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    weight_sync: Literal["auto", "collective", "file", "http"] = "auto"
    request_timeout_s: float = 300.0
    retries: int = 2
    startup_timeout_s: float = 900.0
    max_policy_lag: int = 0


@dataclass
class CheckpointConfig:
    every: int = 0
    keep_last: int = 2
    save_hf: bool = True


@dataclass
class NCCLConfig:
    socket_ifname: str | None = None
    ib_disable: bool | None = None
    debug: str | None = None
    timeout_s: int = 1800


@dataclass
class EnvConfig:
    vars: dict = field(default_factory=dict)
    nccl: NCCLConfig = field(default_factory=NCCLConfig)


@dataclass
class SlurmConfig:
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "01:00:00"
    gpus_per_node: int = 0
    cpus_per_task: int | None = None
    mem: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    signal_delay_s: int = 120
    requeue: bool = True
    # After a crash of the trainer (a rank died, a node was lost), requeue the job up to this many
    # times; it resumes from the latest checkpoint (0 = fail the job).
    requeue_on_failure: int = 0
    mail_user: str | None = None
    mail_type: str | None = None
    array_parallelism: int | None = None
    layout: Literal["single", "hetjob"] = "single"
    rollout_partition: str | None = None
    rollout_gpus_per_node: int | None = None
    additional: dict = field(default_factory=dict)
    setup: list = field(default_factory=list)


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    every: int = 1


@dataclass
class JobConfig:
    name: str = "job"
    seed: int = 1
    output_dir: str = "runs"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def samples_per_step(self) -> int:
        return self.trainer.prompts_per_step * self.algorithm.group_size

    @property
    def world_size(self) -> int:
        return self.trainer.nodes * self.trainer.procs_per_node


# --------------------------------------------------------------------------- building from dicts


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
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
        raise ConfigError(f"{key}: {value!r} is not valid; use {_type_name(tp)}{extra}")
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
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")


def _build(cls: type, data: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
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
    if a.name in ("grpo", "rloo"):
        need(a.group_size >= 2, f"algorithm.group_size must be >= 2 for {a.name} "
             f"(advantages compare samples of the same prompt); got {a.group_size}")
    need(0 < a.clip_ratio < 1, f"algorithm.clip_ratio must be in (0, 1); got {a.clip_ratio}")
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
    need(t.grad_clip >= 0, "trainer.grad_clip must be >= 0 (0 disables clipping)")
    need(t.max_nonfinite_steps >= 1, "trainer.max_nonfinite_steps must be >= 1")
    need(cfg.reward.clip is None or cfg.reward.clip > 0, f"reward.clip must be > 0 (or null); got {cfg.reward.clip}")
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
    need(len(t.betas) == 2 and all(isinstance(b, (int, float)) for b in t.betas),
         "trainer.betas must be a list of two numbers, e.g. [0.9, 0.999]")
    need(r.nodes >= 0 and r.servers_per_node >= 1, "rollout.nodes must be >= 0 and rollout.servers_per_node >= 1")
    need(r.temperature > 0, f"rollout.temperature must be > 0; got {r.temperature}")
    need(0 < r.top_p <= 1, f"rollout.top_p must be in (0, 1]; got {r.top_p}")
    need(r.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1")
    need(0 < r.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization must be in (0, 1]")
    need(r.kv_cache_bytes is None or r.kv_cache_bytes >= 0,
         f"rollout.kv_cache_bytes must be >= 0 bytes (null derives it from the job); got {r.kv_cache_bytes}")
    need(r.tensor_parallel >= 1, "rollout.tensor_parallel must be >= 1")
    need(r.max_model_len > cfg.data.max_prompt_tokens,
         f"rollout.max_model_len ({r.max_model_len}) must exceed data.max_prompt_tokens "
         f"({cfg.data.max_prompt_tokens})")
    need(0 <= r.port < 65536, f"rollout.port must be in [0, 65535]; got {r.port}")
    need(r.max_policy_lag >= 0, "rollout.max_policy_lag must be >= 0")
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


def from_resolved(path: str | Path) -> JobConfig:
    """Reload a run dir's job.yaml (written by dump)."""
    return load(path)
