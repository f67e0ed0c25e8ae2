"""Load reward callables by dotted path, call them, and validate what they return."""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable

import numpy as np

from ..config import RewardConfig
from ..errors import RewardError


def load_reward_fn(spec: str, key: str = "reward.function") -> Callable:
    """`pkg.mod:fn` (or `pkg.mod.fn`) -> the callable; RewardError naming `key` and what failed."""
    if ":" in spec:
        mod_name, attr = spec.split(":", 1)
    else:
        mod_name, _, attr = spec.rpartition(".")
    if not mod_name or not attr:
        raise RewardError(f"{key}: {spec!r} is not a dotted path; use 'package.module:function'")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise RewardError(f"{key}: cannot import module {mod_name!r} ({e}); check the path and that "
                          "the package is installed in this env") from None
    fn = getattr(mod, attr, None)
    if fn is None or not callable(fn):
        raise RewardError(f"{key}: {mod_name!r} has no callable {attr!r}")
    return fn


def as_reward(value, spec: str, index: int, key: str = "reward.function") -> float:
    """One reward as a finite float; RewardError naming `key` `spec` (the callable) and the sample otherwise."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real):
        f = float(value)
    elif isinstance(value, np.ndarray) and value.shape == ():
        f = float(value)
    elif hasattr(value, "shape") and tuple(value.shape) == () and hasattr(value, "item"):
        f = float(value.item())
    else:
        shape = getattr(value, "shape", None)
        desc = f"shape {tuple(shape)}" if shape is not None else type(value).__name__
        raise RewardError(f"{key} {spec}: sample {index} returned {desc}; a reward must be one float "
                          "per sample")
    if not math.isfinite(f):
        raise RewardError(f"{key} {spec}: sample {index} returned {f}; rewards must be finite "
                          "(check for division by zero or log(0))")
    return f


def compute_rewards(fn: Callable, cfg: RewardConfig, prompts: list[str], completions: list[str],
                    rows: list[dict], key: str = "reward.function", spec: str | None = None) -> np.ndarray:
    """Call the reward function (errors name it as `key` `spec`; spec defaults to cfg.function) on every sample;
    one finite float each, else RewardError naming the sample. cfg: its kwargs and batched."""
    spec = spec or cfg.function
    n = len(completions)
    if cfg.batched:
        fields: dict[str, list] = {}
        for r in rows:
            for k in r:
                fields.setdefault(k, [])
        for k in list(fields):
            if k in ("prompt",):
                del fields[k]
                continue
            fields[k] = [r.get(k) for r in rows]
        try:
            out = fn(prompts, completions, **fields, **cfg.kwargs)
        except Exception as e:
            raise RewardError(f"{key} {spec} raised {type(e).__name__}: {e}") from None
        arr = np.asarray(out, dtype=object) if not hasattr(out, "shape") else out
        shape = tuple(getattr(arr, "shape", (len(out),)))
        if shape != (n,):
            raise RewardError(f"{key} {spec}: returned shape {shape} for {n} samples; return one float per sample, "
                              f"shape ({n},)")
        values = [as_reward(v, spec, i, key) for i, v in enumerate(list(out))]
    else:
        values = []
        for i, (p, c, r) in enumerate(zip(prompts, completions, rows)):
            extra = {k: v for k, v in r.items() if k != "prompt"}
            try:
                v = fn(p, c, **extra, **cfg.kwargs)
            except Exception as e:
                raise RewardError(f"{key} {spec} raised {type(e).__name__} on sample {i}: {e}") from None
            values.append(as_reward(v, spec, i, key))
    return np.asarray(values, dtype=np.float64)


def describe(values: np.ndarray, prefix: str) -> dict:
    """{prefix_mean, _std, _min, _max} of a batch of scores."""
    return {f"{prefix}_mean": float(values.mean()), f"{prefix}_std": float(values.std()),
            f"{prefix}_min": float(values.min()), f"{prefix}_max": float(values.max())}


def combine_rewards(parts: dict, cfg: RewardConfig) -> tuple[np.ndarray, dict]:
    """The trained-on reward: reward.weights x each part ('function' scores, the reward model's raw 'model_logits'
    through its transform, the 'environment' rewards of multi-turn rollouts, the 'overlong' penalty), summed; with
    each part's statistics (and the monitor's mean, never trained on)."""
    from .model import check_finite, transform

    total, stats = None, {}
    names = cfg.parts + [name for name in ("environment", "overlong") if name in parts]
    for name in names:
        if name == "model":
            stats.update(describe(np.asarray(parts["model_logits"], dtype=np.float64), "reward_model_logit"))
            values = transform(parts["model_logits"], cfg.model)
            check_finite(values)
        else:  # "function" scores, or the "environment"'s (multi-turn rollouts, rollout.env)
            values = np.asarray(parts[name], dtype=np.float64)
        if len(names) > 1:
            stats.update(describe(values, f"reward_{name}"))
        weighted = cfg.weights.get(name, 1.0) * values
        total = weighted if total is None else total + weighted
    stats.update(describe(total, "reward"))
    if parts.get("monitor") is not None:
        stats["monitor_mean"] = float(np.mean(parts["monitor"]))
    return total, stats


class RewardShaper:
    """Scale, optional running mean/std normalization, and clipping of scores (state is checkpointed)."""

    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0

    def __call__(self, scores: np.ndarray) -> np.ndarray:
        out = scores * self.cfg.scale
        if self.cfg.normalize:
            for x in out:  # Welford: exact running statistics whatever the batch sizes
                self.count += 1
                d = x - self.mean
                self.mean += d / self.count
                self.m2 += d * (x - self.mean)
            std = math.sqrt(self.m2 / (self.count - 1)) if self.count > 1 else 1.0
            out = (out - self.mean) / (std + 1e-8)
        if self.cfg.clip is not None:
            out = np.clip(out, -self.cfg.clip, self.cfg.clip)
        return out

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = state["count"], state["mean"], state["m2"]
