"""CPU threads of unpinned trainer ranks and rollout servers: every core for each phase of a synchronous step;
when generation runs ahead (they compute at once), the ranks keep every core and the server gets half."""

import pytest

from hpc_rl import config, launch


@pytest.mark.parametrize(("cores", "async_steps", "ranks", "per_rank", "server"), [
    (8, 0, 2, 4, 8),
    (8, 1, 2, 4, 4),
    (2, 0, 2, 1, 2),
    (2, 2, 1, 2, 1),
    (1, 1, 1, 1, 1),
])
def test_cpu_threads(monkeypatch, cores, async_steps, ranks, per_rank, server):
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda _pid: set(range(cores)))
    cfg = config.load_dict({"model": {"path": "m"}, "rollout": {"async_steps": async_steps}})
    assert launch.cpu_threads(cfg, ranks, "trainer") == per_rank
    assert launch.cpu_threads(cfg, 1, "rollout") == server


def test_pinned_processes_share_their_cores():
    cfg = config.load_dict({"model": {"path": "m"}, "rollout": {"async_steps": 1}})
    assert launch.cpu_threads(cfg, 2, "trainer", [0, 1, 2, 3]) == 2
    assert launch.cpu_threads(cfg, 1, "rollout", [5]) == 1
    assert launch.cpu_threads(cfg, 1, "rollout", [4, 5]) == 2  # pinned: not halved in async mode
