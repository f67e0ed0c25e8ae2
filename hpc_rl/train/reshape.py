"""Resuming a checkpoint on another number of trainer ranks (requeued on fewer nodes, moved to another partition).

DeepSpeed's ZeRO 1-3 partitions the optimizer state by rank, and its loader refuses another data-parallel size.
DeepSpeed's own universal checkpoint is the way across: its converter (deepspeed.checkpoint.ds_to_universal) merges
the W ranks' partitions into one full fp32 tensor per parameter and per Adam moment, and its loader cuts them again
for the W' ranks loading it. The conversion runs once, on rank 0, and is kept beside the checkpoint
(step_N/universal/NAME/state) for the next resume at another size. ZeRO stage 0 does not partition: its checkpoint
loads at any size as it is.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import shutil
from pathlib import Path

from .distributed import barrier

log = logging.getLogger("hpc_rl")

UNIVERSAL = "universal"


def written_world_size(state_dir: Path) -> int | None:
    """The ranks that wrote a DeepSpeed checkpoint folder (one optimizer partition each under ZeRO 1-3); None for
    ZeRO stage 0, whose optimizer state is whole."""
    files = list(state_dir.glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt"))
    return len(files) or None


def _convert(state_dir: Path, out: Path) -> None:
    """DeepSpeed's converter, run in this process (what it prints goes to the debug log); written under a temporary
    name, then renamed, so a conversion cut short is never loaded."""
    from deepspeed.checkpoint import ds_to_universal

    engine_dir = out.parent
    work = engine_dir.with_name(f".{engine_dir.name}.tmp")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    args = argparse.Namespace(input_folder=str(state_dir), output_folder=str(work / out.name),
                              num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=True)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        ds_to_universal.main(args)
    log.debug("ds_to_universal %s:\n%s", state_dir, printed.getvalue()[-2000:])
    shutil.rmtree(engine_dir, ignore_errors=True)
    work.rename(engine_dir)


def universal_folder(checkpoint: Path, name: str, rank: int) -> Path:
    """step_N/universal/NAME/state: engine `name`'s state in DeepSpeed's universal format, converted by rank 0 if it
    is not there yet (collective: every rank returns once it exists)."""
    out = checkpoint / UNIVERSAL / name / "state"
    if rank == 0 and not (out / "zero" / "optimizer_state.pt").is_file():
        _convert(checkpoint / "deepspeed" / name / "state", out)
    barrier()
    return out


def load_universal(engine, folder: Path, strict: bool) -> str | None:
    """Load a universal checkpoint folder into a built engine: its optimizer partitions (fp32 weights, Adam moments,
    step) cut for this engine's ranks, and the LR schedule."""
    config = engine._config
    config.load_universal_checkpoint = True  # read by load_checkpoint and the ZeRO optimizer's load
    try:
        load_path, _ = engine.load_checkpoint(str(folder.parent), tag=folder.name, load_module_strict=strict,
                                              load_optimizer_states=True, load_lr_scheduler_states=True)
    finally:
        config.load_universal_checkpoint = False
    return load_path


def reshape_message(written: int, world: int, seconds: float, engines: list[str]) -> str:
    """The one line a reshaped resume logs: both sizes and the time it took."""
    return (f"checkpoint written by {written} trainer rank(s), resumed on {world}: the optimizer state of "
            f"{' and '.join(engines)} re-partitioned through DeepSpeed's universal checkpoint in {seconds:.1f}s")
