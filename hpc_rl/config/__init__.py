"""Job spec: typed dataclasses loaded from YAML, dotted CLI overrides, validation with clear errors.

One module per section (model, data, reward, algorithm, trainer, rollout, evaluation, runtime: checkpoint, env,
slurm, logging), each with its dataclasses, every field documented by the comment above it (what `hpc-rl config
show` prints), and the checks of its keys; job.py ties the sections into JobConfig, loading.py builds one from YAML.
Every error names the dotted key and the fix; unknown keys suggest the closest valid spelling.
"""

from __future__ import annotations

from ..errors import ConfigError
from .algorithm import AlgorithmConfig, DynamicSamplingConfig, KLConfig
from .data import DataConfig
from .evaluation import EvalConfig, eval_metric_names, pass_k_values
from .job import JobConfig, validate
from .loading import (
    MIGRATED,
    RENAMED,
    _build,  # noqa: F401 (tests build sections without validation)
    apply_overrides,
    dump,
    load,
    load_dict,
    parse_override,
    to_dict,
    type_name,
)
from .model import LoraConfig, ModelConfig, TinyModelConfig
from .reward import OverlongConfig, RewardConfig, RewardModelConfig
from .rollout import RolloutConfig, SandboxConfig
from .runtime import CheckpointConfig, EnvConfig, LoggingConfig, MlflowConfig, NCCLConfig, SlurmConfig, WandbConfig
from .trainer import TrainerConfig

__all__ = [
    "AlgorithmConfig", "CheckpointConfig", "ConfigError", "DataConfig", "DynamicSamplingConfig", "EnvConfig",
    "EvalConfig", "JobConfig", "KLConfig", "LoggingConfig", "LoraConfig", "MIGRATED", "MlflowConfig", "ModelConfig",
    "NCCLConfig", "OverlongConfig", "RENAMED", "RewardConfig", "RewardModelConfig", "RolloutConfig", "SandboxConfig",
    "SlurmConfig", "TinyModelConfig", "TrainerConfig", "WandbConfig", "apply_overrides", "dump", "eval_metric_names",
    "load", "load_dict", "parse_override", "pass_k_values", "to_dict", "type_name", "validate",
]
