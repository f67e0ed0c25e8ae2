"""`hpc-rl config show [JOB]`: every key of the job spec with its type, value (the default, or the job's) and
its one-line doc, read from the comment above each field in config.py."""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing

from . import config
from .config import JobConfig, type_name

_FIELD = re.compile(r"^    (\w+): ")


def field_docs(cls: type) -> dict[str, str]:
    """{field: the comment lines right above it in the class body, joined} for one config dataclass."""
    docs, pending = {}, []
    for line in inspect.getsource(cls).splitlines():
        text = line.strip()
        if text.startswith("#"):
            pending.append(text.lstrip("#").strip())
            continue
        m = _FIELD.match(line)
        if m and pending:
            docs[m.group(1)] = " ".join(pending)
        pending = []
    return docs


def rows(cfg: JobConfig | None = None) -> list[tuple[str, str, str, str]]:
    """(dotted key, type, value, doc) for every leaf key, section by section."""
    out: list[tuple[str, str, str, str]] = []

    def walk(obj, cls: type, prefix: str) -> None:
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        for f in dataclasses.fields(cls):
            key, value, tp = f"{prefix}{f.name}", getattr(obj, f.name), hints[f.name]
            if dataclasses.is_dataclass(tp) and value is not None:
                walk(value, tp, key + ".")
                continue
            nested = next((a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)), None)
            if nested is not None:  # an optional section (model.tiny): its keys, with their defaults
                walk(nested(), nested, key + ".")
                continue
            out.append((key, type_name(tp), _show(value), docs.get(f.name, "")))

    walk(cfg if cfg is not None else JobConfig(), JobConfig, "")
    return out


def _show(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def show_config(job: str | None = None, overrides: list[str] | None = None) -> int:
    """Print every key (with the job's values when a job is given) as aligned columns; returns 0."""
    cfg = config.load(job, overrides) if job else None
    table = rows(cfg)
    defaults = {key: value for key, _, value, _ in rows()} if cfg is not None else {}
    wk = max(len(r[0]) for r in table)
    wv = min(24, max(len(r[2]) for r in table))
    if cfg is not None:
        print(f"# {job}: a value that differs from the default shows the default first, in brackets")
    section = None
    for key, tp, value, doc in table:
        head = key.split(".")[0] if "." in key else ""
        if head != section:
            section = head
            print(f"\n# {head or 'top level'}")
        differs = f"[default {defaults[key]}] " if key in defaults and defaults[key] != value else ""
        print(f"{key:<{wk}}  {value:<{wv}}  {differs}{doc}  [{tp}]")
    return 0
