"""`hpc-rl plot` on a run dir and on a sweep dir (metrics written here, no training): PNG size,
metadata, and that every one of 8 runs shows up as its own colour in the image."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from hpc_rl import config
from hpc_rl.plots import DPI, FIG_SIZE_IN

REPO = Path(__file__).resolve().parents[1]
SIZE = (int(FIG_SIZE_IN[0] * DPI), int(FIG_SIZE_IN[1] * DPI))
TAB10 = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
         (227, 119, 194), (127, 127, 127)]


def _run(root: Path, rows: list[dict]) -> Path:
    root.mkdir(parents=True)
    (root / "job.yaml").write_text(config.dump(config.load(REPO / "jobs" / "toy-grpo-cpu.yaml")))
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _rows(n: int, scale: float) -> list[dict]:
    return [{"step": s, "reward_mean": scale * s / n, "kl": 0.01 * scale * s} for s in range(1, n + 1)]


def _colours(img) -> set:
    return {tuple(int(v) for v in c) for c in np.unique(np.asarray(img.convert("RGB")).reshape(-1, 3), axis=0)}


def _plot(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpc_rl.cli", "plot", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_plot_of_a_run_writes_png_into_its_plots_dir(tmp_path):
    run = _run(tmp_path / "runs" / "toy-1", _rows(20, 1.0))
    p = _plot("toy", "--runs-dir", str(tmp_path / "runs"))
    assert p.returncode == 0, p.stderr
    png = Path(p.stdout.strip())
    assert png == run / "plots" / "curves.png"
    img = Image.open(png)
    assert img.size == SIZE == (1300, 600)
    assert img.text["Title"] == "Run toy-1"
    assert json.loads(img.text["Description"]) == {"runs": ["toy-1"], "metrics": ["reward_mean", "kl"]}
    colours = _colours(img)
    assert TAB10[0] in colours and len(colours) > 50  # the curve is drawn, not just axes


def test_plot_of_a_run_with_evaluations_adds_the_held_out_panel(tmp_path):
    run = _run(tmp_path / "runs" / "toy-1", _rows(20, 1.0))
    (run / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": s, "source": "train", "eval/pass@1": s / 20} for s in (0, 10, 20)] + [
        {"step": 20, "source": "offline", "eval/pass@1": 0.9}]))
    p = _plot(str(run))
    assert p.returncode == 0, p.stderr
    img = Image.open(Path(p.stdout.strip()))
    assert img.size == SIZE
    assert json.loads(img.text["Description"])["metrics"] == ["reward_mean", "kl", "eval/pass@1"]
    # The eval panel is the right third: the run's colour is drawn there (its line and the offline cross).
    right = img.convert("RGB").crop((2 * SIZE[0] // 3 + 60, 60, SIZE[0] - 10, SIZE[1] - 60))
    assert TAB10[0] in _colours(right)


def test_sweep_plot_with_8_runs_keeps_each_run_apart(tmp_path):
    root = tmp_path / "sw-1"
    points = []
    for i in range(8):
        run = _run(root / "points" / f"{i:02d}-x", _rows(40, 0.2 + 0.1 * i))
        points.append({"index": i, "label": f"kl.coef={i / 10} seed=1", "overrides": {}, "run_dir": str(run)})
    (root / "sweep.json").write_text(json.dumps({"name": "kl", "points": points}))
    out = tmp_path / "o" / "sweep.png"
    p = _plot(str(root), "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert Path(p.stdout.strip()) == out
    img = Image.open(out)
    assert img.size == SIZE and img.text["Title"] == "Sweep kl: 8 runs"
    assert json.loads(img.text["Description"])["runs"] == [f"{i}: kl.coef={i / 10} seed=1" for i in range(8)]
    px = np.asarray(img.convert("RGB")).reshape(-1, 3)
    counts = {c: int((px == c).all(axis=1).sum()) for c in TAB10}
    assert all(n > 200 for n in counts.values()), counts  # every run's colour is visible (line + legend)
    # The legend sits below both panels: the bottom fifth of the image holds the 8 entries' colours.
    w, h = img.size
    bottom = _colours(img.crop((0, int(h * 0.8), w, h)))
    assert all(c in bottom for c in TAB10)


def test_plot_errors_are_one_line(tmp_path):
    _run(tmp_path / "runs" / "empty-1", [])
    p = _plot("empty", "--runs-dir", str(tmp_path / "runs"))
    assert p.returncode == 2 and "no metrics yet" in p.stderr and p.stderr.count("\n") == 1
    p = _plot("nothing", "--runs-dir", str(tmp_path / "runs"), "--sweeps-dir", str(tmp_path))
    assert p.returncode == 2 and "neither a run nor a sweep" in p.stderr


def test_plot_without_matplotlib_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
    from hpc_rl import cli

    _run(tmp_path / "runs" / "toy-1", _rows(5, 1.0))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: `import matplotlib` raises
    rc = cli.main(["plot", "toy", "--runs-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "hpc-rl plot needs matplotlib" in err[0] and "pip install 'hpc-rl[plots]'" in err[0], err
