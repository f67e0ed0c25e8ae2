"""The package layout's one import rule (DESIGN.md "Layout"): nothing outside cluster/ imports cluster/, except
the CLI that dispatches to it, so the Slurm side never sits in an import circle with runs, plots or tracking."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "hpc_rl"


def _imported_modules(path: Path, pkg: Path = PKG) -> set[str]:
    """Absolute names of the modules a file of package `pkg` imports, at any depth (lazy imports included)."""
    parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
    package = parts[:-1] if parts[-1] != "__init__" else parts
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def test_nothing_outside_cluster_imports_cluster_except_the_cli():
    offenders = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if rel.parts[0] == "cluster" or rel == Path("cli.py"):
            continue
        bad = sorted(m for m in _imported_modules(path) if m == "hpc_rl.cluster" or m.startswith("hpc_rl.cluster."))
        if bad:
            offenders.append(f"{rel}: {', '.join(bad)}")
    assert not offenders, "modules outside cluster/ import it:\n" + "\n".join(offenders)


def test_the_import_scan_sees_relative_and_lazy_imports(tmp_path):
    """The scan itself: a lazy relative import of cluster/ from a nested module is found (else the rule proves nothing)."""
    path = tmp_path / "hpc_rl" / "rollout" / "probe.py"
    path.parent.mkdir(parents=True)
    path.write_text("def f():\n    from ..cluster.sweep import load_sweep\n    from . import client\n")
    assert _imported_modules(path, tmp_path / "hpc_rl") == {
        "hpc_rl.cluster.sweep", "hpc_rl.cluster.sweep.load_sweep", "hpc_rl.rollout", "hpc_rl.rollout.client"}


def _rollout_offenders(side: str, forbidden: tuple[str, ...]) -> list[str]:
    out = []
    for path in sorted((PKG / "rollout" / side).rglob("*.py")):
        bad = sorted(m for m in _imported_modules(path) for f in forbidden if m == f or m.startswith(f + "."))
        if bad:
            out.append(f"{path.relative_to(PKG)}: {', '.join(bad)}")
    return out


def test_the_rollout_server_side_and_the_trainer_side_are_apart():
    """rollout/server/ never imports the trainer side (client/, environments/) nor the trainer (train/); the trainer
    side never imports server/; wire/ (the formats both share) imports neither side."""
    trainer_side = ("hpc_rl.rollout.client", "hpc_rl.rollout.environments")
    offenders = (_rollout_offenders("server", (*trainer_side, "hpc_rl.train"))
                 + _rollout_offenders("client", ("hpc_rl.rollout.server",))
                 + _rollout_offenders("environments", ("hpc_rl.rollout.server",))
                 + _rollout_offenders("wire", ("hpc_rl.rollout.server", *trainer_side)))
    assert not offenders, "imports across the rollout sides:\n" + "\n".join(offenders)
