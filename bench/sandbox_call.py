"""Per-call cost of the python tool's sandbox: an empty program (`pass`) run N times each way, sides alternating
(A B C A B C):

  sandbox call      run_python through the started sandbox (a fork of the zygote per call: fresh PID, mount and
                    IPC namespaces, tmpfs /tmp, seccomp, rlimits, pids cgroup where one can be made)
  process per call  what a call cost before the zygote, at least: `unshare` (user, network, PID, mount, IPC
                    namespaces) and a fresh `python -I` per call (the old path also ran a mount setup on top)
  plain python      `python -I -c pass` as a subprocess, no sandbox: the reference the ratios are against

Also: the sandbox's start (the first call of a fresh Sandbox), and 4 calls at once from 4 threads (per call).
Goal (issue 27): a sandbox call of an empty program at most 30 ms.
  python bench/sandbox_call.py            # 50 calls per side, 3 rounds
  python bench/sandbox_call.py --quick    # 10 calls, 1 round
Writes bench/results/sandbox_call.json; the last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import machine, table, write_result  # noqa: E402

from hpc_rl.rollout.environments.sandbox import NAMESPACE_FLAGS, Sandbox, SandboxLimits  # noqa: E402

LIMITS = SandboxLimits(wall_s=30)


def time_calls(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.calls, args.rounds = 10, 1
    load_before = machine()["load_avg"]
    t0 = time.perf_counter()
    sb = Sandbox([])
    first = sb.run("pass", LIMITS)
    start_s = time.perf_counter() - t0
    assert first.ok, first.output

    def sandbox_call():
        r = sb.run("pass", LIMITS)
        assert r.ok, r.output

    unshare = [shutil.which("unshare"), *NAMESPACE_FLAGS, sys.executable, "-I", "-c", "pass"]
    sides = {"sandbox call": sandbox_call,
             "process per call": lambda: subprocess.run(unshare, check=True, capture_output=True),
             "plain python": lambda: subprocess.run([sys.executable, "-I", "-c", "pass"], check=True,
                                                    capture_output=True)}
    samples: dict[str, list[float]] = {s: [] for s in sides}
    for _ in range(args.rounds):
        for side, fn in sides.items():
            samples[side] += time_calls(fn, args.calls)
    concurrent: list[float] = []

    def worker():
        concurrent.extend(time_calls(sandbox_call, args.calls // 2 or 1))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    t1 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall4 = time.perf_counter() - t1
    sb.close()
    med = {s: statistics.median(v) for s, v in samples.items()}
    ref = med["plain python"]
    rows = [[s, f"{med[s] * 1000:.1f}", f"{min(v) * 1000:.1f}", f"{max(v) * 1000:.1f}", f"{med[s] / ref:.2f}"]
            for s, v in samples.items()]
    print(table(["side", "median ms", "min ms", "max ms", "x plain python"], rows))
    print(f"sandbox start (first call): {start_s * 1000:.0f} ms; 4 threads: {len(concurrent)} calls in "
          f"{wall4:.2f} s ({wall4 / len(concurrent) * 1000:.1f} ms per call of wall time)")
    result = {"machine": machine(), "load_avg_before": load_before, "calls": args.calls, "rounds": args.rounds,
              "median_ms": {s: v * 1000 for s, v in med.items()},
              "ratios_vs_plain_python": {s: v / ref for s, v in med.items()},
              "start_ms": start_s * 1000, "concurrent_4_threads_ms_per_call": wall4 / len(concurrent) * 1000}
    write_result("sandbox_call", result)
    print(json.dumps({"median_ms": result["median_ms"], "ratios_vs_plain_python": result["ratios_vs_plain_python"]}))


if __name__ == "__main__":
    main()
