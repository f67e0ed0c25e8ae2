"""The run directory: one place on the shared filesystem that every node of a job reads and writes.

Layout (README "Quick start" lists it): job.yaml, token (0600), rendezvous/, logs/, metrics.jsonl, eval.jsonl, eval/,
tensorboard/, plots/, checkpoints/step_N/{hf,deepspeed}/ + checkpoints/latest, weights/ (file sync),
model-init/ (a tiny model built for this run). Also: finding runs and sweeps by name, for every command.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .errors import ClusterError, ConfigError, HpcRlError

# A new run writes 64 hex characters; anything this short was not written by hpc-rl.
MIN_TOKEN_CHARS = 16
# A sweep dir (cluster/sweep.py writes it): sweep.json lists its points, each an ordinary run dir under points/.
SWEEP_JSON = "sweep.json"
POINTS_DIR = "points"
DEFAULT_SWEEPS_DIR = "runs/sweeps"


@dataclass(frozen=True)
class RunDir:
    root: Path

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))

    @property
    def name(self) -> str:
        return self.root.name

    @property
    def job_yaml(self) -> Path:
        return self.root / "job.yaml"

    @property
    def token_file(self) -> Path:
        return self.root / "token"

    @property
    def rendezvous(self) -> Path:
        return self.root / "rendezvous"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def eval_log(self) -> Path:
        """One row per evaluation of a policy version (eval/ metrics, step, policy_version, source)."""
        return self.root / "eval.jsonl"

    def eval_samples(self, step: int, source: str = "train") -> Path:
        """Per-sample results of the evaluation of step `step` (prompt_id, prompt, completion, score, truncated)."""
        return self.root / "eval" / (f"step_{step}.jsonl" if source == "train" else f"step_{step}.{source}.jsonl")

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def plots(self) -> Path:
        return self.root / "plots"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def model_init(self) -> Path:
        return self.root / "model-init"

    @property
    def reward_model_init(self) -> Path:
        """The tiny reward model built for this run (reward.model.tiny)."""
        return self.root / "reward-model-init"

    def rollout_file(self, index: int, kind: str = "rollout") -> Path:
        """Written by server `index` of `kind` (rollout, or reward on reward nodes) once it serves: {index, host,
        port, url, hostname, pid, engine}."""
        return self.rendezvous / f"{kind}-{index}.json"

    def server_failure_file(self, index: int, kind: str = "rollout") -> Path:
        """Written by the launcher of server `index` of `kind` when it gives up on it: {index, node, code, error}."""
        return self.rendezvous / f"failed-{kind}-{index}.json"

    @property
    def master_file(self) -> Path:
        """Written by the first trainer node: {addr, port} for torch.distributed rendezvous."""
        return self.rendezvous / "master.json"

    @property
    def done_file(self) -> Path:
        """Written by trainer rank 0 when training ends; rollout nodes exit when they see it."""
        return self.rendezvous / "done.json"

    def read_token(self) -> str:
        """The run's secret; an empty one would make `Authorization: Bearer ` pass, so it is an error."""
        try:
            token = self.token_file.read_text().strip()
        except FileNotFoundError:
            raise HpcRlError(f"{self.token_file}: the run's token is missing; the run dir is incomplete "
                             "(start the run again with `hpc-rl run` or `hpc-rl submit`)") from None
        if len(token) < MIN_TOKEN_CHARS:
            raise HpcRlError(f"{self.token_file}: the run's token is empty or shorter than {MIN_TOKEN_CHARS} "
                             "characters; write a new one (python -c 'import secrets; print(secrets.token_hex(32))' "
                             f"> {self.token_file}) or start the run again")
        return token

    def ensure_layout(self) -> None:
        for d in (self.rendezvous, self.logs, self.checkpoints, self.weights):
            d.mkdir(parents=True, exist_ok=True)


def write_text_atomic(path: Path, text: str, mode: int | None = None) -> None:
    """Write under a temporary name, flush, rename, flush the directory: readers never see half a file,
    and after a crash the file is the old one or the new one."""
    # pid and thread: two threads of one process writing the same file must not share the temporary name
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    if mode is not None:
        os.chmod(tmp, mode)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_json_atomic(path: Path, data: dict, mode: int | None = None) -> None:
    """write_text_atomic of `data` as JSON."""
    write_text_atomic(path, json.dumps(data, indent=1), mode)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (new names, renames) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file under `root`, then every directory bottom-up, `root` last: after a crash the tree is
    either all on disk or its rename never happened (a right-sized but unflushed file would pass a size check)."""
    dirs = []
    for d, _, files in os.walk(root):
        dirs.append(d)
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for d in reversed(dirs):
        fsync_dir(Path(d))


def read_json(path: Path) -> dict | None:
    """The JSON in `path`, or None when it does not exist (yet) or is being replaced."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


@contextmanager
def file_lock(path: Path):
    """Hold an exclusive lock on `path` (created if missing): processes of one run or sweep, on any node of the
    shared filesystem, that read-then-create the same record take turns."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def new_stamped_dir(output_dir: str | Path, name: str, fix: str = "choose a writable output_dir") -> Path:
    """A new, unique `OUTPUT/NAME-YYYYmmdd-HHMMSS[-N]` folder (0700); ConfigError naming output_dir if not."""
    base = Path(output_dir)
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"output_dir: cannot create {base} ({e.strerror}); {fix}") from None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    root, n = base / f"{name}-{stamp}", 1
    while True:
        try:
            root.mkdir(mode=0o700)
            break
        except FileExistsError:
            n += 1
            root = base / f"{name}-{stamp}-{n}"
    os.chmod(root, 0o700)  # mkdir's mode is filtered by the umask
    return root.resolve()


def create(output_dir: str | Path, name: str) -> RunDir:
    """A new `OUTPUT/NAME-YYYYmmdd-HHMMSS` (0700) with a fresh token (0600)."""
    root = new_stamped_dir(output_dir, name)
    run = RunDir(root)
    write_new_token(run)
    run.ensure_layout()
    return run


def write_new_token(run: RunDir) -> None:
    """A fresh secret in RUN/token (0600, never over an existing one): what every server request must carry."""
    fd = os.open(run.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))


def find(run: str | Path, runs_dir: str | Path = "runs") -> RunDir:
    """Resolve a run given as a path or as a name under `runs_dir` (a unique prefix is enough)."""
    p = Path(run)
    if p.is_dir() and (p / "job.yaml").is_file():
        return RunDir(p.resolve())
    base = Path(runs_dir)
    cand = base / str(run)
    if cand.is_dir() and (cand / "job.yaml").is_file():
        return RunDir(cand.resolve())
    matches = sorted(d for d in base.glob(f"{run}*") if (d / "job.yaml").is_file()) if base.is_dir() else []
    if len(matches) == 1:
        return RunDir(matches[0].resolve())
    if len(matches) > 1:
        names = ", ".join(m.name for m in matches[:5])
        raise HpcRlError(f"run {run!r} is ambiguous in {base}: {names}; give the full name")
    raise HpcRlError(f"run {run!r} not found (looked for a run dir with job.yaml, and in {base}/); "
                     "pass a run dir or a name listed by `hpc-rl status`")


# --------------------------------------------------------------------------- sweeps: found beside runs, so that
# plots, tracking and status read them without importing cluster/.


def find_sweep(sweep: str | Path, sweeps_dir: str | Path = DEFAULT_SWEEPS_DIR) -> Path:
    """A sweep given as its dir or as a name (unique prefix) under sweeps_dir."""
    p = Path(sweep)
    if (p / SWEEP_JSON).is_file():
        return p.resolve()
    base = Path(sweeps_dir)
    if (base / str(sweep) / SWEEP_JSON).is_file():
        return (base / str(sweep)).resolve()
    matches = sorted(d for d in base.glob(f"{sweep}*") if (d / SWEEP_JSON).is_file()) if base.is_dir() else []
    if len(matches) == 1:
        return matches[0].resolve()
    if len(matches) > 1:
        raise ClusterError(f"sweep {sweep!r} is ambiguous in {base}: {', '.join(m.name for m in matches[:5])}; "
                           "give the full name")
    raise ClusterError(f"sweep {sweep!r} not found (no {SWEEP_JSON} there nor in {base}/); pass the sweep dir "
                       "that `hpc-rl sweep` printed")


def is_sweep(path: str | Path) -> bool:
    return (Path(path) / SWEEP_JSON).is_file()


def load_state(root: Path) -> dict:
    data = read_json(root / SWEEP_JSON)
    if data is None:
        raise ClusterError(f"{root / SWEEP_JSON}: missing or unreadable; the sweep dir is incomplete")
    return data


def find_run_or_sweep(target: str, runs_dir: str | Path = "runs", sweeps_dir: str | Path = DEFAULT_SWEEPS_DIR
                      ) -> tuple[str, Path]:
    """("sweep", SWEEP_DIR) or ("run", RUN_DIR) for a path or a name (looked up in runs_dir, then sweeps_dir)."""
    p = Path(target)
    if is_sweep(p) or (not (p / "job.yaml").is_file() and is_sweep(Path(sweeps_dir) / target)):
        return "sweep", find_sweep(target, sweeps_dir)
    try:
        return "run", find(target, runs_dir).root
    except HpcRlError:
        try:
            return "sweep", find_sweep(target, sweeps_dir)
        except HpcRlError:
            raise HpcRlError(f"{target!r} is neither a run nor a sweep (no job.yaml or sweep.json; looked in "
                             f"{runs_dir}/ and {sweeps_dir}/); pass the dir that run/submit/sweep printed") from None


def sweep_point(run_root: Path) -> dict | None:
    """The sweep a run dir is a point of: {"name", "dir", "path", "index", "label", "overrides"}; None otherwise."""
    run_root = Path(run_root).resolve()
    root = run_root.parent.parent
    if run_root.parent.name != POINTS_DIR or not is_sweep(root):
        return None
    state = read_json(root / SWEEP_JSON) or {}
    for p in state.get("points", []):
        if Path(p["run_dir"]).resolve() == run_root:
            return {"name": state.get("name"), "dir": root.name, "path": str(root), "index": p["index"],
                    "label": p["label"], "overrides": p["overrides"]}
    return None
