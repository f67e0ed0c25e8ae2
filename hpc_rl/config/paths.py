"""Relative paths in a job spec resolve against the file that names them, not the shell's directory.

A job file's paths (models, `sft:` jobs, data and eval files, a folder hf: dataset, an MLflow file store) are read
relative to the job file's own directory; a path that is not there but is in the project checkout (the convention of
the shipped jobs/, which name `sft:jobs/toy-sft-cpu.yaml`) is taken from the checkout, and one found in neither from
the current directory (where relative paths were read before, so that older job files keep working). A dotted CLI
override is typed
in a shell, so its relative paths resolve against the current directory (then the checkout). Every resolved path is
absolute, so the run's job.yaml means the same from any directory and on every node. Values that are not paths
(`toy:NAME`, `hf:ORG/NAME` of the hub, a URI) are left as they are.
"""

from __future__ import annotations

from pathlib import Path

# The checkout the package runs from (an editable install), whose jobs/ the shipped job files name; None when the
# package is installed elsewhere.
_ROOT = Path(__file__).resolve().parents[2]
CHECKOUT = _ROOT if (_ROOT / "pyproject.toml").is_file() and (_ROOT / "jobs").is_dir() else None

# Dotted keys whose values are paths (or specs that hold one), with the kind of value each takes.
MODEL_KEYS = ("model.path", "model.critic_path", "reward.model.path", "services.teacher.path", "services.judge.path")
SOURCE_KEYS = ("data.source", "eval.source")
FOLDER_KEYS = ("logging.mlflow.tracking_uri",)
PATH_KEYS = MODEL_KEYS + SOURCE_KEYS + FOLDER_KEYS

# A model built by an SFT job: sft:JOB.yaml[@STEPS] (models/sft_built.py builds it).
SFT_PREFIX = "sft:"
# Prefixes of data sources that are not files.
_NOT_FILES = ("toy:", "reasoning_gym:", "verifiers:")


def resolve_path(text: str, base: Path, must_exist: bool = False) -> str:
    """`text` as an absolute path: the first of `base`, the checkout and the current directory (what relative paths
    meant before they were read from the job file) that holds it, else beside `base` (so that the error a missing
    file gets names where it was looked for); `must_exist`: return `text` as it is when it is found nowhere (a name
    that may mean something else, such as a hub dataset)."""
    p = Path(text).expanduser()
    if p.is_absolute():
        return str(p)
    for root in (base, CHECKOUT, Path.cwd()):
        if root is not None and (root / p).exists():
            return str((root / p).resolve())
    return text if must_exist else str((base / p).resolve())


def resolve_value(key: str, value, base: Path):
    """A path-valued key's value with its relative path resolved against `base`; other values as they are."""
    if not isinstance(value, str) or not value.strip():
        return value
    if key in MODEL_KEYS:
        if value.startswith(SFT_PREFIX):  # sft:JOB.yaml[@STEPS]: the job file is the path
            body = value[len(SFT_PREFIX):]
            job, at, steps = body.rpartition("@") if "@" in body else (body, "", "")
            return SFT_PREFIX + resolve_path(job, base) + at + steps
        return resolve_path(value, base)
    if key in SOURCE_KEYS:
        if value.startswith(_NOT_FILES):
            return value
        if value.startswith("hf:"):  # a folder saved with save_to_disk, else a hub name
            return "hf:" + resolve_path(value[3:], base, must_exist=True)
        return resolve_path(value, base)
    if key in FOLDER_KEYS:
        return value if ":" in value else resolve_path(value, base)
    return value


def resolve_file_paths(data: dict, base: Path) -> dict:
    """The raw mapping of a job file with every path-valued key resolved against `base` (its directory)."""
    for key in PATH_KEYS:
        *sections, leaf = key.split(".")
        node = data
        for s in sections:
            node = node.get(s) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            node[leaf] = resolve_value(key, node[leaf], base)
    return data
