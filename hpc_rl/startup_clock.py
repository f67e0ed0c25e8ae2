"""One clock for a run's start-up across the processes it starts: the launcher records when the command began
(HPC_RL_STARTED), and each process (trainer rank, rollout server) marks its start-up phases against it, printed
under HPC_RL_DEBUG=1 and read by bench/startup.py."""

from __future__ import annotations

import os
import time

ENV = "HPC_RL_STARTED"


def mark_command_start() -> None:
    """The launcher of this machine's processes (`hpc-rl run`, a Slurm node's launcher): time zero for them."""
    os.environ[ENV] = repr(time.time())


class Phases:
    """A process's start-up phases as seconds since the command began (nothing when no launcher set the clock)."""

    def __init__(self) -> None:
        t0 = os.environ.get(ENV)
        try:
            self.t0 = float(t0) if t0 else None
        except ValueError:
            self.t0 = None
        self.marks: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        if self.t0 is not None:
            self.marks.append((name, time.time() - self.t0))

    def line(self) -> str:
        """`phase 1.23s, phase 2.34s, ...` (empty without a clock)."""
        return ", ".join(f"{name} {t:.2f}s" for name, t in self.marks)


# This process's phases (each process imports this module once).
PHASES = Phases()
