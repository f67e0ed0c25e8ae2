"""Logging set-up: rank 0 logs INFO (one line per step); other ranks only warnings; HPC_RL_DEBUG=1 adds detail."""

from __future__ import annotations

import logging
import os
import sys
import warnings


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
