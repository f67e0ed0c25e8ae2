"""Per-step metrics from rank 0: metrics.jsonl always (flushed each step), TensorBoard when installed, W&B and
MLflow when configured (tracking.py: the same numbers at the same steps)."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from pathlib import Path

log = logging.getLogger("hpc_rl")

# The one line per step, in this order; other metrics go to the files only.
STEP_LINE = [("reward_mean", "reward", "{:.3f}"), ("monitor_mean", "monitor", "{:.3f}"), ("kl", "kl", "{:.4f}"),
             ("distill/reverse_kl", "distill kl", "{:.3f}"),
             ("distill/topk_kl", "top-k kl", "{:.3f}"), ("policy_loss", "pg_loss", "{:.4f}"), ("loss", "loss", "{:.4f}"),
             ("tool_calls_per_sample", "tools/sample", "{:.2f}"),
             ("turns_per_sample", "turns", "{:.2f}"), ("truncated_frac", "truncated", "{:.2f}"),
             ("groups_kept_frac", "groups kept", "{:.2f}"), ("generated_reward_mean", "generated reward", "{:.3f}"),
             ("value_loss", "vf_loss", "{:.4f}"), ("entropy", "entropy", "{:.3f}"), ("grad_norm", "grad", "{:.3f}"),
             ("step_seconds", "s/step", "{:.2f}"), ("trainer_wait_seconds", "wait s", "{:.2f}"),
             ("rollout_idle_seconds", "rollout idle s", "{:.2f}"), ("gen_tokens_per_s", "gen tok/s", "{:.0f}"),
             ("eval/step", "eval of step", "{:.0f}"), ("eval/pass@1", "eval pass@1", "{:.3f}"),
             ("eval/reward_mean", "eval reward", "{:.3f}"), ("eval/loss", "eval loss", "{:.4f}")]


def samples_sha1(responses: list[list[int]]) -> str:
    """Names the exact samples (token ids) in one string: two runs agree on it iff they generated the same tokens
    (how resume and reproducibility are checked)."""
    return hashlib.sha1(json.dumps(responses).encode()).hexdigest()[:16]


def server_token_stats(served: dict[int, float]) -> dict:
    """server_tokens/K and server_share/K of a step from {server index: tokens it generated}."""
    total = sum(served.values())
    out = {f"server_tokens/{k}": float(n) for k, n in sorted(served.items())}
    out.update({f"server_share/{k}": n / total for k, n in sorted(served.items()) if total})
    return out


def metric_step(key: str, step: int, metrics: dict) -> int:
    """The step a metric is plotted at: eval/ metrics at the step they evaluated (eval/step), the rest at `step`."""
    if key.startswith("eval/") and "eval/step" in metrics:
        return int(metrics["eval/step"])
    return step


def idle_seconds(spans: list, t0: float, t1: float) -> float:
    """Seconds of [t0, t1] covered by none of the [start, end] spans (an end of None: still running at t1)."""
    clipped = sorted((max(a, t0), min(b if b is not None else t1, t1)) for a, b in spans)
    covered, end = 0.0, t0
    for a, b in clipped:
        a = max(a, end)
        if b > a:
            covered += b - a
            end = b
    return max(0.0, (t1 - t0) - covered)


def duration(seconds: float) -> str:
    """4s, 2m05s, 3h07m: a step line's elapsed time and ETA."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_step_line(step: int, total: int, m: dict, elapsed: float | None = None, eta: float | None = None) -> str:
    """Rank 0's line for one step; elapsed (this process's training time) and eta (at this session's mean step time)
    close it when given."""
    parts = [f"step {step}/{total}"]
    for key, label, fmt in STEP_LINE:
        if key in m and m[key] is not None:
            v = m[key]
            parts.append(f"{label} {fmt.format(v) if isinstance(v, (int, float)) and math.isfinite(v) else v}")
    if elapsed is not None:
        parts.append(f"elapsed {duration(elapsed)}")
    if eta is not None and step < total:
        parts.append(f"eta {duration(eta)}")
    return " | ".join(parts)


def progress_line(step: int, total: int, m: dict, t_start: float, first_step: int) -> str:
    """The step line of `step` with the time since `t_start` (time.monotonic() when this process's first step,
    `first_step`, began) and the ETA at this session's mean step time."""
    elapsed = time.monotonic() - t_start
    return format_step_line(step, total, m, elapsed, elapsed / (step - first_step) * (total - step))


class MetricsWriter:
    """Append-only metrics.jsonl (a resumed run drops rows past its checkpoint step) + TensorBoard + trackers."""

    def __init__(self, path: Path, tensorboard_dir: Path | None = None, resume_step: int | None = None,
                 tracker=None):
        self.path = path
        self._tracker = tracker
        self._closed = False
        if resume_step is not None and path.exists():
            truncate_after(path, resume_step)
        if tracker is not None and resume_step:
            # A tracker may lack steps up to the checkpoint (W&B's buffer dies with a killed rank): it gets the
            # kept rows and logs those it does not hold.
            for row in read_metrics(path):
                tracker.log(row["step"], row)
        self._f = open(path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(str(tensorboard_dir))
            except Exception as e:  # tensorboard not installed: JSONL alone is the record
                log.debug("TensorBoard disabled: %s", e)

    def write(self, step: int, metrics: dict) -> None:
        row = {"step": step, "time": time.time()}
        row.update({k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()})
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v) and k != "eval/step":
                    self._tb.add_scalar(k, v, metric_step(k, step, metrics))
            self._tb.flush()
        if self._tracker is not None:
            self._tracker.log(step, row)

    def close(self, status: str = "finished") -> None:
        """Close the files; end the tracked runs as "finished", "preempted" or "failed" (a second call: no-op)."""
        if self._closed:
            return
        self._closed = True
        self._f.close()
        if self._tb is not None:
            self._tb.close()
        if self._tracker is not None:
            self._tracker.close(status)


def truncate_after(path: Path, step: int) -> None:
    """Drop the rows of a JSONL file (metrics.jsonl, eval.jsonl) past `step`: a resume re-runs those steps, and a
    step keeps one row. Rewritten atomically; a line cut off by a kill goes too."""
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("step", 0) <= step:
            keep.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(k + "\n" for k in keep), encoding="utf-8")
    tmp.replace(path)


def read_metrics(path: Path) -> list[dict]:
    """All complete rows of a metrics.jsonl (a last line cut off by a kill is skipped)."""
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
