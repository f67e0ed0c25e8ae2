"""`hpc-rl` command line: argument parsing only; each command calls one function elsewhere."""

from __future__ import annotations

import argparse
import os
import sys

from .errors import ConfigError, HpcRlError


def _add_job(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="job spec YAML (e.g. jobs/toy-grpo-cpu.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-6 algorithm.kl.coef=0.01")


RUNS_DIR_HELP = "where runs live (default: runs)"
SWEEPS_DIR_HELP = "where sweeps live (default: runs/sweeps)"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hpc-rl", description="RL post-training of language models on Slurm clusters.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("run", help="run the whole job on this machine")
    _add_job(p)
    p.add_argument("--resume", metavar="RUN_DIR", help="continue this run dir from its latest checkpoint")

    p = sub.add_parser("submit", help="submit the job to Slurm (submitit)")
    _add_job(p)
    p.add_argument("--dry-run", action="store_true", help="print the sbatch script and node roles; submit nothing")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="a new job for this run dir, from its latest checkpoint (overrides may change its size)")

    p = sub.add_parser("status", help="list runs with their Slurm state, step and last reward")
    p.add_argument("run", nargs="?", help="a run name or run dir (default: all runs)")
    p.add_argument("--runs-dir", default="runs", help=RUNS_DIR_HELP)
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("logs", help="show a run's logs")
    p.add_argument("run", help="a run name or run dir")
    p.add_argument("--role", choices=["trainer", "rollout", "reward", "all"], default="all",
                   help="whose logs: the trainer ranks', the rollout servers', the reward servers' (default: all)")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new lines until the run ends (Ctrl-C stops)")
    p.add_argument("--runs-dir", default="runs", help=RUNS_DIR_HELP)

    p = sub.add_parser("cancel", help="cancel a run's Slurm job (every process of it)")
    p.add_argument("run", help="a run name or run dir")
    p.add_argument("--runs-dir", default="runs", help=RUNS_DIR_HELP)

    p = sub.add_parser("export", help="write an HF model folder (or a LoRA run's PEFT adapter folder) from a checkpoint")
    p.add_argument("run", help="a run name or run dir")
    p.add_argument("out", help="output folder")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="checkpoint step (default: latest)")
    which.add_argument("--best", action="store_true", help="the best checkpoint (checkpoint.keep_best: checkpoints/best)")
    form = p.add_mutually_exclusive_group()
    form.add_argument("--merged", dest="form", action="store_const", const="merged",
                      help="a LoRA run's adapters merged into the base: a plain HF folder (the default)")
    form.add_argument("--adapter", dest="form", action="store_const", const="adapter",
                      help="a LoRA run's PEFT adapter folder (PeftModel.from_pretrained(base, OUT))")
    p.add_argument("--runs-dir", default="runs", help=RUNS_DIR_HELP)

    p = sub.add_parser("sweep", help="a sweep as one Slurm job array: [run] FILE | status SWEEP | resubmit SWEEP --failed")
    p.add_argument("args", nargs="+", metavar="ARG",
                   help="[run] SWEEP.yaml [overrides] | status SWEEP | resubmit SWEEP --failed")
    p.add_argument("--dry-run", action="store_true", help="list the points and print the array script; submit nothing")
    p.add_argument("--json", action="store_true", help="status: machine-readable output")
    p.add_argument("--follow", "-f", action="store_true", help="status: wait (with progress) until every point ended")
    p.add_argument("--failed", action="store_true", help="resubmit: the points that failed (they resume)")
    p.add_argument("--sweeps-dir", default="runs/sweeps", help=SWEEPS_DIR_HELP)

    p = sub.add_parser("rollout", help="rollout (or teacher, judge) servers as Slurm jobs of their own: add RUN | list "
                       "RUN | remove RUN JOBID")
    p.add_argument("args", nargs="+", metavar="ARG",
                   help="add RUN [--role teacher|judge] [rollout.*=V slurm.*=V] | list RUN | remove RUN JOBID")
    p.add_argument("--nodes", type=int, default=1, help="add: nodes of the rollout job (default 1)")
    p.add_argument("--servers-per-node", type=int, help="add: servers per node (default: rollout.servers_per_node)")
    p.add_argument("--role", choices=["rollout", "teacher", "judge"], default="rollout",
                   help="add: serve the policy (rollout, default) or the job's services.teacher / services.judge")
    p.add_argument("--dry-run", action="store_true", help="add: print the job's sbatch script; submit nothing")
    p.add_argument("--json", action="store_true", help="list: machine-readable output")
    p.add_argument("--runs-dir", default="runs", help=RUNS_DIR_HELP)

    p = sub.add_parser("eval", help="evaluate a run's checkpoints (or an HF folder) on held-out prompts (eval.*)")
    p.add_argument("target", metavar="RUN_OR_MODEL_DIR", help="a run (name or dir), or an HF model folder with --job")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="the checkpoint of this step (default: the newest)")
    which.add_argument("--all", action="store_true", help="every complete checkpoint, in step order")
    which.add_argument("--best", action="store_true", help="the best checkpoint (checkpoint.keep_best)")
    p.add_argument("--job", help="the job spec of an HF model folder (its eval section and reward)")
    p.add_argument("--submit", action="store_true", help="as a Slurm job array, one element per checkpoint")
    p.add_argument("--dry-run", action="store_true", help="with --submit: print the array's sbatch script only")
    p.add_argument("overrides", nargs="*", help="eval.* / rollout.* overrides, e.g. eval.samples_per_prompt=8")
    p.add_argument("--runs-dir", default="runs", help=RUNS_DIR_HELP)

    p = sub.add_parser("plot", help="PNG of reward/KL curves of a run or a sweep (into its plots/)")
    p.add_argument("target", metavar="RUN_OR_SWEEP", help="a run or sweep (name or dir)")
    p.add_argument("--out", help="PNG path (default: RUN_OR_SWEEP/plots/curves.png)")
    p.add_argument("--runs-dir", default="runs", help=RUNS_DIR_HELP)
    p.add_argument("--sweeps-dir", default="runs/sweeps", help=SWEEPS_DIR_HELP)

    p = sub.add_parser("sync", help="upload a run's or a sweep's offline W&B runs (from a machine with internet)")
    p.add_argument("target", metavar="RUN_OR_SWEEP", help="a run or sweep (name or dir)")
    p.add_argument("--dry-run", action="store_true", help="list what would be uploaded; upload nothing")
    p.add_argument("--runs-dir", default="runs", help=RUNS_DIR_HELP)
    p.add_argument("--sweeps-dir", default="runs/sweeps", help=SWEEPS_DIR_HELP)

    p = sub.add_parser("config", help="every job-spec key with its type, default (or the job's value) and doc")
    p.add_argument("action", choices=["show"], help="show: the table of keys")
    p.add_argument("job", nargs="?", help="a job spec: show its resolved values instead of the defaults")
    p.add_argument("overrides", nargs="*", help="dotted overrides applied to the job")

    p = sub.add_parser("doctor", help="check this environment for known pitfalls, with fixes")
    p.add_argument("--job", help="also check this job spec")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("overrides", nargs="*", help="with --job: dotted overrides, as `hpc-rl run` takes them")

    p = sub.add_parser("data", help="prepare a dataset (needs internet for hub datasets)")
    p.add_argument("name", choices=["gsm8k", "geometry3k"], help="the dataset")
    p.add_argument("out", help="output folder")
    p.add_argument("--source", help="a local copy (jsonl/parquet or HF datasets folder) instead of the hub")
    return ap


def dispatch(args: argparse.Namespace) -> int:
    """Call the one function that implements the command; returns the exit code."""
    if args.command == "run":
        from .launch import run_local_job
        return run_local_job(args.job, args.overrides, resume=args.resume)
    if args.command == "submit":
        from .cluster.submit import submit_job
        return submit_job(args.job, args.overrides, dry_run=args.dry_run, resume=args.resume)
    if args.command == "status":
        from .cluster.status import show_status
        return show_status(args.run, runs_dir=args.runs_dir, as_json=args.json)
    if args.command == "logs":
        from .cluster.status import show_logs
        return show_logs(args.run, role=args.role, follow=args.follow, runs_dir=args.runs_dir)
    if args.command == "cancel":
        from .cluster.status import cancel_run
        return cancel_run(args.run, runs_dir=args.runs_dir)
    if args.command == "export":
        from .train.export import export_hf
        return export_hf(args.run, args.out, step=args.step, runs_dir=args.runs_dir, form=args.form or "merged",
                         best=args.best)
    if args.command == "sweep":
        from .cluster.sweep import sweep_cli
        return sweep_cli(args.args, dry_run=args.dry_run, as_json=args.json, failed=args.failed, follow=args.follow,
                         sweeps_dir=args.sweeps_dir)
    if args.command == "rollout":
        from .cluster.rollout_jobs import rollout_cli
        return rollout_cli(args.args, nodes=args.nodes, servers_per_node=args.servers_per_node, dry_run=args.dry_run,
                           as_json=args.json, runs_dir=args.runs_dir, role=args.role)
    if args.command == "eval" and (args.submit or args.dry_run):
        if args.job or not args.submit:
            raise ConfigError("hpc-rl eval: --submit evaluates a run's checkpoints (not --job), and --dry-run goes "
                              "with --submit; e.g. hpc-rl eval RUN --all --submit --dry-run")
        from .cluster.eval_array import submit_eval
        return submit_eval(args.target, step=args.step, every=args.all, best=args.best, overrides=args.overrides,
                           dry_run=args.dry_run, runs_dir=args.runs_dir)
    if args.command == "eval":
        from .eval.offline import eval_cli
        return eval_cli(args.target, step=args.step, every=args.all, best=args.best, job=args.job,
                        overrides=args.overrides, runs_dir=args.runs_dir)
    if args.command == "plot":
        from .plots import plot_target
        return plot_target(args.target, out=args.out, runs_dir=args.runs_dir, sweeps_dir=args.sweeps_dir)
    if args.command == "sync":
        from .tracking import sync
        return sync(args.target, dry_run=args.dry_run, runs_dir=args.runs_dir, sweeps_dir=args.sweeps_dir)
    if args.command == "config":
        from .config_show import show_config
        return show_config(args.job, args.overrides)
    if args.command == "doctor":
        from .doctor import run_doctor
        if args.overrides and not args.job:
            raise ConfigError(f"doctor: overrides ({' '.join(args.overrides)}) apply to a job: add --job JOB.yaml")
        return run_doctor(job=args.job, as_json=args.json, overrides=args.overrides)
    if args.command == "data":
        from .data.prepare import prepare_dataset
        return prepare_dataset(args.name, args.out, source=args.source)
    raise AssertionError(args.command)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The command line as `hpc-rl` reads it (SystemExit with argparse's message on a bad one)."""
    # Overrides may follow options (`run JOB --resume RUN trainer.steps=6`), which argparse alone rejects.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if getattr(args, "overrides", None) is not None and all("=" in a and not a.startswith("-") for a in extra):
            args.overrides += extra
        elif args.command in ("rollout", "sweep") and all("=" in a and not a.startswith("-") for a in extra):
            args.args += extra
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `hpc-rl` console script."""
    parser = build_parser()
    args = parse_args(parser, argv)
    if not args.command:
        parser.print_help()
        return 2
    try:
        return int(dispatch(args) or 0)
    except HpcRlError as e:
        print(f"hpc-rl: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hpc-rl: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `hpc-rl status | head` must not print a traceback.
        sys.stderr.close()
        return 0
    finally:
        if os.environ.get("HPC_RL_DEBUG") == "1":
            sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
