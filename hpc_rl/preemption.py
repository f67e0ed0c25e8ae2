"""Slurm's warning before preemption or the time limit (SIGUSR1/SIGUSR2): the loops checkpoint and stop at the next
step boundary, where all ranks agree through an all-reduce (one rank may be the only one signalled); and that
boundary, which the RL and SFT loops share (end_step)."""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("hpc_rl")

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


def end_step(step: int, total: int, every: int, stopped: str | None, save: Callable[[], None], is_main: bool,
             due: bool = False) -> str | None:
    """A step's end, the same on every rank (collective): its checkpoint (each `every` steps, at the last step, at a
    stop, or when `due`), then "stopped" (trainer.stop_at's reason `stopped`) or "preempted" (with a checkpoint of
    this step) when the run ends here; None to go on."""
    last = step == total or stopped is not None
    saved = (bool(every) and (step % every == 0 or last)) or due
    if saved:
        save()
    if stopped:
        if is_main:
            log.info("step %d of %d: trainer.stop_at reached (%s); the run ends here", step, total, stopped)
        return "stopped"
    if step < total and agreed():
        if not saved:
            save()
        if is_main:
            log.warning("preempted: checkpoint of step %d written; stopping so that the job is requeued (it resumes "
                        "from this step)", step)
        return "preempted"
    return None
