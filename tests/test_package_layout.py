"""The package layout's import rules: no import circle anywhere in hpc_rl/; nothing outside cluster/ imports cluster/
except the CLI that dispatches to it; the orchestrator (what is generated, scored and fed) and the learner (train/)
meet only in RolloutBatch (and in loop.py, which drives both); the rollout server and the trainer side stay apart;
small modules."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "hpc_rl"


def _runtime_nodes(tree: ast.AST):
    """Every node of the tree except those under `if TYPE_CHECKING:` (annotations only: never imported at run time)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _imported_modules(path: Path, pkg: Path = PKG) -> set[str]:
    """Absolute names of the modules a file of package `pkg` imports at run time, at any depth (lazy imports
    included, `if TYPE_CHECKING:` blocks not)."""
    parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
    package = parts[:-1] if parts[-1] != "__init__" else parts
    out: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
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


def _module_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a `from pkg import name` counts as pkg, or pkg.name if a module)."""
    files = {}
    for path in pkg.rglob("*.py"):
        parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for mod, path in files.items():
        deps = set()
        for name in _imported_modules(path, pkg):
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != mod:
                deps.add(name)
        graph[mod] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_circle_anywhere():
    assert _cycles(_module_graph()) == []


def test_the_cycle_finder_finds_a_circle_through_a_lazy_import(tmp_path):
    pkg = tmp_path / "hpc_rl"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from . import y\n")
    (pkg / "a" / "y.py").write_text("def f():\n    from .x import g\n")
    (pkg / "z.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n")
    assert _cycles(_module_graph(pkg)) == [["hpc_rl.a.x", "hpc_rl.a.y"]]


def test_the_orchestrator_and_the_learner_meet_only_in_the_rollout_batch():
    """orchestrator/ never imports train/ (nor the loop that drives both); train/ takes RolloutBatch from the
    orchestrator and nothing else."""
    offenders = []
    for side, forbidden, allowed in (("orchestrator", ("hpc_rl.train", "hpc_rl.loop"), ()),
                                     ("train", ("hpc_rl.orchestrator", "hpc_rl.loop"), ("hpc_rl.orchestrator.batch",))):
        for path in sorted((PKG / side).rglob("*.py")):
            bad = sorted(m for m in _imported_modules(path) for f in forbidden
                         if (m == f or m.startswith(f + ".")) and not any(m == a or m.startswith(a + ".")
                                                                          for a in allowed))
            if bad:
                offenders.append(f"{path.relative_to(PKG)}: {', '.join(bad)}")
    assert not offenders, "imports across the orchestrator and the learner:\n" + "\n".join(offenders)


def test_modules_stay_small():
    """A module of more than 700 lines does more than one job: split it by job."""
    big = sorted(f"{p.relative_to(PKG)}: {n} lines" for p in PKG.rglob("*.py")
                 if (n := len(p.read_text().splitlines())) > 700)
    assert not big, big
