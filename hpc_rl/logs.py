"""Logging set-up: rank 0 logs INFO (one line per step); other ranks only warnings; HPC_RL_DEBUG=1 adds detail."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path


def setup_logging(rank: int = 0, stream=None) -> logging.Logger:
    log = logging.getLogger("hpc_rl")
    debug = os.environ.get("HPC_RL_DEBUG") == "1"
    level = logging.DEBUG if debug else (logging.INFO if rank == 0 else logging.WARNING)
    log.setLevel(level)
    log.handlers.clear()
    h = logging.StreamHandler(stream or sys.stdout)
    prefix = "" if rank == 0 else f"[rank {rank}] "
    h.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(message)s", datefmt="%H:%M:%S"))
    log.addHandler(h)
    log.propagate = False
    if not debug:
        # torch.distributed deprecation notices fire on every ZeRO-3 collective: one per step per rank.
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    # DeepSpeed and transformers are chatty at INFO; their warnings still show.
    for name in ("DeepSpeed", "deepspeed", "transformers", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.DEBUG if debug else logging.WARNING)
    return log


def tail_lines(path: Path, n: int) -> list[str]:
    """The last `n` non-empty lines of a log file (right-stripped); [] when it is missing."""
    try:
        lines = [ln.rstrip() for ln in Path(path).read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return []
    return lines[-n:]


def last_error_line(path: Path) -> str:
    """The last line of a log that reports an error (`error: ...`, `ValueError: ...`), else its last line."""
    if not Path(path).exists():
        return f"{Path(path).name} is missing"
    lines = tail_lines(path, 10**9)
    for ln in reversed(lines):
        low = ln.lower()
        if ("error" in low or "exception" in low or "killed" in low) and not low.startswith("traceback"):
            return ln.strip()[:300]
    return lines[-1].strip()[:300] if lines else f"{Path(path).name} is empty"
