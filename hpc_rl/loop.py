"""The RL loop of one trainer rank: `python -m hpc_rl.loop --run-dir RUN` (env RANK/WORLD_SIZE/...; launch.py starts
one per rank, on this machine or on each trainer node of a Slurm job).

Every rank holds the learner (train/: its shard of the engines); rank 0 also holds the orchestrator (orchestrator/:
the rollout servers, what is generated and scored, the pushes, evaluations and metrics). One step, as the README's
"How a step runs" lists it, is `rl_step` below, read top to bottom. What rank 0 decides alone (the batch, the shaped
rewards) reaches every rank through `on_rank0`, and so does its failure: every rank stops at the same point.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import time
import traceback

from . import checkpoints, preemption
from .config import JobConfig
from .errors import HpcRlError, PolicyNotFiniteError, RolloutError, TrainingError
from .metrics import progress_line, read_metrics
from .run_summary import summary_lines
from .rundir import RunDir
from .startup_clock import PHASES
from .stop_at import StopAt

log = logging.getLogger("hpc_rl")
debug = os.environ.get("HPC_RL_DEBUG") == "1"

class NoServer(Exception):
    """Every rank at once: rank 0 got no samples (no rollout server answered): wait for one, or checkpoint and stop."""


class Fatal(Exception):
    """Every rank at once: rank 0's side failed beyond recovery (a failed weight-sync check, a reward error)."""


class NotFinite(Exception):
    """Every rank at once: the policy is not finite (`version` on the servers; None: after this rank's update)."""

    def __init__(self, message: str, version: int | None = None):
        super().__init__(message)
        self.version = version


def on_rank0(dist, orch, fn):
    """fn() on rank 0, its result on every rank; its failure raised on every rank alike (NoServer, NotFinite, Fatal)."""
    from .train.distributed import broadcast_object

    out = None
    if dist.is_main:
        try:
            out = ("ok", fn())
        except RolloutError as e:  # every server gone past the client's timeouts and retries
            out = ("no server", f"{e}{orch.server_log_tails()}")
        except PolicyNotFiniteError as e:  # the pushed weights, not the servers: a version to set aside
            out = ("not finite", str(e), e.version if e.version is not None and e.version >= 0 else orch.policy_version)
        except HpcRlError as e:  # e.g. a failed weight-sync check of the pipeline's last push
            out = ("fatal", str(e))
    out = broadcast_object(out)
    if out[0] == "no server":
        raise NoServer(out[1])
    if out[0] == "not finite":
        raise NotFinite(f"the policy is not finite on the rollout servers ({out[1]})", out[2])
    if out[0] == "fatal":
        raise Fatal(out[1])
    return out[1]


def rl_step(step: int, cfg: JobConfig, dist, learner, orch) -> dict:
    """One RL iteration; collective over the trainer ranks. Returns the step's metrics on rank 0."""
    from .train.trainer import PolicyNotFinite

    t_start = time.time()
    batch = on_rank0(dist, orch, lambda: orch.batch(step))  # 1-3: generated and scored on rank 0 (or ahead)
    t_wait = time.time() - t_start
    learner.score_with_reward_model(batch)  # 3: a reward model on the trainer ranks
    scores = on_rank0(dist, orch, lambda: orch.scores(batch))  # the reward parts combined and shaped in step order
    shard = learner.shard(step, batch, scores)  # 4: this rank's samples
    t0 = time.time()
    fwd = learner.forwards(shard)  # 5: old and reference log-probs, values
    t_fwd = time.time() - t0
    adv, returns = learner.advantages(shard, fwd)  # 6
    if debug and dist.is_main:
        log.debug("step %d shapes: %d samples, this rank's shard input_ids %s (prompt %d + response %d), micro-batch "
                  "%s; no-grad forwards %.2fs%s", step + 1, len(batch), tuple(shard.batch.input_ids.shape),
                  shard.batch.prompt_len, shard.batch.responses.shape[1],
                  f"{cfg.trainer.max_tokens_per_micro_batch} tokens" if cfg.trainer.max_tokens_per_micro_batch
                  else f"{learner.micro} samples", t_fwd, "" if learner.old_logprobs_forward else
                  " (old log-probs come from the update's forward)")
    t0 = time.time()
    stats = learner.update(step, shard, fwd, adv, returns)  # 7: PPO epochs over mini-batches
    t_update = time.time() - t0
    t0 = time.time()
    # Past trainer.max_skipped_in_a_row fit() stops after this step: its update (diverging, on every rank alike)
    # is not pushed either.
    pushing = learner.skipped_in_a_row < cfg.trainer.max_skipped_in_a_row
    named = learner.policy_state() if pushing else None  # 8: gathered from the shards (collective) ...
    t_gather = time.time() - t0
    try:  # ... and checked: a non-finite policy is neither pushed nor checkpointed
        learner.check_policy(step, shard.batch, stats, named, gathered=pushing)
    except PolicyNotFinite as e:
        raise NotFinite(str(e)) from None
    t0 = time.time()
    learner.policy_version = step + 1
    sync = {}
    if pushing:
        every = cfg.trainer.check_sync_every
        probe = learner.sync_probe(batch, named, gathered=True) if every and (step + 1) % every == 0 else None
        sync = orch.push(named, step + 1, probe) if dist.is_main else {}  # ... pushed (now, or by the pipeline)
    del named
    t_sync = t_gather + time.time() - t0
    stats, kl_mean = learner.step_stats(shard, fwd, stats)  # 9: metrics
    if not dist.is_main:
        return {}
    t_end = time.time()
    m = orch.step_stats(batch, t_start, t_end)
    m.update(stats)
    m.update({"kl": kl_mean, "kl_coef": learner.kl_ctl.value, "trainer_wait_seconds": t_wait,
              "forward_seconds": t_fwd, "update_seconds": t_update, "sync_seconds": t_sync,
              "sync_bytes": sync.get("bytes", 0), "sync_max_diff": sync.get("max_diff"),
              "push_seconds": sync.get("seconds"), "step_seconds": t_end - t_start,
              "policy_version": learner.policy_version})
    if debug:
        log.debug("step %d timings: waited for the batch %.2fs (generate %.2fs, reward %.2fs), no-grad forwards "
                  "%.2fs, update %.2fs, weight sync %.2fs (%s, %d bytes), rollout idle %.2fs, total %.2fs",
                  step + 1, t_wait, m["gen_seconds"], m["reward_seconds"], t_fwd, t_update, t_sync,
                  sync.get("transport", "-"), sync.get("bytes", 0), m["rollout_idle_seconds"], m["step_seconds"])
    return m


def fit(cfg: JobConfig, run: RunDir, dist, learner, orch) -> None:
    """Steps until trainer.steps, with checkpoints, preemption, waits for lost servers and the stops; collective."""
    from .train.distributed import all_reduce_scalar, broadcast_object

    total = cfg.trainer.steps
    if learner.step > 0:  # the servers start from the initial weights: give them the resumed policy first
        named = learner.policy_state()
        if dist.is_main:
            orch.resume_push(named, learner.step)
        del named
    elif dist.is_main:
        orch.evaluate_start()
    preempted, stopped = False, None
    stop_at = None
    if cfg.trainer.stop_at and dist.is_main:
        done = [r for r in read_metrics(run.root / "metrics.jsonl") if r.get("step", 0) <= learner.step]
        stop_at = StopAt(cfg.trainer.stop_at, cfg.trainer.stop_window, done)
    t_fit, first_step = time.monotonic(), learner.step
    while learner.step < total:
        step = learner.step
        try:
            m = rl_step(step, cfg, dist, learner, orch)
        except NoServer as e:
            back = broadcast_object(orch.wait_for_servers(step, str(e)) if dist.is_main else None)
            if back:  # as a resume does: the batches already made, then a push of the current policy
                named = learner.policy_state()
                if dist.is_main:
                    orch.restart(step, named, learner.policy_version)
                continue
            # Keep the finished steps: a checkpoint of the last one (unless it exists), then stop.
            if learner.step > 0 and not checkpoints.step_dir(run, learner.step).is_dir():
                save(learner, orch)
            if dist.is_main:
                raise RolloutError(f"step {step + 1}: no rollout server answered; checkpoint of step {learner.step} "
                                   f"kept, resume with `hpc-rl run JOB --resume RUN`: {e}") from None
            return  # the other ranks stop quietly; rank 0 reports
        except Fatal as e:
            kept = ""
            if learner.step > 0:  # every rank is here: keep the finished steps, as a lost server does
                if not checkpoints.step_dir(run, learner.step).is_dir():
                    save(learner, orch)
                kept = f"; checkpoint of step {learner.step} kept, resume with `hpc-rl run JOB --resume RUN`"
            if dist.is_main:
                orch.pipeline.close()
                raise TrainingError(f"{e}{kept}") from None
            return
        except NotFinite as e:
            if dist.is_main:
                orch.pipeline.close()
                what = str(e) if e.version is None else f"step {step + 1}: {e}"
                raise TrainingError(f"{what}; latest checkpoint: {roll_back(run, e.version)}; lower trainer.lr "
                                    "(or check the reward scale)") from None
            return
        learner.step = step + 1
        if learner.step == first_step + 1:
            PHASES.mark("first step done")
            if debug and dist.is_main and PHASES.t0 is not None:
                log.debug("start-up of rank 0, seconds since the command: %s", PHASES.line())
            # What the first step loaded lives as long as the run as well (the agents' openai SDK, templates,
            # tokenizers' and torch's lazy parts: ~140k objects with an agent): frozen with the rest, the step's
            # collections do not scan it again (a full one paused an agent step ~0.08 s).
            gc.collect()
            gc.freeze()
        if cfg.trainer.stop_at:  # rank 0 decides; every rank stops at the same step
            why = None
            if dist.is_main:
                try:
                    why = stop_at.reached(m)
                except TrainingError as e:
                    why = e
            agreed = all_reduce_scalar(2.0 if isinstance(why, Exception) else 1.0 if why else 0.0, "max")
            if agreed == 2.0:
                if dist.is_main:
                    orch.pipeline.close()
                    raise why
                return
            stopped = (why or "trainer.stop_at reached on rank 0") if agreed else None
        last = learner.step == total or stopped is not None
        if dist.is_main:
            if m["skipped_updates"]:
                log.warning("step %d: non-finite loss or gradient; %d optimizer step(s) skipped (%d in a row at "
                            "the step's end)", learner.step, m["skipped_updates"], learner.skipped_in_a_row)
            orch.record(learner.step, m, last=last)
            if learner.step % cfg.logging.every == 0 or last:
                log.info(progress_line(learner.step, total, m, t_fit, first_step))
        learner.stop_if_diverging()
        # keep_best: every evaluated step has a checkpoint that can become the best one.
        ended = preemption.end_step(learner.step, total, cfg.checkpoint.every, stopped, lambda: save(learner, orch),
                                    dist.is_main, due=bool(cfg.checkpoint.keep_best and cfg.eval.due(learner.step, total)))
        if ended:
            preempted = ended == "preempted"
            break
    if dist.is_main:
        orch.finish(learner.step, preempted)
        if not preempted and (learner.step == total or stopped):
            for line in summary_lines(run, time.monotonic() - t_fit):
                log.info(line)


def save(learner, orch) -> None:
    """A checkpoint of the learner's step with the orchestrator's part (rank 0's); collective."""
    pending, state = orch.checkpoint_state(learner.step) if orch is not None else (None, None)
    learner.save_checkpoint(pending, state)


def roll_back(run: RunDir, version: int | None) -> str:
    """Rank 0, as the run stops for a policy that is not finite: checkpoints of that policy or later (version None:
    none was written) are set aside; what `latest` names now, in words."""
    aside = checkpoints.set_aside(run, version) if version is not None else []
    now = checkpoints.latest_name(run)
    if aside:
        now += (f", rolled back from {aside[-1].name.removesuffix(checkpoints.NOT_FINITE_SUFFIX)} (kept as "
                f"{', '.join(p.name for p in aside)})")
    return now


def train(cfg: JobConfig, run: RunDir, dist) -> None:
    """The learner on every rank, the orchestrator on rank 0, then the loop."""
    from .orchestrator.orchestrator import Orchestrator, Resumed
    from .train.trainer import Trainer

    PHASES.mark("process group")
    learner = Trainer(cfg, run, dist)
    PHASES.mark("engines built")
    state = learner.resume()
    orch = None
    try:
        if dist.is_main:
            resumed = Resumed(state["step"], state["reward_shaper"], state["pending"],
                              state.get("partial_rollouts")) if state else Resumed()
            orch = Orchestrator(cfg, run, learner.tokenizer, resumed)
            PHASES.mark("servers ready")
        # torch's, DeepSpeed's and transformers' objects (about a million) live as long as the run: a full collection
        # over them paused a rank ~0.25 s, and the collectives make every rank wait for the paused one. Frozen, the
        # collector scans only what the steps allocate.
        gc.freeze()
        fit(cfg, run, dist, learner, orch)
    except BaseException:
        if orch is not None:  # the tracked runs end as failed, their last steps flushed
            orch.metrics.close("failed")
        raise


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hpc_rl.loop")
    ap.add_argument("--run-dir", required=True)
    args = ap.parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    # Slurm's warning signal (submitit asks for USR2; USR1 when sent by hand): checkpoint at the next step
    # boundary and exit, instead of the default action (death) that would lose the step.
    signal.signal(signal.SIGUSR1, preemption.request)
    signal.signal(signal.SIGUSR2, preemption.request)
    from .logs import setup_logging
    from .tracking import deepspeed_without_mlflow

    log = setup_logging(rank)
    PHASES.mark("rank up")
    try:
        from . import config
        from .train.distributed import init_distributed, shutdown_distributed

        run = RunDir(os.path.abspath(args.run_dir))
        cfg = config.load(run.job_yaml)
        if isinstance(cfg.trainer.nodes, str):  # a node range: this attempt's nodes, from its ranks
            cfg.resolve_trainer_nodes(int(os.environ["WORLD_SIZE"]) // cfg.trainer.procs_per_node)
        with deepspeed_without_mlflow():
            import deepspeed  # noqa: F401 (imported once here, without MLflow's hooks)
        PHASES.mark("deepspeed imported")
        if cfg.algorithm.supervised:
            from .sft_loop import train_sft

            train_sft(cfg, run, init_distributed(cfg))
        else:
            train(cfg, run, init_distributed(cfg))
        shutdown_distributed()  # every rank left fit() after the same last collective; its engines are out of scope
        return 0
    except HpcRlError as e:
        # The launcher prints rank 0's last line as the run's error.
        log.error("error: %s", e)
        return 2
    except Exception:
        log.error("rank %d crashed:\n%s", rank, traceback.format_exc())
        return 1


def exit_now(code: int) -> None:
    """Exit without the interpreter's teardown: with torch, DeepSpeed and gloo loaded it takes ~2 s a rank after
    the run's files are closed (each run and each requeue waits for it)."""
    sandbox = sys.modules.get("hpc_rl.rollout.environments.sandbox")
    if sandbox is not None:  # atexit does not run: the python tool's sandbox processes and cgroups go here
        sandbox.close_all()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
