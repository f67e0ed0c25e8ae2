"""DeepSpeed config: rendered from templates/deepspeed.json.j2, then the job's overrides merged in."""

from __future__ import annotations

import copy
import json

from ..config import JobConfig
from ..templating import render as render_template
from .optimizer import guards_itself


def deep_merge(base: dict, override: dict) -> dict:
    """Recursive dict merge: override wins, nested mappings are merged rather than replaced."""
    out = copy.deepcopy(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def batch_sizes(cfg: JobConfig, world_size: int) -> tuple[int, int, int]:
    """(train_batch_size, micro per rank, grad accumulation) for one optimizer step over a mini-batch."""
    t = cfg.trainer
    per_rank = t.mini_batch_size // world_size
    micro = t.micro_batch_size or per_rank
    return t.mini_batch_size, micro, per_rank // micro


def render(cfg: JobConfig, world_size: int, device_kind: str, train: bool = True, dtype: str | None = None) -> dict:
    """The DeepSpeed config for an engine of this job (train=False: a frozen inference engine; dtype: its
    precision when not model.dtype)."""
    total, micro, accum = batch_sizes(cfg, world_size)
    # Where the optimizer guards itself it also clips (after measuring the norm DeepSpeed would not report).
    grad_clip = 0.0 if guards_itself(cfg) else cfg.trainer.grad_clip
    text = render_template(
        "deepspeed.json.j2",
        train_batch_size=total, micro_batch_size=micro, grad_accum=accum, grad_clip=grad_clip,
        dtype=dtype or cfg.model.dtype, zero_stage=cfg.trainer.zero_stage,
        # Tiny CPU models would otherwise keep every (small) parameter whole on every rank.
        param_persistence_threshold=0 if device_kind == "cpu" else 100000)
    ds = json.loads(text)
    ds = deep_merge(ds, cfg.trainer.deepspeed)
    if not train:
        ds.pop("gradient_clipping", None)
    return ds
