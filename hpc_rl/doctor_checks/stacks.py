"""The pinned stacks of envs/stacks/*.env (shared with install.sh): torch / DeepSpeed / vLLM per CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

STACKS_DIR = REPO / "envs" / "stacks"


def load_stack(name: str, stacks_dir: Path = STACKS_DIR) -> dict:
    """KEY=VALUE lines of envs/stacks/NAME.env as a dict (quotes stripped, comments skipped)."""
    out = {}
    for line in (stacks_dir / f"{name}.env").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, value = line.split("=", 1)
        out[key.strip()] = value.strip().strip('"').strip("'")
    return out


def all_stacks(stacks_dir: Path = STACKS_DIR) -> dict[str, dict]:
    return {p.stem: load_stack(p.stem, stacks_dir) for p in sorted(stacks_dir.glob("*.env"))}


def read_lock(prefix: str | None = None) -> dict:
    """The `# key: value` header of PREFIX/install-lock.txt (empty when the env was not made by install.sh)."""
    path = Path(prefix or sys.prefix) / "install-lock.txt"
    out = {}
    try:
        for line in path.read_text().splitlines():
            if line.startswith("# ") and ": " in line:
                k, v = line[2:].split(": ", 1)
                out[k.strip()] = v.strip()
    except OSError:
        pass
    return out
