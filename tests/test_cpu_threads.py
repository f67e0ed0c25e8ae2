"""CPU threads of unpinned trainer ranks and rollout servers: every core for each phase of a synchronous step;
when generation runs ahead (they compute at once), the ranks keep every core and the server gets half. And how the
launcher stops its processes."""

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


def test_stop_processes_ends_a_stopped_process_with_its_sigterm():
    """A SIGSTOPped server (hung node, debugger) gets SIGCONT with its SIGTERM: it exits by the SIGTERM, not by the
    SIGKILL that follows the grace period."""
    import signal
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        p.send_signal(signal.SIGSTOP)
        launch.stop_processes([p], grace_s=20)
        assert p.returncode == -signal.SIGTERM
    finally:
        if p.poll() is None:
            p.kill()
