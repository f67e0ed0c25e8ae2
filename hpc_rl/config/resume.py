"""What a resumed run may change: anything but what its checkpoint's tensors were built from.

The trainer's size (trainer.nodes, trainer.procs_per_node) may change: the optimizer state is re-partitioned on load
(train/reshape.py). The model, its adapters, whether the algorithm has a critic, and the ZeRO stage may not: the
checkpoint holds tensors of that model, adapters of that rank on those modules, a critic or none, in the file layout of
that stage (DeepSpeed's stage 1-2 loader does not read a stage-3 checkpoint).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from .job import JobConfig
from .loading import load


def _fixed(cfg: JobConfig) -> dict:
    m = cfg.model

    def lora(x):
        return None if x is None else {"rank": x.rank, "target_modules": list(x.target_modules)}

    return {"model.path": m.path, "model.tiny": m.tiny, "model.lora": lora(m.lora),
            "model.critic_lora": lora(m.critic_lora),
            "algorithm.name": cfg.algorithm.uses_critic, "trainer.zero_stage": cfg.trainer.zero_stage}


def _show(key: str, value) -> str:
    if key == "algorithm.name":
        return "an algorithm with a critic" if value else "an algorithm without a critic"
    if key.endswith("lora"):
        return "no adapters" if value is None else \
            f"adapters of rank {value['rank']} on {', '.join(value['target_modules'])}"
    if key == "trainer.zero_stage":
        return f"ZeRO stage {value}"
    return "none" if value is None else str(value)


def check_resume(written: JobConfig, resumed: JobConfig) -> None:
    """ConfigError naming the first key whose change the checkpoint cannot follow, with both values."""
    before, after = _fixed(written), _fixed(resumed)
    for key, value in before.items():
        if after[key] != value:
            raise ConfigError(f"{key}: the run's checkpoints were written with {_show(key, value)}, not "
                              f"{_show(key, after[key])}; a resume cannot change it (start a new run, or drop the "
                              "override)")


def load_for_resume(job_yaml: Path, overrides: list[str]) -> JobConfig:
    """A run's resolved job with `overrides` for a resume, refused (ConfigError) where the checkpoint cannot follow;
    the caller writes it back as the run's job.yaml once it starts the resume."""
    cfg = load(job_yaml, overrides)
    if overrides:
        check_resume(load(job_yaml), cfg)
    return cfg
