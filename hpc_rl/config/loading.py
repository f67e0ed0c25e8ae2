"""Job specs from YAML: typed dataclasses built from mappings (every value checked against its annotation, unknown
keys named with their closest valid spelling), dotted CLI overrides, validation, and the resolved YAML back."""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from ..errors import ConfigError, first_line
from .job import JobConfig, validate
from .paths import PATH_KEYS, resolve_file_paths, resolve_value


def type_name(tp: Any) -> str:
    """How a config type reads in messages and `hpc-rl config show` ("an integer or null")."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(type_name(a) for a in args) + " or null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false",
            list: "a list", dict: "a mapping"}.get(tp, getattr(tp, "__name__", str(tp)))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`; returns the converted value or raises ConfigError."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        for arg in args[:-1]:  # int | str: the first type the value is
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
        return _coerce(value, args[-1], key)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices and type(value) is type(choices[choices.index(value)]):
            return value
        hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        extra = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(f"{key}: {value!r} is not valid; use {type_name(tp)}{extra}")
    if dataclasses.is_dataclass(tp):
        if value is None:  # an empty YAML section (`algorithm:` with all keys commented out): the defaults
            return tp()
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of settings, got {type(value).__name__} {value!r}")
        return _build(tp, value, key)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            # YAML 1.1 reads "1e-6" as a string; accept numeric strings for floats only.
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                raise ConfigError(f"{key}: {value!r} is not a finite number; give a finite value")
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    elif tp is list:
        if isinstance(value, list):
            return value
    elif tp is dict:
        if isinstance(value, dict):
            return value
    else:  # pragma: no cover - a field type this loader does not know is a bug
        raise TypeError(f"unsupported config field type {tp!r} at {key}")
    raise ConfigError(f"{key}: expected {type_name(tp)}, got {type(value).__name__} {value!r}")


# Keys that no longer exist, and what replaces them.
RENAMED = {
    "rollout.max_policy_lag": "replaced by rollout.async_steps (the one bound on how many policy versions a sample "
                              "may lag; 0 = strictly on-policy); remove the key or set rollout.async_steps",
}


# Keys renamed with the same meaning (near enough): read under the new name with a warning, so that the resolved
# job.yaml of a run written by an earlier version still loads (a resume, an offline evaluation, a requeue).
MIGRATED = {
    # now counts optimizer steps skipped in a row rather than RL steps with a skip
    "trainer.max_nonfinite_steps": "max_skipped_in_a_row",
}


def _build(cls: type, data: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if dotted in RENAMED:
            raise ConfigError(f"{dotted}: {RENAMED[dotted]}")
        if dotted in MIGRATED:
            new = MIGRATED[dotted]
            if new in data:
                raise ConfigError(f"{dotted}: renamed {prefix}.{new}, which is also given; remove {dotted}")
            logging.getLogger("hpc_rl").warning("%s is now %s.%s; read as that (rename it in the job file)",
                                                dotted, prefix, new)
            key, dotted = new, f"{prefix}.{new}"
        if key not in names:
            hint = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            fix = f"did you mean '{(prefix + '.') if prefix else ''}{hint[0]}'?" if hint else \
                f"valid keys here: {', '.join(names)}"
            raise ConfigError(f"{dotted}: unknown key; {fix}")
        kwargs[key] = _coerce(value, hints[key], dotted)
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict:
    """The resolved config as plain data (what is written to the run dir as job.yaml)."""
    return dataclasses.asdict(cfg)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`trainer.lr=1e-6` -> (['trainer', 'lr'], 1e-6); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY=VALUE with a dotted key, e.g. trainer.lr=1e-6")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: the key is empty; use a dotted key such as trainer.lr=1e-6")
    try:
        value = yaml.safe_load(raw) if raw.strip() != "" else None
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def resolve_override(text: str, base: Path) -> str:
    """A dotted override `KEY=VALUE` whose path value is resolved against `base` (JSON is YAML: the value reads back
    as the same string); other overrides as they are."""
    if "=" not in text:
        return text  # parse_override's error comes when the overrides are applied
    path, value = parse_override(text)
    key = ".".join(path)
    if key not in PATH_KEYS:
        return text
    resolved = resolve_value(key, value, base)
    return text if resolved == value else f"{key}={json.dumps(resolved)}"


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply dotted `key=value` overrides to a raw (not yet validated) config mapping."""
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for i, part in enumerate(path[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {text!r}: {'.'.join(path[:i + 1])} is not a section")
            node = nxt
        node[path[-1]] = value
    return data


def load_dict(data: dict, overrides: list[str] | None = None) -> JobConfig:
    """Build and validate a JobConfig from a raw mapping plus dotted overrides."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"job spec: the top level must be a mapping of sections, got {type(data).__name__}")
    data = apply_overrides(data, list(overrides or []))
    cfg = _build(JobConfig, data, "")
    return validate(cfg)


def load(path: str | Path, overrides: list[str] | None = None, overrides_base: Path | None = None) -> JobConfig:
    """Load a job spec YAML file, apply dotted overrides, validate; ConfigError on any problem.

    The file's relative paths resolve against its own directory, the overrides' against `overrides_base` (default:
    the current directory, where a shell's overrides are typed); config/paths.py says how."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{path}: job spec not found; pass the path of a YAML file such as jobs/toy-grpo-cpu.yaml")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; save the job spec as UTF-8 YAML") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or first_line(e)
        raise ConfigError(f"{path}:{where}: invalid YAML ({problem}); fix the syntax there") from None
    if isinstance(data, dict) and "base" in data and ("grid" in data or "list" in data):
        raise ConfigError(f"{path}: this is a sweep file (base + grid/list), not a job spec: run it with "
                          f"`hpc-rl sweep {path}`, or pass its base job spec ({data['base']})")
    if isinstance(data, dict):
        data = resolve_file_paths(data, p.resolve().parent)
    base = Path(overrides_base) if overrides_base is not None else Path.cwd()
    return load_dict(data, [resolve_override(o, base) for o in overrides or []])


def dump(cfg: JobConfig) -> str:
    """YAML text of the fully resolved config."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
