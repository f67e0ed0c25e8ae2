"""The start-up clock: phases are seconds since the launcher marked the command's start, inherited by the processes
it starts; without a launcher's mark nothing is recorded."""

import subprocess
import sys

from hpc_rl import startup_clock
from hpc_rl.startup_clock import ENV, Phases


def test_phases_count_from_the_launchers_mark(monkeypatch):
    monkeypatch.setenv(ENV, "100.0")
    monkeypatch.setattr(startup_clock.time, "time", lambda: 102.5)
    p = Phases()
    p.mark("rank up")
    monkeypatch.setattr(startup_clock.time, "time", lambda: 104.25)
    p.mark("engines built")
    assert p.line() == "rank up 2.50s, engines built 4.25s"


def test_no_clock_without_a_launcher_and_a_bad_value_is_ignored(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    p = Phases()
    p.mark("rank up")
    assert p.t0 is None and p.line() == ""
    monkeypatch.setenv(ENV, "soon")
    assert Phases().t0 is None


def test_a_child_process_inherits_the_mark(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    startup_clock.mark_command_start()
    out = subprocess.run([sys.executable, "-c", "from hpc_rl.startup_clock import PHASES; PHASES.mark('up'); "
                          "print(PHASES.line())"], capture_output=True, text=True, check=True).stdout
    name, secs = out.split()
    assert name == "up" and 0 < float(secs.rstrip("s")) < 60
