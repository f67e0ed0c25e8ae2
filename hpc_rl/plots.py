"""`hpc-rl plot RUN_OR_SWEEP`: reward and KL curves from metrics.jsonl as a PNG (matplotlib, Agg), and a panel of
held-out pass@1 from eval.jsonl when the runs evaluate (evaluations during training as lines, `hpc-rl eval`'s
offline ones as crosses).

A run: RUN/plots/curves.png. A sweep: SWEEP/plots/curves.png with one line per point, the legend
naming each point's overrides. The PNG's text chunks carry the title and the plotted runs (JSON).
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import HpcRlError
from .metrics import read_metrics
from .rundir import RunDir

PNG_NAME = "curves.png"
FIG_SIZE_IN = (13.0, 6.0)
DPI = 100
# (metric key, panel title, y-axis label with its unit)
PANELS = [("reward_mean", "Mean reward", "mean reward per sample (reward units)"),
          ("kl", "KL to the reference policy", "KL (nats per token)")]
# An SFT run's panels (its metrics have a loss, no reward).
SFT_PANELS = [("loss", "Training loss", "mean negative log-likelihood per trained token (nats)"),
              ("eval/loss", "Held-out loss", "eval/loss on eval.source's rows (nats per token)")]
# The held-out panel (eval.jsonl): the metric and its title.
EVAL_PANEL = ("eval/pass@1", "Held-out pass@1 (eval.jsonl)", "pass@1 on the eval prompts")
_STYLES = ["-", "--", "-.", ":"]


def read_evals(run: RunDir) -> list[dict]:
    """The rows of a run's eval.jsonl (empty without one)."""
    return read_metrics(run.eval_log)


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and "step" in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_curves(curves: list[tuple[str, list[dict]]], title: str, out: Path,
                evals: list[list[dict]] | None = None) -> Path:
    """Draw reward and KL (SFT runs: training and held-out loss) against step for each (label, metrics rows), and
    held-out pass@1 when `evals` (each curve's eval.jsonl rows) has any; write a PNG of fixed size."""
    try:
        import matplotlib
    except ImportError:
        raise HpcRlError("hpc-rl plot needs matplotlib, which this environment lacks: install it with "
                         "`pip install 'hpc-rl[plots]'` (install.sh installs it)") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_eval = bool(evals) and any(evals)
    sft = not any(_series(rows, "reward_mean")[0] for _, rows in curves) and any(_series(rows, "loss")[0]
                                                                                for _, rows in curves)
    main = SFT_PANELS if sft else PANELS
    xlabel = "training step" if sft else "training step (RL iterations)"
    panels = main + ([EVAL_PANEL] if with_eval else [])
    fig, axes = plt.subplots(1, len(panels), figsize=FIG_SIZE_IN, dpi=DPI, layout="constrained")
    colors = plt.get_cmap("tab10").colors
    handles = []
    if with_eval:
        key, panel, ylabel = EVAL_PANEL
        ax = axes[-1]
        for n, rows in enumerate(evals):
            color = colors[n % len(colors)]
            for source, style in (("train", dict(linestyle=_STYLES[n % len(_STYLES)], marker="o")),
                                  ("offline", dict(linestyle="none", marker="x", markersize=8))):
                x, y = _series(sorted((r for r in rows if r.get("source", "train") == source),
                                      key=lambda r: r["step"]), key)
                if x:
                    ax.plot(x, y, color=color, linewidth=1.8, markersize=style.pop("markersize", 4), **style,
                            label=f"{curves[n][0]} ({source})" if len(curves) == 1 else None)
        ax.set_title(panel)
        ax.set_xlabel("training step (RL iterations)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(True, alpha=0.3)
        if len(curves) == 1:
            ax.legend(fontsize=9)
    for (key, panel, ylabel), ax in zip(main, axes):
        for n, (label, rows) in enumerate(curves):
            x, y = _series(rows, key)
            # Colour and dash pattern both vary so that 8+ lines stay apart, also in grey print.
            (line,) = ax.plot(x, y, color=colors[n % len(colors)], linestyle=_STYLES[n % len(_STYLES)],
                              linewidth=1.8, marker="o" if len(x) <= 30 else None, markersize=3, label=label)
            if key == main[0][0]:
                handles.append(line)
        ax.set_title(panel)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=13)
    if len(curves) > 1:
        fig.legend(handles=handles, loc="outside lower center", ncols=min(4, len(curves)), fontsize=9,
                   title="overrides", frameon=False)
    elif curves:
        axes[0].legend(handles=handles, fontsize=9)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"Title": title, "Description": json.dumps({"runs": [c[0] for c in curves],
                                                        "metrics": [p[0] for p in panels]})}
    fig.savefig(out, dpi=DPI, metadata=meta)
    plt.close(fig)
    return out


def _sweep_curves(root: Path) -> tuple[str, list[tuple[str, list[dict]]], list[list[dict]]]:
    from .rundir import load_state

    state = load_state(root)
    runs = [RunDir(Path(p["run_dir"])) for p in state["points"]]
    curves = [(f"{p['index']}: {p['label']}", read_metrics(run.metrics)) for p, run in zip(state["points"], runs)]
    return f"Sweep {state['name']}: {len(curves)} runs", curves, [read_evals(run) for run in runs]


def plot_target(target: str, out: str | None = None, runs_dir: str = "runs",
                sweeps_dir: str = "runs/sweeps") -> int:
    """`hpc-rl plot RUN_OR_SWEEP [--out PNG]`: write the PNG and print its path."""
    from .rundir import find_run_or_sweep

    kind, root = find_run_or_sweep(target, runs_dir, sweeps_dir)
    if kind == "sweep":
        title, curves, evals = _sweep_curves(root)
        dest = Path(out) if out else root / "plots" / PNG_NAME
    else:
        run = RunDir(root)
        title, curves, evals = f"Run {run.name}", [(run.name, read_metrics(run.metrics))], [read_evals(run)]
        dest = Path(out) if out else run.plots / PNG_NAME
    if not any(rows for _, rows in curves):
        raise HpcRlError(f"{target}: no metrics yet (metrics.jsonl is empty or missing); plot once the run has "
                         "logged a step")
    plot_curves(curves, title, dest, evals)
    print(dest)
    return 0
