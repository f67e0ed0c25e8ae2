"""How the suite runs on two pytest-xdist workers (pyproject's addopts: `-n 2 --dist loadscope`).

Each test module is one unit of work, so a module-scoped fixture (a shared run, a vLLM server) is made once, on one
worker. The modules on the local Slurm cluster (named `*slurm*`) are one unit together: the cluster is machine-wide (its
namespaces, addresses and /etc/hosts names), so only one worker may start it. Units start longest first (seconds
from tests/durations.json, measured on the 2-core CI machine kind; a module it does not know counts by its markers), so
that the long Slurm unit, whose jobs spend much of their time waiting on the scheduler, requeues and timeouts, runs
beside the local end-to-end runs and no long unit is left alone at the end. The order only decides which worker runs
what and when; it does not change what a test checks.

xdist's own `xdist_group` mark cannot do this here: it renames `item._nodeid`, which pytest 9.2 no longer reads.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
SLURM_GROUP = "slurm"
# A module missing from durations.json: a guess per test by its markers.
GUESS_S = {"slurm": 60.0, "vllm": 30.0, "slow": 30.0}
GUESS_FAST_S = 0.5


def group_of_nodeid(nodeid: str) -> str:
    """The unit of work of a test id: "slurm" for the Slurm modules, else its module's path."""
    module = nodeid.split("::", 1)[0]
    return SLURM_GROUP if "slurm" in Path(module).name else module


def check_slurm_naming(item: pytest.Item) -> None:
    """A test on the local cluster in a module whose name lacks "slurm" would start a second cluster on the other
    worker (which then waits for the first one's lock): refuse it at collection, naming the fix."""
    if "slurm_cluster" in getattr(item, "fixturenames", ()) and group_of_nodeid(item.nodeid) != SLURM_GROUP:
        raise pytest.UsageError(f"{item.nodeid} uses the slurm_cluster fixture: put it in a module whose name contains "
                                "'slurm' (tests/scheduling.py runs those on one xdist worker)")


def _guess(item: pytest.Item) -> float:
    for name, seconds in GUESS_S.items():
        if item.get_closest_marker(name) is not None:
            return seconds
    return GUESS_FAST_S


def order_by_cost(items: list[pytest.Item]) -> None:
    """Sort the items so that the costliest units come first (in place; a stable sort, so tests keep their order
    inside a unit). The workers' collection order is the order in which units are handed out."""
    known = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    guessed: dict[str, float] = {}
    for item in items:
        check_slurm_naming(item)
        g = group_of_nodeid(item.nodeid)
        guessed[g] = guessed.get(g, 0.0) + _guess(item)
    cost = {g: float(known.get(g, s)) for g, s in guessed.items()}
    items.sort(key=lambda it: -cost[group_of_nodeid(it.nodeid)])


def make_scheduler(config, log):
    """xdist's scope scheduling with our units (a module, or all Slurm modules together), in collection order."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of_nodeid(nodeid)

    return ModuleScheduling(config, log)


@contextlib.contextmanager
def solo_or_shared(solo: bool):
    """While a test marked `solo` runs, the other worker runs no test: for the few tests whose result depends on
    timing (the multi-turn toy's samples follow which tool calls finish first). Every test holds the run's lock
    shared, a solo test holds it alone; a gate taken first keeps a waiting solo test from being starved by the
    other worker's stream of shared holders. Outside xdist there is nothing to share."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        yield
        return
    base = lock_base(os.getppid())  # the controller, which removes the files at its end (remove_locks)
    with open(f"{base}.gate", "a") as gate, open(f"{base}.lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if solo else fcntl.LOCK_SH)
        if not solo:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)


def lock_base(controller_pid: int) -> Path:
    """The prefix of the two lock files of the test session whose xdist controller is `controller_pid`."""
    return Path(tempfile.gettempdir()) / f"hpc-rl-tests-{controller_pid}"


def remove_locks() -> None:
    """In the controller at the session's end: its workers' lock files."""
    for suffix in (".gate", ".lock"):
        Path(f"{lock_base(os.getpid())}{suffix}").unlink(missing_ok=True)
