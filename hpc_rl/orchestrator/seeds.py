"""Every sampling seed of a run, derived in one place from the run's seed and what identifies the sample.

A seed names one prompt of one request; the engines give its j-th sample the seed + j (vLLM's convention for the
n children of a request, which the HF engine follows with a generator per row). So a sample's randomness depends on
what it is (run seed, purpose, step, round, position, turn), never on which server serves it, how the prompts were
split into requests, or which other trajectories shared a multi-turn wave: timing and batching change no sample.

Purposes keep the streams apart: a training step's rounds and an evaluation never share a seed; nor do the data
order of dynamic sampling's extra rounds and anything else.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

# Seeds stay below 2**62 so that seed + j (j < n) is a valid generator seed for torch and vLLM alike.
_BITS = 62
TRAIN, EVAL, DATA_ROUND, PARTIAL = 1, 2, 3, 4


def mix(*parts: int) -> int:
    """A well-mixed seed from integers (blake2b of their decimal forms: the same on every machine and Python)."""
    digest = hashlib.blake2b(",".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - _BITS)


@dataclass(frozen=True)
class SeedStream:
    """The seeds of one generation: a training step's round, or the evaluation of a step."""

    run_seed: int
    purpose: int
    step: int
    round: int = 0

    def prompts(self, count: int) -> list[int]:
        """The seeds of the generation's prompts, by position in its prompt list (single-turn: one request each)."""
        return [mix(self.run_seed, self.purpose, self.step, self.round, i) for i in range(count)]

    def turn(self, sample: int, turn: int) -> int:
        """The seed of turn `turn` (0-based) of the generation's sample `sample` (multi-turn: each sample is an
        episode of its own, so it has its own seed at each turn)."""
        return mix(self.run_seed, self.purpose, self.step, self.round, sample, turn)


def training(run_seed: int, step: int, round_: int = 0) -> SeedStream:
    """Training step `step` (0-based); round_ > 0: an extra round of dynamic sampling."""
    return SeedStream(run_seed, TRAIN, step, round_)


def evaluation(run_seed: int, step: int) -> SeedStream:
    """The evaluation of the policy after `step` steps (irrelevant when greedy)."""
    return SeedStream(run_seed, EVAL, step)


def partial_segment(run_seed: int, step: int, position: int, sample: int, segment: int) -> int:
    """The seed of segment `segment` (>= 1) of a partial rollout: sample `sample` of the prompt at `position` among
    training step `step`'s prompts (its segment 0 has the seed a run without partial rollouts gives it)."""
    return mix(run_seed, PARTIAL, step, position, sample, segment)


def round_data_seed(run_seed: int, round_: int) -> int:
    """The data-order seed of dynamic sampling's extra round `round_` (>= 1): a prompt stream of its own."""
    return mix(run_seed, DATA_ROUND, round_)
