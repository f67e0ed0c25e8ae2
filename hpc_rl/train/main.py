"""Entry point of one trainer rank: `python -m hpc_rl.train.main --run-dir RUN` (env RANK/WORLD_SIZE/...)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback

from ..errors import HpcRlError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hpc_rl.train.main")
    ap.add_argument("--run-dir", required=True)
    args = ap.parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    # Slurm's warning signal (submitit asks for USR2; USR1 when sent by hand): checkpoint at the next step
    # boundary and exit, instead of the default action (death) that would lose the step.
    from ..tracking import deepspeed_without_mlflow

    with deepspeed_without_mlflow():
        from .trainer import request_preemption

    signal.signal(signal.SIGUSR1, request_preemption)
    signal.signal(signal.SIGUSR2, request_preemption)
    from ..logs import setup_logging

    log = setup_logging(rank)
    try:
        from .. import config
        from ..rundir import RunDir
        from .distributed import init_distributed, shutdown_distributed

        run = RunDir(os.path.abspath(args.run_dir))
        cfg = config.load(run.job_yaml)
        _train(cfg, run, init_distributed(cfg))
        shutdown_distributed()  # every rank left fit() after the same last collective; its engines are out of scope
        return 0
    except HpcRlError as e:
        # The launcher prints rank 0's last line as the run's error.
        log.error("error: %s", e)
        return 2
    except Exception:
        log.error("rank %d crashed:\n%s", rank, traceback.format_exc())
        return 1


def _train(cfg, run, dist) -> None:
    from .trainer import Trainer

    trainer = Trainer(cfg, run, dist)
    try:
        trainer.resume_if_possible()
        trainer.connect_rollout()
        trainer.fit()
    except BaseException:
        if trainer.metrics is not None:  # rank 0: the tracked runs end as failed, their last steps flushed
            trainer.metrics.close("failed")
        raise


def exit_now(code: int) -> None:
    """Exit without the interpreter's teardown: with torch, DeepSpeed and gloo loaded it takes ~2 s a rank after
    the run's files are closed (each run and each requeue waits for it)."""
    import logging

    sandbox = sys.modules.get("hpc_rl.rollout.environments.sandbox")
    if sandbox is not None:  # atexit does not run: the python tool's sandbox processes and cgroups go here
        sandbox.close_all()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
