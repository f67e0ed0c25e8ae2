"""Slurm's warning before preemption or the time limit (SIGUSR1/SIGUSR2): the loops checkpoint and stop at the next
step boundary, where all ranks agree through an all-reduce (one rank may be the only one signalled)."""

from __future__ import annotations

_requested = False


def request(*_args) -> None:
    """The signal handler: checkpoint and stop at the next step boundary."""
    global _requested
    _requested = True


def requested() -> bool:
    return _requested


def agreed() -> bool:
    """Whether any rank got the signal (collective)."""
    from .train.distributed import all_reduce_scalar

    return all_reduce_scalar(1.0 if _requested else 0.0, "max") > 0
