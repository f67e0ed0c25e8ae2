"""Experiment tracking on rank 0: W&B and MLflow receive metrics.jsonl's numbers at the same step numbers.

Trackers run in a thread of their own: a slow network or a failing tracker never holds a step up. A tracker that
fails (no login, no network in online mode, a full disk) is switched off with one warning; metrics.jsonl is the
record either way.

RUN/tracking.json keeps each tracker's run id, so that a resumed or requeued run continues the same tracked run.
Steps a tracker already holds are **skipped**, not logged again: after an interruption the run resumes from its
checkpoint and re-runs the steps after it, which the tracker got before the interruption; it keeps those first
values (metrics.jsonl keeps the re-run's: equal but for timings when the resume is exact, as it is here for
single-turn jobs). Steps up to the checkpoint that a tracker lacks (W&B buffers records in its own process, which
a SIGKILL takes down unwritten) are logged from metrics.jsonl on resume. What a tracker holds is read from its own
record (W&B's run files, MLflow's metric history), not from a side file that a kill could leave behind.

W&B offline runs live in RUN/wandb/ (one folder per attempt, the same run id): `hpc-rl sync RUN` uploads them.
MLflow's default store is a folder: RUN/mlruns, or SWEEP/mlruns for a sweep's points (one experiment per sweep).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import queue
import secrets
import string
import struct
import threading
import time
from pathlib import Path

from .config import JobConfig
from .errors import ConfigError
from .metrics import metric_step
from .rundir import RunDir, file_lock, read_json, write_json_atomic

log = logging.getLogger("hpc_rl")

TRACKING_JSON = "tracking.json"
INSTALL_HINT = "pip install 'hpc-rl[tracking]' (or ./install.sh --tracking)"
# How long the end of a run waits for the trackers to finish (an online upload); then they are left behind.
FINISH_TIMEOUT_S = 120.0
# What trackers get of a metrics row: its numbers; "step" is the step and "time" the timestamp.
_NOT_METRICS = ("step", "time")


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_installed(cfg: JobConfig) -> None:
    """A tracker the job turns on needs its library here: a one-line error naming the key and the extra."""
    lg = cfg.logging
    for key, on, module, package in (("logging.wandb.mode", lg.wandb.enabled, "wandb", "wandb"),
                                     ("logging.mlflow", lg.mlflow.enabled, "mlflow", "mlflow-skinny")):
        if on and not _installed(module):
            raise ConfigError(f"{key}: tracking needs the {package} package, which this environment lacks; "
                              f"{INSTALL_HINT}")


@contextlib.contextmanager
def deepspeed_without_mlflow():
    """DeepSpeed's autotuner imports MLflow whenever it is installed (`import deepspeed`: 3.0 s instead of 0.45 s,
    measured). DeepSpeed first imported inside this block skips it; afterwards MLflow imports as usual."""
    import sys

    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        yield
        return
    sys.modules["mlflow"] = None  # what an import sees where a package is not installed
    try:
        yield
    finally:
        if "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]


def enabled(cfg: JobConfig) -> bool:
    return cfg.logging.wandb.enabled or cfg.logging.mlflow.enabled


def tracked_metrics(row: dict) -> dict:
    """The metrics of a metrics.jsonl row a tracker logs: every number but the step and the time."""
    return {k: v for k, v in row.items()
            if k not in _NOT_METRICS and isinstance(v, (int, float)) and not isinstance(v, bool)}


@dataclasses.dataclass
class RunInfo:
    """What the trackers are told about a run."""

    name: str                # the run dir's name: the tracked run's display name
    config: dict             # the resolved job spec (job.yaml), plus the sweep point for a sweep's points
    sweep: dict | None       # {"name", "dir", "index", "label", "overrides"} for a sweep's point


def run_info(cfg: JobConfig, run: RunDir) -> RunInfo:
    from .rundir import sweep_point

    spec = dataclasses.asdict(cfg)
    point = sweep_point(run.root)
    if point is not None:
        spec["sweep"] = point
    return RunInfo(run.name, spec, point)


def _new_id() -> str:
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


# --------------------------------------------------------------------------- W&B

BLOCK = 32768  # the .wandb file: LevelDB log blocks of records (the W&B SDK's transaction log)


def _wandb_records(path: Path):
    """The serialized Record protobufs of a .wandb file, in order; a record cut off by a kill ends the scan."""
    data = path.read_bytes()
    if data[:4] != b":W&B":
        return
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        if len(chunk) < length:
            return
        pos += 7 + length
        if kind == 1:  # full
            yield chunk
        elif kind == 2:  # first
            parts = chunk
        elif kind == 3:  # middle
            parts += chunk
        elif kind == 4:  # last
            yield parts + chunk
            parts = b""


def wandb_run_dirs(root: Path, run_id: str | None = None) -> list[Path]:
    """The W&B run folders (one per attempt) in ROOT/wandb/, oldest first; only those of `run_id` if given."""
    folder = root / "wandb"
    if not folder.is_dir():
        return []
    dirs = [d for d in folder.iterdir() if d.is_dir() and d.name.startswith(("offline-run-", "run-"))
            and (run_id is None or d.name.endswith("-" + run_id))]
    return sorted(dirs, key=lambda d: d.name.split("-", 2)[-1])


def _wandb_parsed(run_dir: Path):
    """(record type, Record) of a W&B run folder's .wandb files in order; a damaged record ends its file."""
    from wandb.proto import wandb_internal_pb2 as pb

    for f in sorted(run_dir.glob("run-*.wandb")):
        for data in _wandb_records(f):
            rec = pb.Record()
            try:
                rec.ParseFromString(data)
            except Exception:  # what follows a damaged record is unreliable
                break
            yield rec.WhichOneof("record_type"), rec


def _items(items) -> dict:
    return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}


def wandb_history(run_dir: Path) -> list[dict]:
    """The history rows (metrics with _step) a W&B run folder's .wandb file holds."""
    return [_items(rec.history.item) for kind, rec in _wandb_parsed(run_dir) if kind == "history"]


def wandb_run_record(run_dir: Path) -> dict:
    """The run of a W&B run folder: id, project, entity, group, tags, name, and its config (all updates applied)."""
    out: dict = {}
    config: dict = {}
    for kind, rec in _wandb_parsed(run_dir):
        if kind == "run" and not out:
            r = rec.run
            out = {"id": r.run_id, "project": r.project, "entity": r.entity, "group": r.run_group,
                   "tags": list(r.tags), "name": r.display_name}
            config.update(_items(r.config.update))
        elif kind == "config":
            config.update(_items(rec.config.update))
    out["config"] = config
    return out


class _Wandb:
    name = "W&B"

    def __init__(self, cfg: JobConfig, run: RunDir, info: RunInfo):
        self.cfg, self.run, self.info = cfg, run, info
        self.wb = None
        self.last = 0

    def start(self, ids: dict) -> int:
        import wandb

        w = self.cfg.logging.wandb
        run_id = ids.get("id") or _new_id()
        if "id" not in ids:
            ids.update(id=run_id, project=w.project, entity=w.entity, mode=w.mode)
            _save_ids(self.run, "wandb", ids)
        held = max((int(r.get("_step", 0)) for d in wandb_run_dirs(self.run.root, run_id) for r in wandb_history(d)),
                   default=0)
        group = w.group or (self.info.sweep["dir"] if self.info.sweep else None)
        # A W&B service of whatever started this job (a notebook, a script that used wandb) is named by WANDB_SERVICE
        # and inherited: this run would log through that process, where a killed attempt's run id stays "in use"
        # and the resume cannot open it. The run gets its own service, which ends with rank 0.
        os.environ.pop("WANDB_SERVICE", None)
        self.wb = wandb.init(project=w.project, entity=w.entity, group=group, tags=list(w.tags) or None,
                             name=self.info.name, id=run_id, resume="allow", mode=w.mode, dir=str(self.run.root),
                             settings=wandb.Settings(console="off", silent=True))
        self.wb.config.update(self.info.config, allow_val_change=True)
        # eval/ metrics join the row of a later step in async mode: their charts use the step they evaluated.
        self.wb.define_metric("eval/step")
        self.wb.define_metric("eval/*", step_metric="eval/step")
        # Online, the server knows the steps of attempts whose files are elsewhere (another node's disk).
        held = max(held, int(self.wb.starting_step or 0) - 1 if self.wb.resumed else 0)
        where = f"RUN/wandb/ (upload: hpc-rl sync {self.run.root})" if w.mode == "offline" else self.wb.url
        log.info("W&B: %s run %s, project %s%s -> %s", w.mode, run_id, w.project,
                 f", group {group}" if group else "", where)
        return held

    def log(self, step: int, metrics: dict, t: float) -> None:
        self.wb.log(metrics, step=step)
        self.last = step

    def finish(self, status: str, png: Path | None) -> None:
        import wandb

        if png is not None and self.last:
            self.wb.log({"plots/curves": wandb.Image(str(png))}, step=self.last)
        if status == "preempted":
            self.wb.mark_preempting()
        self.wb.finish(exit_code=0 if status in ("finished", "preempted") else 1)
        # finish() returns before the service has closed the run's files (their last block is written at the close):
        # a resume or `hpc-rl sync` reading them now would miss the last steps. teardown waits for the service to end.
        wandb.teardown()


# --------------------------------------------------------------------------- MLflow


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def mlflow_uri(cfg: JobConfig, run: RunDir, info: RunInfo) -> str:
    """The tracking URI: logging.mlflow.tracking_uri, else a file store in the run dir (the sweep dir for a point)."""
    uri = cfg.logging.mlflow.tracking_uri
    if uri:
        return uri if "://" in uri or uri.startswith("file:") else Path(uri).resolve().as_uri()
    root = Path(info.sweep["path"]) if info.sweep else run.root
    return (root / "mlruns").as_uri()


def mlflow_client(uri: str):
    """An MlflowClient of `uri`; folder stores allowed (MLflow 3 keeps them in maintenance mode and refuses them
    unless asked: a folder in the run dir is what a cluster without a tracking server has)."""
    if uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


class _Mlflow:
    name = "MLflow"
    # MLflow's limit on a parameter's value; longer values (a chat template) are in the job.yaml artifact.
    MAX_PARAM = 6000

    def __init__(self, cfg: JobConfig, run: RunDir, info: RunInfo):
        self.cfg, self.run, self.info = cfg, run, info
        self.client = None
        self.run_id = None
        self.last = 0

    def start(self, ids: dict) -> int:
        uri = ids.get("tracking_uri") or mlflow_uri(self.cfg, self.run, self.info)
        self.client = mlflow_client(uri)
        if ids.get("run_id"):
            self.run_id = ids["run_id"]
            held = 0
            for key in self.client.get_run(self.run_id).data.metrics:
                held = max([held] + [m.step for m in self.client.get_metric_history(self.run_id, key)])
            self.client.update_run(self.run_id, status="RUNNING")
            log.info("MLflow: run %s resumed in %s", self.run_id, uri)
            return held
        name = self.cfg.logging.mlflow.experiment or (self.info.sweep["dir"] if self.info.sweep else self.cfg.name)
        exp_id = self._experiment_id(uri, name)
        tags = {"hpc_rl.run_dir": str(self.run.root)}
        if self.info.sweep:
            tags.update({"sweep": self.info.sweep["dir"], "sweep.point": self.info.sweep["label"]})
        self.run_id = self.client.create_run(exp_id, run_name=self.info.name, tags=tags).info.run_id
        _save_ids(self.run, "mlflow", {"run_id": self.run_id, "experiment": name, "tracking_uri": uri})
        from mlflow.entities import Param

        params = [Param(k, json.dumps(v) if not isinstance(v, str) else v)
                  for k, v in _flatten(self.info.config).items()]
        params = [p for p in params if len(p.value) <= self.MAX_PARAM]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.client.log_artifact(self.run_id, str(self.run.job_yaml))
        log.info("MLflow: run %s in experiment %s at %s", self.run_id, name, uri)
        return 0

    def _experiment_id(self, uri: str, name: str) -> str:
        """The experiment `name`, created if missing. A folder store does not make names unique: two points of a
        sweep starting together would each create one (and one point's run would be missing from the experiment the
        sweep reads), so they take turns under a lock in the store. A tracking server refuses the second create."""
        from mlflow.utils.file_utils import local_file_uri_to_path

        with (file_lock(Path(local_file_uri_to_path(uri)) / ".hpc-rl-experiments.lock") if uri.startswith("file:")
              else contextlib.nullcontext()):
            exp = self.client.get_experiment_by_name(name)
            if exp is not None:
                return exp.experiment_id
            try:
                return self.client.create_experiment(name)
            except Exception:  # a tracking server: another point of the sweep created it first
                return self.client.get_experiment_by_name(name).experiment_id

    def log(self, step: int, metrics: dict, t: float) -> None:
        from mlflow.entities import Metric

        ms = int(t * 1000)
        # MLflow's metric names take no '@': eval/pass@4 is eval/pass_at_4 there.
        batch = [Metric(k.replace("@", "_at_"), float(v), ms, metric_step(k, step, metrics))
                 for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])
        self.last = step

    def finish(self, status: str, png: Path | None) -> None:
        if png is not None:
            self.client.log_artifact(self.run_id, str(png), "plots")
        if status != "preempted":  # a preempted run goes on after the requeue: it stays RUNNING
            self.client.set_terminated(self.run_id, "FINISHED" if status == "finished" else "FAILED")


_IDS_LOCK = threading.Lock()  # W&B and MLflow start in threads of their own and both update tracking.json


def _save_ids(run: RunDir, key: str, ids: dict) -> None:
    with _IDS_LOCK:
        data = read_json(run.root / TRACKING_JSON) or {}
        data[key] = ids
        write_json_atomic(run.root / TRACKING_JSON, data)


# --------------------------------------------------------------------------- the tracker thread


class Tracker:
    """Rank 0's trackers, each in a thread behind a queue (one that hangs holds up neither training nor the other):
    log() returns at once; close() waits up to FINISH_TIMEOUT_S for them all."""

    def __init__(self, cfg: JobConfig, run: RunDir):
        info = run_info(cfg, run)
        self.run = run
        backends = []
        if cfg.logging.wandb.enabled:
            backends.append(_Wandb(cfg, run, info))
        if cfg.logging.mlflow.enabled:
            backends.append(_Mlflow(cfg, run, info))
        self._png_lock = threading.Lock()
        self._png: list = []  # [path or None] once drawn: the curves PNG both trackers attach
        self._closed = False
        self._workers = []
        for b in backends:
            q: queue.Queue = queue.Queue()
            t = threading.Thread(target=self._work, args=(b, q), name=f"hpc-rl-tracking-{b.name}", daemon=True)
            self._workers.append((b, q, t))
            t.start()

    def log(self, step: int, row: dict) -> None:
        item = ("log", step, tracked_metrics(row), row.get("time", time.time()))
        for _, q, _ in self._workers:
            q.put(item)

    def close(self, status: str = "finished") -> None:
        """End the tracked runs: "finished" (the curves PNG is attached), "preempted" or "failed"."""
        if self._closed:
            return
        self._closed = True
        deadline = time.time() + FINISH_TIMEOUT_S
        for _, q, _ in self._workers:
            q.put(("close", status))
        for b, _, t in self._workers:
            t.join(max(0.0, deadline - time.time()))
            if t.is_alive():
                log.warning("tracking: %s did not finish within %.0fs of the run's end; its run may lack the last "
                            "steps (metrics.jsonl has them%s)", b.name, FINISH_TIMEOUT_S,
                            "; offline files: hpc-rl sync RUN" if b.name == "W&B" else "")

    def _warn(self, backend, what: str, e: Exception) -> None:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        log.warning("tracking: %s failed to %s (%s: %s); it is off for the rest of this run, metrics.jsonl has every "
                    "step", backend.name, what, type(e).__name__, first[:300])

    def _work(self, b, q: queue.Queue) -> None:
        ids = read_json(self.run.root / TRACKING_JSON) or {}
        try:
            held = b.start(dict(ids.get("wandb" if b.name == "W&B" else "mlflow") or {}))
        except Exception as e:
            self._warn(b, "start", e)
            return  # the queue fills with what nobody logs: a few numbers a step
        if held:
            log.info("tracking: %s already holds steps up to %d (logged before the interruption); those are "
                     "skipped, not logged twice", b.name, held)
        while True:
            item = q.get()
            try:
                if item[0] == "close":
                    b.finish(item[1], self._curves_png() if item[1] == "finished" else None)
                    return
                _, step, metrics, t = item
                if step > held:
                    b.log(step, metrics, t)
            except Exception as e:
                self._warn(b, "finish" if item[0] == "close" else f"log step {item[1]}", e)
                return

    def _curves_png(self) -> Path | None:
        with self._png_lock:
            if not self._png:
                png = None
                try:
                    from .metrics import read_metrics
                    from .plots import PNG_NAME, plot_curves, read_evals

                    png = plot_curves([(self.run.name, read_metrics(self.run.metrics))], f"Run {self.run.name}",
                                      self.run.plots / PNG_NAME, [read_evals(self.run)])
                except Exception as e:  # matplotlib missing or broken: the metrics still go
                    log.warning("tracking: no curves PNG (%s: %s)", type(e).__name__, e)
                self._png.append(png)
            return self._png[0]


# --------------------------------------------------------------------------- hpc-rl sync


def _wandb_base_url() -> str:
    import wandb

    # As wandb resolves it: its settings file (`wandb login --host`), then WANDB_BASE_URL.
    settings = wandb.Settings()
    try:
        settings.update_from_system_settings()
    except Exception:  # an unreadable settings file: the environment and the default remain
        pass
    settings.update_from_env_vars(dict(os.environ))
    return str(settings.base_url).rstrip("/")


def _reachable(url: str, timeout_s: float = 10.0) -> str | None:
    """None if a TCP connection to the URL's host opens within timeout_s, else the reason."""
    import socket
    from urllib.parse import urlparse

    u = urlparse(url)
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        socket.create_connection((u.hostname, port), timeout=timeout_s).close()
        return None
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"


def sync(target: str, dry_run: bool = False, runs_dir: str = "runs", sweeps_dir: str = "runs/sweeps") -> int:
    """`hpc-rl sync RUN|SWEEP [--dry-run]`: upload the offline W&B runs not yet synced (from a machine with internet)."""
    import subprocess
    import sys

    from .errors import HpcRlError
    from .rundir import find_run_or_sweep, load_state

    kind, root = find_run_or_sweep(target, runs_dir, sweeps_dir)
    roots = [Path(p["run_dir"]) for p in load_state(root)["points"]] if kind == "sweep" else [root]
    for store in sorted({r / "mlruns" for r in roots + [root]}):
        if store.is_dir():
            print(f"MLflow file store {store}: nothing to sync (view it: MLFLOW_ALLOW_FILE_STORE=true mlflow ui "
                  f"--backend-store-uri {store})")
    if not _installed("wandb"):
        if any(wandb_run_dirs(r) for r in roots):
            raise HpcRlError(f"{target}: has W&B runs but this environment lacks the wandb package; {INSTALL_HINT}")
        print(f"{target}: no W&B runs")
        return 0
    pending = []
    for d in (d for r in roots for d in wandb_run_dirs(r)):
        if not d.name.startswith("offline-run-") or any(d.glob("*.wandb.synced")):
            continue
        if not wandb_run_record(d).get("id"):
            print(f"skipping {d}: empty (its attempt was killed before W&B wrote a record; resume logged its steps)")
            continue
        pending.append(d)
    if not pending:
        print(f"{target}: no offline W&B runs left to sync")
        return 0
    for d in pending:
        rec, steps = wandb_run_record(d), [int(h["_step"]) for h in wandb_history(d) if "_step" in h]
        span = f"steps {min(steps)}-{max(steps)}" if steps else "no steps"
        print(f"{'would sync' if dry_run else 'syncing'} {d}: W&B run {rec.get('id')} (project {rec.get('project')}, "
              f"{span})")
    if dry_run:
        return 0
    url = _wandb_base_url()
    why = _reachable(url)
    if why is not None:
        raise HpcRlError(f"cannot reach W&B at {url} ({why}); run `hpc-rl sync` where there is internet (a login "
                         "node), or set WANDB_BASE_URL to your W&B server")
    # One call: W&B uploads the attempts of a run in order of start time, each after the previous one's steps.
    p = subprocess.run([sys.executable, "-m", "wandb", "sync", "--yes", *map(str, pending)])
    done = [d for d in pending if any(d.glob("*.wandb.synced"))]
    for d in done:
        print(f"synced {d}")
    if p.returncode != 0 or len(done) < len(pending):
        left = [str(d) for d in pending if d not in done]
        raise HpcRlError(f"wandb sync exited with code {p.returncode}; not synced: {', '.join(left)} (see wandb's "
                         "output above; `wandb login` if it asks for a key)")
    return 0
