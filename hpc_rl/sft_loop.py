"""The SFT loop of one trainer rank (algorithm.name: sft), started by hpc_rl/loop.py as the RL loop is: the same
learner (train/: engines, micro-batches, checkpoints, resume at another world size, the non-finite guard), fed from
a dataset instead of the orchestrator; no rollout servers, nothing pushed.

A step takes trainer.prompts_per_step rows (consecutive slices of seeded per-epoch permutations, hpc_rl/data/
sampler.py: a resumed run sees the same rows) and takes one optimizer step per trainer.mini_batch_size of them. The
held-out loss of eval.source's rows is measured at step 0 (eval.at_start), every eval.every steps and after the last.
"""

from __future__ import annotations

import gc
import logging
import os
import time

from . import checkpoints
from .config import JobConfig
from .data.sampler import indices_for_step
from .data.sft import SFTDataset, SFTExample
from .errors import TrainingError
from .metrics import MetricsWriter, progress_line, read_metrics
from .run_summary import summary_lines
from .rundir import RunDir, write_json_atomic
from .stop_at import StopAt

log = logging.getLogger("hpc_rl")
debug = os.environ.get("HPC_RL_DEBUG") == "1"


def step_rows(cfg: JobConfig, rows: int, world: int, rank: int, step: int) -> list[int]:
    """This rank's dataset rows of `step`, in the order its mini-batches take them (each mini-batch split evenly over
    the ranks: the same optimizer steps at any number of ranks)."""
    from .train.update import mini_batch_rows

    chosen = indices_for_step(rows, cfg.samples_per_step, cfg.seed, step, cfg.data.shuffle)
    mine = mini_batch_rows(len(chosen), cfg.trainer.mini_batch_size, world, rank, cfg.seed, step)
    return [chosen[i] for i in mine.tolist()]


def held_out_rows(rows: int, world: int, rank: int) -> tuple[list[int], int]:
    """This rank's share of the held-out rows (strided), and how many copies with no loss pad it to the others'."""
    mine = list(range(rank, rows, world))
    return mine, -(-rows // world) - len(mine)


def sft_step(step: int, cfg: JobConfig, learner, data: SFTDataset) -> dict:
    """One SFT step: this rank's rows, the update, the policy check; collective. The step's metrics (every rank)."""
    from .train.sft_update import pack_examples, sft_update
    from .train.trainer import PolicyNotFinite

    t0 = time.time()
    dist = learner.dist
    rows = step_rows(cfg, len(data), dist.world_size, dist.rank, step)
    batch = pack_examples([data.examples[i] for i in rows], learner.tokenizer.pad_token_id).to(dist.device)
    learner.reset_token_counts()
    stats = sft_update(learner, step, batch, cfg.trainer.mini_batch_size // dist.world_size)
    try:
        learner.check_policy(step, batch, stats)
    except PolicyNotFinite as e:
        raise TrainingError(f"{e}; latest checkpoint: {checkpoints.latest_name(learner.run)}; lower trainer.lr") from None
    stats["pad_fraction"] = learner.pad_fraction()
    stats["epoch"] = (step + 1) * cfg.samples_per_step / len(data)
    stats["step_seconds"] = time.time() - t0
    stats["trained_tokens_per_s"] = stats["trained_tokens"] / max(stats["step_seconds"], 1e-9)
    if debug and dist.is_main:
        log.debug("step %d shapes: this rank's %d rows, input_ids %s (prompt %d + target %d); %.2fs", step + 1,
                  len(rows), tuple(batch.input_ids.shape), batch.prompt_len, batch.responses.shape[1],
                  stats["step_seconds"])
    return stats


def held_out_loss(cfg: JobConfig, learner, held_out: SFTDataset) -> dict:
    """eval/loss (mean negative log-likelihood of the held-out rows' trained tokens) of the current weights."""
    from .orchestrator.evaluation import eval_subset
    from .train.sft_update import held_out_loss as nll
    from .train.sft_update import pack_examples

    dist = learner.dist
    subset = eval_subset(len(held_out), cfg.eval.max_prompts, cfg.seed)  # eval.max_prompts: a seeded subset
    mine, pad = held_out_rows(len(subset), dist.world_size, dist.rank)
    examples = [held_out.examples[subset[i]] for i in mine]
    first = held_out.examples[0]
    examples += [SFTExample(first.prompt, first.target, [0] * len(first.mask))] * pad  # counts nothing
    loss, tokens = nll(learner, pack_examples(examples, learner.tokenizer.pad_token_id).to(dist.device))
    return {"eval/loss": loss, "eval/tokens": tokens}


def train_sft(cfg: JobConfig, run: RunDir, dist) -> None:
    """SFT from the run's newest checkpoint (or model.path) to trainer.steps; collective."""
    from . import preemption, tracking
    from .train.distributed import all_reduce_scalar
    from .train.trainer import Trainer

    learner = Trainer(cfg, run, dist)
    learner.resume()
    data = SFTDataset(cfg.data, learner.tokenizer, cfg.seed)
    held_out = SFTDataset(cfg.eval_data, learner.tokenizer, cfg.seed, "eval") if cfg.eval.enabled else None
    total = cfg.trainer.steps
    writer, stop_at = None, None
    if dist.is_main:
        tracker = tracking.Tracker(cfg, run) if tracking.enabled(cfg) else None
        writer = MetricsWriter(run.metrics, run.tensorboard if cfg.logging.tensorboard else None,
                               resume_step=learner.step, tracker=tracker)
        log.info("SFT on %d rows of %s (%d trained tokens): %d rows per step, %d optimizer step(s) each, %.2f "
                 "epoch(s) in %d steps%s", len(data), cfg.data.source, data.trained_tokens, cfg.samples_per_step,
                 cfg.samples_per_step // cfg.trainer.mini_batch_size, total * cfg.samples_per_step / len(data), total,
                 f"; eval/loss on {min(len(held_out), cfg.eval.max_prompts or len(held_out))} rows of {cfg.eval.source}"
                 if held_out else "")
        if cfg.trainer.stop_at:
            done = [r for r in read_metrics(run.metrics) if r.get("step", 0) <= learner.step]
            stop_at = StopAt(cfg.trainer.stop_at, cfg.trainer.stop_window, done)
    status = "failed"
    try:
        gc.freeze()  # as in loop.train: the run's long-lived objects stay out of the collector's scans
        if held_out is not None and learner.step == 0 and cfg.eval.at_start:
            m = held_out_loss(cfg, learner, held_out)
            if dist.is_main:
                writer.write(0, {**m, "eval/step": 0})
                log.info("step 0/%d | eval loss %.4f", total, m["eval/loss"])
        t_fit, first_step = time.monotonic(), learner.step
        preempted = False
        while learner.step < total:
            step = learner.step
            m = sft_step(step, cfg, learner, data)
            learner.step = learner.policy_version = step + 1
            if held_out is not None and cfg.eval.due(learner.step, total):
                m.update(held_out_loss(cfg, learner, held_out), **{"eval/step": learner.step})
            stopped = None
            if cfg.trainer.stop_at:  # rank 0 decides; every rank stops at the same step
                why = stop_at.reached(m) if dist.is_main else None
                stopped = (why or "trainer.stop_at reached") if all_reduce_scalar(1.0 if why else 0.0, "max") else None
            last = learner.step == total or stopped is not None
            if dist.is_main:
                if m["skipped_updates"]:
                    log.warning("step %d: non-finite loss or gradient; %d optimizer step(s) skipped",
                                learner.step, m["skipped_updates"])
                writer.write(learner.step, m)
                if learner.step % cfg.logging.every == 0 or last:
                    log.info(progress_line(learner.step, total, m, t_fit, first_step))
            learner.stop_if_diverging()
            ended = preemption.end_step(learner.step, total, cfg.checkpoint.every, stopped,
                                        lambda: learner.save_checkpoint(None, None), dist.is_main)
            if ended:
                preempted = ended == "preempted"
                break
        status = "preempted" if preempted else "finished"
        if dist.is_main and not preempted:
            write_json_atomic(run.done_file, {"step": learner.step, "time": time.time()})
            writer.close(status)
            for line in summary_lines(run, time.monotonic() - t_fit):
                log.info(line)
    finally:
        if writer is not None:
            writer.close(status)
