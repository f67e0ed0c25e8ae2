"""`hpc-rl eval`: evaluate models already trained, on this machine: one rollout server per checkpoint, started as
`hpc-rl run` starts them.

`hpc-rl eval RUN [--step N | --all | --best] [eval.* overrides]` evaluates checkpoints of a run with the run's job
spec (model, reward, eval settings); `hpc-rl eval MODEL_DIR --job JOB.yaml [overrides]` an HF model folder, as step
0 of a run dir of its own (OUTPUT_DIR/NAME-eval-TIME). Results are appended to the run's eval.jsonl marked
"source": "offline" (per sample: eval/step_N.offline.jsonl), so `hpc-rl plot` and `hpc-rl status` show them beside
the evaluations made during training. `hpc-rl eval RUN --submit` (cluster/eval_array.py) runs the same per
checkpoint as a Slurm job array.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
import time
from pathlib import Path

from .. import config, rundir
from ..checkpoints import find_latest, list_checkpoints, step_dir, verify
from ..config import JobConfig
from ..data.datasets import load_rows
from ..errors import CheckpointError, ConfigError
from ..launch import ServerFailure, start_rollout_server, stop_processes
from ..logs import last_error_line, setup_logging
from ..models.loading import load_tokenizer
from ..models.sft_built import built_sft_model, is_sft_spec
from ..models.sft_built import parse as parse_sft_spec
from ..orchestrator.evaluation import EvalLog, Evaluator
from ..orchestrator.judge import Judge
from ..orchestrator.sampling import Sampler
from ..rewards.base import load_reward_fn
from ..rollout.client.rollout_client import RolloutClient
from ..rundir import RunDir, write_json_atomic, write_new_token
from ..train.export import best_step, export_hf

log = logging.getLogger("hpc_rl")


def _eval_overrides(overrides: list[str]) -> list[str]:
    """Of a run's job spec only eval.* and rollout.* may change: the model and reward are the run's."""
    for o in overrides:
        key = o.split("=", 1)[0]
        if not key.startswith(("eval.", "rollout.")):
            raise ConfigError(f"override {o!r}: `hpc-rl eval` takes eval.* and rollout.* overrides only (the model "
                              "and the reward are the run's); e.g. eval.samples_per_prompt=4 eval.temperature=0.6")
    return overrides


def _check_inputs(cfg: JobConfig) -> None:
    """The held-out prompts and the scoring function load, before any server starts or anything is written."""
    load_rows(cfg.eval_data, cfg.seed, "eval")
    if cfg.eval.reward:
        load_reward_fn(cfg.eval.reward, "eval.reward")
    elif cfg.reward.function:
        load_reward_fn(cfg.reward.function)


def checkpoint_steps(run: RunDir, step: int | None, every: bool, best: bool) -> list[int]:
    """The checkpoint steps asked for (default: the newest complete one); CheckpointError naming what exists."""
    have = [int(p.name[5:]) for p in list_checkpoints(run) if verify(p)]
    if not have:
        raise CheckpointError(f"{run.root}: no complete checkpoint to evaluate; set checkpoint.every > 0 and train "
                              "(or evaluate an HF folder: hpc-rl eval MODEL_DIR --job JOB.yaml)")
    if best:
        return [best_step(run)]
    if every:
        return have
    if step is not None:
        if step not in have:
            raise CheckpointError(f"{run.root}: no complete checkpoint for step {step}; available steps: "
                                  f"{', '.join(map(str, have))}")
        return [step]
    latest = find_latest(run)
    return [int(latest.name[5:])] if latest is not None else have[-1:]


def model_folder(run: RunDir, cfg: JobConfig, step: int, scratch: Path) -> str:
    """The HF folder of checkpoint `step` a rollout server can load: its hf/ folder, or for a LoRA run its adapters
    merged into the base model (written under `scratch`)."""
    hf = step_dir(run, step) / "hf"
    if not (hf / "config.json").is_file() and not (hf / "adapter_config.json").is_file():
        raise CheckpointError(f"{step_dir(run, step)}: no hf/ folder (checkpoint.save_hf was false); evaluate a "
                              "checkpoint written with it, or export one and use hpc-rl eval MODEL_DIR --job JOB")
    if cfg.model.lora is None:
        return str(hf)
    out = scratch / f"merged-step_{step}"
    shutil.rmtree(out, ignore_errors=True)  # left by an evaluation that was killed
    export_hf(str(run.root), str(out), step=step, form="merged")
    return str(out)


def _report_early_deaths(scratch: RunDir, procs: list, done: threading.Event) -> None:
    """A server of the evaluation that exits is reported as its launcher reports one it gives up on (rendezvous/
    failed-KIND-0.json, which the client's wait reads): the evaluation stops with its last error line instead of
    waiting out rollout.startup_timeout_s."""
    while not done.wait(0.5):
        for p in procs:
            code = p.poll()
            if code is None:
                continue
            kind = "judge" if "--role" in p.args and "judge" in p.args else "rollout"
            f = ServerFailure(0, code, os.uname().nodename, False, last_error_line(scratch.logs / f"{kind}-0.log"),
                              kind)
            write_json_atomic(scratch.server_failure_file(0, kind), {**dataclasses.asdict(f), "message": f.line()})
            return


def evaluate_model(run: RunDir, cfg: JobConfig, model_path: str, step: int, source: str = "offline") -> dict:
    """Start one rollout server on `model_path` (its own scratch run dir under RUN/eval/) and, for a job scored by a
    served judge, one judge server; evaluate it as `step`, stop them; the row appended to RUN/eval.jsonl."""

    scratch = RunDir(run.root / "eval" / f"server-step_{step}-{os.getpid()}")
    shutil.rmtree(scratch.root, ignore_errors=True)
    scratch.root.mkdir(parents=True, mode=0o700)
    served = config.load_dict(config.to_dict(cfg))
    served.model.path, served.model.lora, served.rollout.port = model_path, None, 0
    served.rollout.local_devices = served.rollout.local_devices[:served.rollout.tensor_parallel]
    write_new_token(scratch)
    scratch.ensure_layout()
    scratch.job_yaml.write_text(config.dump(served))
    procs = [start_rollout_server(scratch, served, 0, served.rollout.local_devices or None,
                                  list(served.rollout.local_cpus) or None)]
    judged = served.reward.judge is not None and not served.eval.reward  # the samples are scored by the judge
    svc = served.services.judge
    if judged and not svc.url:  # one judge server of the job's judge model beside the policy's
        svc.nodes, svc.servers_per_node = 0, 1
        procs.append(start_rollout_server(scratch, served, 0, svc.local_devices[:svc.tensor_parallel] or None,
                                          kind="judge"))
    client = judge_client = None
    watching = threading.Event()
    threading.Thread(target=_report_early_deaths, args=(scratch, procs, watching), daemon=True).start()
    try:
        client = RolloutClient.from_run_dir(scratch, served)
        client.wait_ready(1, served.rollout.startup_timeout_s)
        tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code)
        judge = None
        if judged:
            if not svc.url:
                judge_client = RolloutClient.from_run_dir(scratch, served, kind="judge")
                judge_client.wait_ready(1, served.rollout.startup_timeout_s)
            judge = Judge(served, judge_client,
                          None if svc.url else load_tokenizer(svc.path, key="services.judge.path"))
        sampler = Sampler(served, tokenizer, client, hide=[run.root, run.root.parent], judge=judge)
        evaluator = Evaluator(served, sampler, run, source=source)
        evaluator.log = EvalLog(run)
        row = evaluator.evaluate(step, step, served_version=0)
    except BaseException:
        log.error("the evaluation servers' logs: %s", scratch.logs)
        raise
    finally:
        for c in (client, judge_client):
            if c is not None:
                c.close()
        watching.set()
        write_json_atomic(scratch.done_file, {"time": time.time()})
        stop_processes(procs)
    shutil.rmtree(scratch.root, ignore_errors=True)
    return row


def evaluate_checkpoint(run: RunDir, cfg: JobConfig, step: int) -> dict:
    """Evaluate checkpoint `step` of the run (one array element of `hpc-rl eval --submit` runs exactly this)."""
    scratch = run.root / "eval"
    scratch.mkdir(exist_ok=True)
    folder = model_folder(run, cfg, step, scratch)
    try:
        return evaluate_model(run, cfg, folder, step)
    finally:
        if Path(folder).parent == scratch:  # a LoRA run's merged weights: made for this evaluation only
            shutil.rmtree(folder, ignore_errors=True)


def resolve_run(target: str, step: int | None, every: bool, best: bool, overrides: list[str],
                runs_dir: str = "runs") -> tuple[RunDir, JobConfig, list[int]]:
    """The run, its job spec with the eval overrides, and the checkpoint steps to evaluate; inputs checked."""
    run = rundir.find(target, runs_dir)
    cfg = config.load(run.job_yaml, _eval_overrides(overrides))
    if not cfg.eval.enabled:
        raise ConfigError(f"{run.root}: the run's job has no eval.source; give one, e.g. hpc-rl eval {target} "
                          "eval.source=toy:copy_pair")
    _check_inputs(cfg)
    return run, cfg, checkpoint_steps(run, step, every, best)


def eval_cli(target: str, step: int | None = None, every: bool = False, best: bool = False, job: str | None = None,
             overrides: list[str] | None = None, runs_dir: str = "runs") -> int:
    """`hpc-rl eval RUN|MODEL_DIR ...` on this machine: evaluate and print one line per evaluated step."""
    setup_logging(0)
    overrides = list(overrides or [])
    path = Path(target)
    if job is not None or ((path / "config.json").is_file() and not (path / "job.yaml").is_file()):
        if job is None:
            raise ConfigError(f"{target} is an HF model folder: give the job spec whose eval section and reward to "
                              "use, hpc-rl eval MODEL_DIR --job JOB.yaml")
        if not (path / "config.json").is_file():
            raise ConfigError(f"{target}: not an HF model folder (no config.json); pass a folder from hpc-rl "
                              "export or a checkpoint's hf/ folder")
        cfg = config.load(job, overrides)
        if not cfg.eval.enabled:
            raise ConfigError(f"{job}: eval.source is not set; give the held-out prompts (eval.source=...)")
        _check_inputs(cfg)
        cfg.model.path, cfg.model.tiny, cfg.model.lora = str(path.resolve()), None, None
        for role, svc in cfg.services.roles().items():
            if is_sft_spec(svc.path):
                parse_sft_spec(svc.path, f"services.{role}.path")  # the SFT job exists: before the run dir
        run = rundir.create(cfg.output_dir, f"{cfg.name}-eval")
        for role, svc in cfg.services.roles().items():  # a judge an SFT job makes (built once per cache)
            if is_sft_spec(svc.path):
                svc.path = str(built_sft_model(svc.path, run.root / f"{role}-model", f"services.{role}.path"))
        run.job_yaml.write_text(config.dump(cfg))
        log.info("evaluating %s in %s", path, run.root)
        print(_line(evaluate_model(run, cfg, cfg.model.path, 0)))
        return 0
    run, cfg, steps = resolve_run(target, step, every, best, overrides, runs_dir)
    for s in steps:
        print(_line(evaluate_checkpoint(run, cfg, s)))
    return 0


def _line(row: dict) -> str:
    ks = sorted((k for k in row if k.startswith("eval/pass@")), key=lambda k: int(k.rsplit("@", 1)[1]))
    return (f"step {row['step']}: " + " | ".join(f"{k[5:]} {row[k]:.3f}" for k in ks)
            + f" | reward {row['eval/reward_mean']:.3f} | {int(row['eval/prompts'])} prompts x {row['k']}")
