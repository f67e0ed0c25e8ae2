"""`hpc-rl sweep`: a sweep file -> points (override sets x seeds) -> one Slurm job array (submitit).

Sweep dir (`OUTPUT/NAME-YYYYmmdd-HHMMSS/`, OUTPUT defaults to runs/sweeps):
  sweep.yaml            the sweep file as given
  sweep.json            points (index, overrides, label, run_dir) and every array submission
  submitit/             submitit's folder of the array (%A_%a_%t_log.out, ..._result.pkl)
  points/IDX-SLUG-TIME/ one ordinary run dir per point (job.yaml, metrics.jsonl, checkpoints/, ...);
                        its slurm.json names its array element (A_I) and its submitit/ holds links
                        to that element's files, so `hpc-rl status/logs/export/plot` work on it.
  arrays/K/I            submission K, array task I -> the point's run dir (the array preamble's
                        HPC_RL_RUN_DIR, since one script serves every element).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .. import config
from ..config.loading import resolve_override
from ..config.paths import resolve_value
from ..errors import ClusterError, ConfigError
from ..rundir import (
    DEFAULT_SWEEPS_DIR,
    POINTS_DIR,
    SWEEP_JSON,
    RunDir,
    find_sweep,
    load_state,
    new_stamped_dir,
    write_json_atomic,
)
from . import slurmq
from .layout import check_layout, total_nodes
from .render import SUBMITIT_DIR, executor_params, submitit_command
from .submit import SLURM_JSON

log = logging.getLogger("hpc_rl")

SWEEP_YAML = "sweep.yaml"
ARRAYS_DIR = "arrays"
_KEYS = {"name", "base", "overrides", "grid", "list", "seeds", "max_parallel", "output_dir"}
# Stands for the array task id in the rendered preamble; replaced by ${SLURM_ARRAY_TASK_ID:-0}.
_TASK_TOKEN = "HPCRLARRAYTASK"


# --------------------------------------------------------------------------- the sweep file


@dataclass
class Point:
    index: int
    overrides: dict          # dotted key -> value (the point's own, seed included)
    label: str               # "kl.coef=0.01 seed=2": legends and tables

    def override_args(self) -> list[str]:
        return [f"{k}={_yaml_value(v)}" for k, v in self.overrides.items()]


@dataclass
class SweepSpec:
    name: str
    base: Path
    overrides: list = field(default_factory=list)   # applied to every point
    points: list = field(default_factory=list)
    max_parallel: int | None = None
    output_dir: str = DEFAULT_SWEEPS_DIR


def _yaml_value(v: Any) -> str:
    """A value as override text that parses back to the same value."""
    text = yaml.safe_dump(v, default_flow_style=True, width=10**6).strip()
    return text[:-4].strip() if text.endswith("\n...") else text.removesuffix("...").strip()


def short_key(key: str) -> str:
    """algorithm.kl.coef -> kl.coef (the last two parts name a setting well enough for a legend)."""
    return ".".join(key.split(".")[-2:])


def _label(overrides: dict) -> str:
    return " ".join(f"{short_key(k)}={v}" for k, v in overrides.items()) or "base"


def _slug(overrides: dict) -> str:
    parts = [f"{k.split('.')[-1]}{v}" for k, v in overrides.items()]
    return (re.sub(r"[^A-Za-z0-9._-]+", "_", "-".join(parts)) or "base")[:60]


def _override_sets(data: dict, path: str) -> list[dict]:
    grid = data.get("grid")
    lst = data.get("list")
    sets: list[dict] = []
    if grid is not None:
        if not isinstance(grid, dict) or not grid:
            raise ConfigError(f"{path}: grid must map dotted keys to lists of values, e.g. "
                              "grid: {algorithm.kl.coef: [0.0, 0.05]}")
        for k, vals in grid.items():
            if not isinstance(vals, list) or not vals:
                raise ConfigError(f"{path}: grid.{k} must be a non-empty list of values, e.g. [0.0, 0.05]")
        keys = list(grid)
        sets += [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]
    if lst is not None:
        if not isinstance(lst, list) or not all(isinstance(x, dict) for x in lst):
            raise ConfigError(f"{path}: list must be a list of mappings of dotted overrides, e.g. "
                              "list: [{trainer.lr: 1e-3}, {algorithm.name: rloo}]")
        sets += [dict(x) for x in lst]
    return sets or [{}]


def load_sweep(path: str | Path, extra_overrides: list[str] | None = None) -> SweepSpec:
    """Read and check a sweep file; every point's job spec is validated (ConfigError names the point)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{path}: sweep file not found; pass a YAML file such as jobs/sweep-kl.yaml")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML ({getattr(e, 'problem', None) or e}); fix the syntax") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping (name, base, grid/list, seeds, max_parallel)")
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(_KEYS))}")
    if not data.get("base"):
        raise ConfigError(f"{path}: base is missing; name the job spec every point starts from, "
                          "e.g. base: toy-grpo-cpu.yaml (relative to the sweep file)")
    base = Path(str(data["base"]))
    if not base.is_absolute():
        base = (p.parent / base) if (p.parent / base).is_file() else base
    if not base.is_file():
        raise ConfigError(f"{path}: base {data['base']!r} not found (looked beside the sweep file and in the "
                          "current directory); fix the path")
    common = data.get("overrides") or []
    if isinstance(common, dict):
        common = [f"{k}={_yaml_value(v)}" for k, v in common.items()]
    if not isinstance(common, list):
        raise ConfigError(f"{path}: overrides must be a list of KEY=VALUE or a mapping")
    # The sweep file's own paths are relative to it; the extra (CLI) overrides' to the current directory (load).
    here = p.resolve().parent
    common = [resolve_override(str(x), here) for x in common] + list(extra_overrides or [])
    seeds = data.get("seeds")
    if seeds is not None and (not isinstance(seeds, list) or not seeds
                              or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)):
        raise ConfigError(f"{path}: seeds must be a non-empty list of integers, e.g. seeds: [1, 2]")
    mp = data.get("max_parallel")
    if mp is not None and (not isinstance(mp, int) or isinstance(mp, bool) or mp < 1):
        raise ConfigError(f"{path}: max_parallel must be an integer >= 1 (the array throttle %N)")
    points = []
    for ov in _override_sets(data, str(path)):
        for seed in (seeds or [None]):
            o = dict(ov)
            if seed is not None:
                o["seed"] = seed
            points.append(Point(len(points), {k: resolve_value(k, v, here) for k, v in o.items()}, _label(o)))
    gridded = {k for pt in points for k in pt.overrides}
    shadowed = sorted({o.split("=", 1)[0] for o in common if "=" in o} & gridded)
    if shadowed:  # a point's own value is applied after the common overrides, so theirs would never take effect
        logging.getLogger("hpc_rl").warning("%s: the override(s) of %s are replaced by every point's own value (the "
                                            "grid/list/seeds set them); drop them or take the key out of the grid",
                                            path, ", ".join(shadowed))
    name = str(data.get("name") or p.stem)
    if not name or "/" in name or name.startswith("."):
        raise ConfigError(f"{path}: name {name!r} must be a non-empty name without '/'")
    spec = SweepSpec(name=name, base=base, overrides=common, points=points, max_parallel=mp,
                     output_dir=str(data.get("output_dir") or DEFAULT_SWEEPS_DIR))
    for pt in points:
        try:
            check_layout(point_config(spec, pt))
        except ConfigError as e:
            raise ConfigError(f"sweep point {pt.index} ({pt.label}): {e}") from None
    return spec


def point_config(spec: SweepSpec, pt: Point) -> config.JobConfig:
    """The validated job spec of one point (base + common overrides + the point's overrides)."""
    return config.load(spec.base, spec.overrides + pt.override_args())


# --------------------------------------------------------------------------- array rendering


def _array_setup(cfg: config.JobConfig, slot_dir: Path) -> list[str]:
    """The preamble for every element: HPC_RL_RUN_DIR = slot_dir/${SLURM_ARRAY_TASK_ID} (resolved)."""
    from .render import preamble_lines

    placeholder = slot_dir / _TASK_TOKEN
    quoted = shlex.quote(str(placeholder))
    prefix = shlex.quote(str(slot_dir) + "/")
    task = '"${SLURM_ARRAY_TASK_ID:-0}"'
    lines = []
    for line in preamble_lines(cfg, placeholder):
        lines.append(line.replace(quoted, prefix + task).replace(_TASK_TOKEN, "${SLURM_ARRAY_TASK_ID:-0}"))
    # The slot is a link; the processes (and `hpc-rl cancel`) see the point's real run dir.
    lines.append('export HPC_RL_RUN_DIR="$(cd "$HPC_RL_RUN_DIR" && pwd -P)"')
    return lines


def array_params(cfgs: list[config.JobConfig], slot_dir: Path, name: str, max_parallel: int | None) -> dict:
    """submitit parameters shared by every element; ConfigError when points need different resources."""
    # Points differ in name (their run dir's); the array carries the sweep's.
    cfgs = [dataclasses.replace(c, name=name) for c in cfgs]
    params = [executor_params(c, slot_dir / _TASK_TOKEN) for c in cfgs]
    for p, c in zip(params, cfgs):
        p["setup"] = _array_setup(c, slot_dir)
    first = params[0]
    for i, p in enumerate(params[1:], 1):
        diff = sorted(k for k in set(first) | set(p) if first.get(k) != p.get(k))
        if diff:
            raise ConfigError(f"sweep points 0 and {i} need different Slurm settings ({', '.join(diff)}); one job "
                              "array shares them: sweep only keys that keep nodes/time/env the same, or split "
                              "the sweep")
    if max_parallel is not None:
        first["array_parallelism"] = max_parallel
    return first


def render_array(cfgs: list[config.JobConfig], sweep_root: Path, name: str, max_parallel: int | None,
                 slot: int = 1) -> str:
    """The sbatch script submitit writes for the array (as --dry-run shows it)."""
    from submitit.slurm.slurm import _make_sbatch_string

    params = array_params(cfgs, sweep_root / ARRAYS_DIR / str(slot), name, max_parallel)
    folder = sweep_root / SUBMITIT_DIR
    return _make_sbatch_string(command=submitit_command(folder), folder=folder, map_count=len(cfgs), **params)


# --------------------------------------------------------------------------- sweep dir


def _create_sweep_dir(output_dir: str, name: str) -> Path:
    return new_stamped_dir(output_dir, name, fix="set output_dir in the sweep file")


# --------------------------------------------------------------------------- submitting


def _link_element_files(run_root: Path, sweep_root: Path, element_id: str, nodes: int) -> None:
    """Point RUN/submitit/ at the element's files in the array's folder (they appear when it runs)."""
    d = run_root / SUBMITIT_DIR
    d.mkdir(exist_ok=True)
    for t in range(nodes):
        for suffix in ("log.out", "log.err", "result.pkl"):
            name = f"{element_id}_{t}_{suffix}"
            link = d / name
            if not link.is_symlink():
                link.symlink_to(os.path.relpath(sweep_root / SUBMITIT_DIR / name, d))


def submit_points(root: Path, state: dict, indices: list[int]) -> str:
    """Submit the given points as one array (one submitit job per point); records it in sweep.json."""

    from .task import NodeTask

    points = [state["points"][i] for i in indices]
    runs = [RunDir(Path(p["run_dir"])) for p in points]
    cfgs = [config.load(r.job_yaml) for r in runs]
    slot = len(state.get("submissions", [])) + 1
    slot_dir = root / ARRAYS_DIR / str(slot)
    slot_dir.mkdir(parents=True, exist_ok=True)
    for task, r in enumerate(runs):
        (slot_dir / str(task)).symlink_to(os.path.relpath(r.root, slot_dir))
    params = array_params(cfgs, slot_dir, state["name"], state.get("max_parallel"))
    jobs = slurmq.submit(root / SUBMITIT_DIR, params, lambda ex: ex.submit_array([NodeTask(r.root) for r in runs]),
                         "the job array", "slurm.partition/account/qos/time and MaxArraySize against `scontrol show "
                         "config`")
    array_id = str(jobs[0].job_id).split("_")[0]
    nodes = total_nodes(cfgs[0])
    now = time.time()
    for p, r, cfg, job in zip(points, runs, cfgs, jobs):
        _link_element_files(r.root, root, str(job.job_id), nodes)
        (r.root / "cancelled.json").unlink(missing_ok=True)
        write_json_atomic(r.root / SLURM_JSON, {
            "job_id": str(job.job_id), "array_job_id": array_id, "sweep": str(root), "sweep_index": p["index"],
            "layout": cfg.slurm.layout, "nodes": nodes, "trainer_nodes": cfg.trainer.nodes,
            "rollout_nodes": cfg.rollout.nodes, "submitted_at": now, "slurm_conf": os.environ.get("SLURM_CONF")})
        p.setdefault("job_ids", []).append(str(job.job_id))
        p["job_id"] = str(job.job_id)
    state.setdefault("submissions", []).append({"array_job_id": array_id, "slot": slot, "indices": indices,
                                                "time": now})
    write_json_atomic(root / SWEEP_JSON, state)
    return array_id


def _print_dry_run(spec: SweepSpec) -> None:
    cfgs = [point_config(spec, pt) for pt in spec.points]
    root = Path(spec.output_dir).resolve() / f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    print(f"# sweep {spec.name}: {len(spec.points)} point(s) of {spec.base}, max_parallel "
          f"{spec.max_parallel or 'unlimited'}, {total_nodes(cfgs[0])} node(s) each")
    if spec.overrides:
        print(f"# every point: {' '.join(spec.overrides)}")
    print("# INDEX  OVERRIDES")
    for pt in spec.points:
        print(f"# {pt.index:>5}  {' '.join(pt.override_args()) or '(base)'}")
    print(render_array(cfgs, root, spec.name, spec.max_parallel), end="")
    print(f"# dry run: nothing submitted; the sweep dir would be {root}")


def run_sweep(path: str, overrides: list[str], dry_run: bool = False) -> int:
    """`hpc-rl sweep FILE [overrides]`: prepare one run dir per point and submit them as one job array."""
    spec = load_sweep(path, overrides)
    if dry_run:
        _print_dry_run(spec)
        return 0
    slurmq.need_sbatch("sweep", "`hpc-rl sweep FILE --dry-run` shows the points and the array script")
    from ..launch import prepare_run

    root = _create_sweep_dir(spec.output_dir, spec.name)
    shutil.copyfile(path, root / SWEEP_YAML)
    state: dict = {"name": spec.name, "sweep_file": str(Path(path).resolve()), "base": str(spec.base.resolve()),
                   "overrides": spec.overrides, "max_parallel": spec.max_parallel, "created": time.time(),
                   "points": []}
    width = max(2, len(str(len(spec.points) - 1)))
    try:
        for pt in spec.points:
            name = f"{pt.index:0{width}d}-{_slug(pt.overrides)}"
            run, _ = prepare_run(str(spec.base), spec.overrides + pt.override_args()
                                 + [f"output_dir={root / POINTS_DIR}", f"name={name}"])
            state["points"].append({"index": pt.index, "overrides": pt.overrides, "label": pt.label,
                                    "run_dir": str(run.root)})
        write_json_atomic(root / SWEEP_JSON, state)
        array_id = submit_points(root, state, [p["index"] for p in state["points"]])
    except BaseException:
        if not (root / SWEEP_JSON).is_file() or not load_state(root).get("submissions"):
            shutil.rmtree(root, ignore_errors=True)  # nothing was submitted: leave nothing behind
        raise
    print(f"submitted Slurm job array {array_id}: sweep {spec.name}, {len(spec.points)} point(s), "
          f"max_parallel {spec.max_parallel or 'unlimited'}")
    print(f"sweep dir: {root}")
    print(f"follow it: hpc-rl sweep status {root} [--follow] ; hpc-rl plot {root}")
    return 0


def _squeue_answers() -> bool:
    try:
        return subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def resubmit_failed(sweep: str, sweeps_dir: str = DEFAULT_SWEEPS_DIR) -> int:
    """`hpc-rl sweep resubmit SWEEP --failed`: one new array of the points that failed; each resumes
    from its own latest checkpoint (the trainer does that whenever the run dir has one)."""
    from .sweep_status import point_infos

    root = find_sweep(sweep, sweeps_dir)
    state = load_state(root)
    if not _squeue_answers():
        # Without squeue a running point would look UNKNOWN and be submitted a second time.
        raise ClusterError("squeue does not answer, so running points cannot be told from failed ones; "
                           "retry when `squeue` works (check SLURM_CONF and the controller)")
    failed = [i["index"] for i in point_infos(root, state) if i["state"] in RESUBMIT_STATES]
    if not failed:
        print(f"sweep {state['name']}: no failed point to resubmit")
        return 0
    array_id = submit_points(root, state, failed)
    print(f"resubmitted point(s) {', '.join(map(str, failed))} of sweep {state['name']} as Slurm job array {array_id} "
          "(each resumes from its latest checkpoint)")
    return 0


# Ended without finishing: worth another attempt.
RESUBMIT_STATES = {"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "PREEMPTED",
                   "UNKNOWN", "STOPPED", "DEADLINE"}


def sweep_cli(args: list[str], dry_run: bool = False, as_json: bool = False, failed: bool = False,
              follow: bool = False, sweeps_dir: str = DEFAULT_SWEEPS_DIR) -> int:
    """`hpc-rl sweep [run] FILE [overrides] | status SWEEP | resubmit SWEEP --failed`."""
    action, rest = (args[0], args[1:]) if args and args[0] in ("run", "status", "resubmit") else ("run", args)
    if not rest:
        raise ConfigError(f"hpc-rl sweep {action}: missing the {'sweep file' if action == 'run' else 'sweep'}; "
                          "e.g. hpc-rl sweep jobs/sweep-kl.yaml, hpc-rl sweep status SWEEP_DIR")
    if action == "run":
        return run_sweep(rest[0], rest[1:], dry_run=dry_run)
    if len(rest) != 1:
        raise ConfigError(f"hpc-rl sweep {action}: expected one sweep, got {' '.join(rest)}")
    if action == "status":
        from .sweep_status import show_sweep_status

        return show_sweep_status(rest[0], sweeps_dir=sweeps_dir, as_json=as_json, follow=follow)
    if not failed:
        raise ConfigError("hpc-rl sweep resubmit: say which points: --failed (the only choice so far)")
    return resubmit_failed(rest[0], sweeps_dir=sweeps_dir)
