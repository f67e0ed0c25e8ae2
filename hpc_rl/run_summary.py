"""What a finished run ends its log with: how far the reward (SFT: the loss) came, the best evaluation and where its checkpoint
is, and the commands that take the result further."""

from __future__ import annotations

from .checkpoints import best_checkpoint, best_record, find_latest
from .metrics import duration, read_metrics
from .rundir import RunDir

LAST_N = 5


def summary_lines(run: RunDir, elapsed_s: float | None = None) -> list[str]:
    """A few lines for rank 0's log at the end of a run (nothing is computed that metrics.jsonl does not hold)."""
    every = read_metrics(run.root / "metrics.jsonl")
    rows = [r for r in every if r.get("reward_mean") is not None]
    lines = []
    if rows:
        last = rows[-LAST_N:]
        mean = sum(r["reward_mean"] for r in last) / len(last)
        took = f" in {duration(elapsed_s)}" if elapsed_s is not None else ""
        lines.append(f"summary: {rows[-1]['step']} steps{took}; reward {rows[0]['reward_mean']:.3f} at step "
                     f"{rows[0]['step']}, {mean:.3f} over the last {len(last)}")
    losses = [r for r in every if r.get("loss") is not None]
    if losses and not rows:  # SFT
        last = losses[-LAST_N:]
        took = f" in {duration(elapsed_s)}" if elapsed_s is not None else ""
        held_out = [r for r in every if r.get("eval/loss") is not None]
        evals = (f"; eval loss {held_out[0]['eval/loss']:.4f} at step {held_out[0]['eval/step']:.0f}, "
                 f"{held_out[-1]['eval/loss']:.4f} at step {held_out[-1]['eval/step']:.0f}") if held_out else ""
        lines.append(f"summary: {losses[-1]['step']} steps{took}; loss {losses[0]['loss']:.4f} at step "
                     f"{losses[0]['step']}, {sum(r['loss'] for r in last) / len(last):.4f} over the last "
                     f"{len(last)}{evals}")
    rec = best_record(run)
    ck = best_checkpoint(run) if rec is not None else None
    if rec is not None:
        where = (f"{run.root / 'checkpoints' / 'best'} -> {ck.name}" if ck is not None else
                 "the initial policy (model.path)" if int(rec["step"]) == 0 else "no checkpoint of it is left")
        lines.append(f"summary: best {rec['metric']} {rec['value']:.4f} at step {rec['step']} ({where})")
    latest = find_latest(run)
    if latest is not None:
        best = " [--best]" if ck is not None else ""
        lines.append(f"summary: export with `hpc-rl export {run.root} OUT/{best}` ({latest.name} by default); "
                     f"curves: `hpc-rl plot {run.root}`")
    else:
        lines.append(f"summary: no checkpoint kept (checkpoint.every 0); curves: `hpc-rl plot {run.root}`")
    return lines
