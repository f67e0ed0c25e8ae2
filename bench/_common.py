"""Shared helpers of the bench scripts: job specs, running `hpc-rl run`, reading its metrics, the machine's load,
tables and result files. Benchmarks print numbers; nothing here asserts a timing."""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
sys.path.insert(0, str(REPO))

# The toy model of jobs/toy-grpo-cpu.yaml, and a ~50M-parameter random-init one to see scaling.
SMALL = {"arch": "qwen2", "hidden_size": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2, "head_dim": 64,
         "intermediate_size": 256}
# ~25M parameters (issue 14's variable-length workload): responses of a random-init model over the toy's 64-token
# vocabulary end at a random <eos>, so their lengths spread up to max_new_tokens.
MEDIUM = {"arch": "qwen2", "hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 8, "head_dim": 64,
          "intermediate_size": 1376}
LARGE = {"arch": "qwen2", "hidden_size": 640, "num_layers": 10, "num_heads": 10, "num_kv_heads": 10, "head_dim": 64,
         "intermediate_size": 1728}


def rounds_args(doc: str, steps: int, rounds: int, quick: tuple[int, int], prefix: str):
    """The command line of a bench that runs `hpc-rl run` sides in rounds: --steps, --rounds, --quick (the
    `quick` steps and rounds) and --work (default: a new temp dir named `prefix`); returns (args, work dir)."""
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--work", help="keep the run dirs and logs here (default: a temp dir)")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.rounds = quick
    return args, Path(args.work or tempfile.mkdtemp(prefix=prefix))


def base_job(name: str = "toy-grpo-cpu") -> dict:
    """A job spec of jobs/ as a mapping, to be modified by a benchmark."""
    return yaml.safe_load((REPO / "jobs" / f"{name}.yaml").read_text())


def bench_job(base: str, name: str, steps: int) -> dict:
    """A jobs/ spec renamed, cut to `steps` steps, without checkpoints: what the A/B benches run."""
    job = base_job(base)
    job["name"] = name
    job["trainer"]["steps"] = steps
    job["checkpoint"] = {"every": 0}
    return job


def alternate_sides(job: dict, work: Path, sides: dict, rounds: int, measure) -> tuple[dict, dict]:
    """Run each side (name -> overrides) once per round, in order (A B A B): measure(side, run result) -> a dict of
    numbers. Returns every run's numbers per side and their medians per side."""
    runs: dict[str, list[dict]] = {k: [] for k in sides}
    for r in range(rounds):
        for side, overrides in sides.items():
            res = run_hpc_rl(job, work, f"{re.sub(r'[^a-z0-9]+', '-', side.lower())}-{r}", overrides=overrides)
            runs[side].append(measure(side, res))
            print(f"round {r} {side}: {runs[side][-1]}", flush=True)
    med = {side: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for side, rs in runs.items()}
    return runs, med


def build_model(tiny: dict, out_dir: Path, source: str = "toy:repeat_digit") -> Path:
    """Build the tiny model once so that every side of a comparison loads the same folder."""
    from hpc_rl.config import DataConfig, TinyModelConfig
    from hpc_rl.data.datasets import tokenizer_corpus
    from hpc_rl.models.tiny import build_tiny_model

    return Path(build_tiny_model(TinyModelConfig(**tiny), tokenizer_corpus(DataConfig(source=source), 1), out_dir))


def param_sizes(model_dir: Path) -> list[int]:
    """The element count of every tensor in a folder's safetensors files."""
    from safetensors import safe_open

    sizes = []
    for f in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            sizes += [_prod(st.get_slice(k).get_shape()) for k in st.keys()]
    return sizes


def param_count(model_dir: Path) -> int:
    return sum(param_sizes(model_dir))


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


def hpc_rl_cmd() -> list[str]:
    """The `hpc-rl` console script of this interpreter's env (python -m hpc_rl.cli where it is missing)."""
    exe = Path(sys.executable).parent / "hpc-rl"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "hpc_rl.cli"]


def run_hpc_rl(job: dict, work: Path, tag: str, timeout_s: float = 900, overrides: list[str] | None = None) -> dict:
    """Run `hpc-rl run` on `job` (plus dotted overrides); returns end-to-end wall seconds, per-step seconds and
    the run's metrics."""
    work.mkdir(parents=True, exist_ok=True)
    job = dict(job, output_dir=str(work / f"runs-{tag}"))
    path = work / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(job))
    log = work / f"{tag}.log"
    t0 = time.perf_counter()
    with open(log, "wb") as f:
        p = subprocess.run(hpc_rl_cmd() + ["run", str(path), *(overrides or [])], stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                           timeout=timeout_s)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"hpc-rl run {path} exited {p.returncode}; see {log}:\n" + log.read_text()[-2000:])
    runs = sorted((work / f"runs-{tag}").iterdir())
    rows = [json.loads(x) for x in (runs[-1] / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {"wall_s": wall, "metrics": rows, "step_s": step_intervals(rows), "run_dir": str(runs[-1]),
            "end_time": time.time()}


def step_intervals(rows: list[dict]) -> list[float]:
    """Seconds between consecutive metric lines (the whole loop: step, logging); the first step is its own."""
    out = [rows[0]["step_seconds"]] if rows else []
    out += [b["time"] - a["time"] for a, b in zip(rows, rows[1:])]
    return out


def steady(xs: list[float]) -> float:
    """Median of the steps after the first (warm-up: first batch, lazy allocations)."""
    xs = xs[1:] if len(xs) > 1 else xs
    return statistics.median(xs)


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def fmt_spread(s: dict, digits: int = 2) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def machine() -> dict:
    """What ran it: CPU model, cores, load average (other jobs on this machine distort timings)."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "load_avg": list(os.getloadavg()),
            "python": platform.python_version(), "torch": torch.__version__,
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def table(headers: list[str], rows: list[list]) -> str:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(r)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (x + 2) for x in w) + "|")
    return "\n".join(lines)


def write_result(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path
