"""Deterministic prompt sampling by (seed, step): a resumed run sees exactly the same prompts."""

from __future__ import annotations

import numpy as np


def epoch_permutation(n: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch]).permutation(n)


def indices_for_step(n: int, per_step: int, seed: int, step: int, shuffle: bool = True) -> list[int]:
    """Row indices for `step` (0-based): consecutive slices of per-epoch permutations, wrapping epochs."""
    start = step * per_step
    out: list[int] = []
    while len(out) < per_step:
        epoch, offset = divmod(start + len(out), n)
        perm = epoch_permutation(n, seed, epoch, shuffle)
        take = min(per_step - len(out), n - offset)
        out.extend(int(i) for i in perm[offset:offset + take])
    return out
