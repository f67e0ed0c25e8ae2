"""A sweep on the real 3-node Slurm cluster (tests/cluster/up.sh): 2 KL values x 2 seeds of the CPU toy,
one node each, `max_parallel: 2`, as ONE job array; the throttle holds; one point fails on purpose
after its step-3 checkpoint, `sweep status` shows it FAILED with its log, `resubmit --failed` resumes
it from that checkpoint; `plot` and `export` work on the sweep and its points."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster.helpers import REPO, hpc_rl  # noqa: E402,F401

from hpc_rl.metrics import read_metrics  # noqa: E402
from hpc_rl.rundir import read_json  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS, CKPT = 6, 3
# The planted fault: tests.test_sweep:flaky_reward raises once it has scored this many samples of a run
# whose run dir holds FAIL_AFTER (8 prompts x group 8 = 64 samples a step: 3 steps, then step 4 fails).
FAIL_CALLS = 3 * 64


class SqueueWatch(threading.Thread):
    """Polls squeue for the array's RUNNING elements; remembers the most seen at once."""

    def __init__(self, array_id: str):
        super().__init__(daemon=True)
        self.array_id, self.max_running, self.samples, self.stop = array_id, 0, 0, threading.Event()

    def run(self):
        while not self.stop.is_set():
            p = subprocess.run(["squeue", "-h", "-r", "-j", self.array_id, "-t", "RUNNING", "-o", "%i"],
                               capture_output=True, text=True, timeout=30)
            if p.returncode == 0:
                self.max_running = max(self.max_running, len(p.stdout.split()))
                self.samples += 1
            self.stop.wait(0.5)


def _sweep_status(root: Path) -> dict:
    return json.loads(hpc_rl("sweep", "status", str(root), "--json", timeout=120).stdout)


def _wait_all_ended(root: Path, timeout_s: float) -> dict:
    """`sweep status --follow` returns once every point ended (its rich progress goes to stdout)."""
    p = hpc_rl("sweep", "status", str(root), "--follow", timeout=timeout_s)
    assert "points ended" in p.stdout, p.stdout[-2000:]
    return _sweep_status(root)


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_sweep_as_throttled_job_array_with_failure_resubmit_plot_export(slurm_cluster, tmp_path):
    """~120 s on 2 cores: four points of a job array, two at a time (the throttle), one failing and resubmitted,
    each a short run on the cluster; the tracking, plot and export checks read the same sweep."""
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(f"""
name: kl-test
base: {REPO / 'jobs' / 'toy-grpo-cpu.yaml'}
overrides: [rollout.nodes=0, trainer.steps={STEPS}, checkpoint.every={CKPT}, trainer.prompts_per_step=8,
            trainer.mini_batch_size=32, "reward.function=tests.test_sweep:flaky_reward", slurm.time=00:20:00,
            logging.wandb.mode=offline, logging.mlflow.experiment=kl-sweep]
grid:
  algorithm.kl.coef: [0.0, 0.05]
seeds: [1, 2]
max_parallel: 2
output_dir: {tmp_path / 'sweeps'}
""")
    dry = hpc_rl("sweep", str(sweep_file), "--dry-run").stdout
    assert "#SBATCH --array=0-3%2" in dry and "algorithm.kl.coef=0.05 seed=2" in dry

    t0 = time.monotonic()
    out = hpc_rl("sweep", str(sweep_file), timeout=600).stdout
    root = Path(next(ln for ln in out.splitlines() if ln.startswith("sweep dir: ")).split(": ", 1)[1])
    state = read_json(root / "sweep.json")
    array_id = state["submissions"][0]["array_job_id"]
    assert f"job array {array_id}" in out
    points = state["points"]
    assert [p["overrides"] for p in points] == [{"algorithm.kl.coef": k, "seed": s} for k in (0.0, 0.05)
                                                for s in (1, 2)]
    # Point 3 cannot start before one of 0/1 ends (throttle 2): plant its fault now.
    bad = Path(points[3]["run_dir"])
    (bad / "FAIL_AFTER").write_text(str(FAIL_CALLS))
    watch = SqueueWatch(array_id)
    watch.start()
    try:
        info = _wait_all_ended(root, 1500)
    finally:
        watch.stop.set()
        watch.join(10)
    wall = time.monotonic() - t0
    table = hpc_rl("sweep", "status", str(root)).stdout
    print(f"\nsweep of 4 points (max_parallel 2) ended after {wall:.0f}s\n{table}")

    assert watch.samples > 10 and 1 <= watch.max_running <= 2, (watch.max_running, watch.samples)
    script = (root / "submitit" / f"{array_id}_submission.sh").read_text()
    assert "#SBATCH --array=0-3%2" in script
    states = {p["index"]: p["state"] for p in info["points"]}
    assert states == {0: "COMPLETED", 1: "COMPLETED", 2: "COMPLETED", 3: "FAILED"}, table
    for p in info["points"][:3]:
        assert p["job_id"] == f"{array_id}_{p['index']}" and p["step"] == STEPS
        assert isinstance(p["reward_last"], float) and p["reward_best"] >= p["reward_last"]
    failed = info["points"][3]
    assert failed["step"] == CKPT and failed["log_tail"], failed
    assert "FAILED" in table and "planted fault" in table  # the last log lines name the cause
    assert (bad / "checkpoints" / f"step_{CKPT}").is_dir()

    # Resubmit just the failed point: a new (one-element) submission that resumes from step 3.
    (bad / "FAIL_AFTER").unlink()
    out = hpc_rl("sweep", "resubmit", str(root), "--failed", timeout=300).stdout
    assert "resubmitted point(s) 3 " in out, out
    t1 = time.monotonic()
    info = _wait_all_ended(root, 900)
    print(f"resubmit of point 3 ended after {time.monotonic() - t1:.0f}s\n"
          + hpc_rl("sweep", "status", str(root)).stdout)
    assert [p["state"] for p in info["points"]] == ["COMPLETED"] * 4, info
    assert info["points"][3]["attempts"] == 2 and len(info["arrays"]) == 2
    assert "resumed from" in (bad / "logs" / "trainer-0.log").read_text()
    assert [r["step"] for r in read_metrics(bad / "metrics.jsonl")] == list(range(1, STEPS + 1))
    assert hpc_rl("sweep", "resubmit", str(root), "--failed").stdout.startswith("sweep kl-test: no failed point")
    # A point's dir is an ordinary run dir: `hpc-rl status/logs` show both attempts through its submitit/ links.
    new_id = info["points"][3]["job_id"]
    assert json.loads(hpc_rl("status", str(bad), "--json").stdout)["state"] == "COMPLETED"
    logs = hpc_rl("logs", str(bad)).stdout
    assert f"==> submitit/{array_id}_3_0_log.err <==" in logs and f"==> submitit/{new_id}_0_log.out <==" in logs
    assert "planted fault" in logs and "resumed from" in logs

    # Tracking: each point one W&B run (offline, in its run dir) grouped by the sweep, its overrides in the config;
    # all in one MLflow experiment of the sweep's store; the resubmitted point continued its tracked runs.
    from hpc_rl import tracking

    for p in points:
        run_dir = Path(p["run_dir"])
        ids = json.loads((run_dir / "tracking.json").read_text())
        dirs = tracking.wandb_run_dirs(run_dir, ids["wandb"]["id"])
        assert len(dirs) == (2 if p["index"] == 3 else 1), dirs
        rec = tracking.wandb_run_record(dirs[-1])
        assert rec["group"] == root.name and rec["config"]["sweep"]["overrides"] == p["overrides"], rec
        assert rec["config"]["algorithm"]["kl"]["coef"] == p["overrides"]["algorithm.kl.coef"]
        assert [h["_step"] for d in dirs for h in tracking.wandb_history(d)] == list(range(1, STEPS + 1))
        assert ids["mlflow"]["tracking_uri"] == (root / "mlruns").as_uri()
    client = tracking.mlflow_client((root / "mlruns").as_uri())
    exp = client.get_experiment_by_name("kl-sweep")
    runs = client.search_runs([exp.experiment_id])
    assert sorted(r.info.run_name for r in runs) == sorted(Path(p["run_dir"]).name for p in points)
    assert {r.data.tags["sweep"] for r in runs} == {root.name} and {r.info.status for r in runs} == {"FINISHED"}
    resumed = client.get_run(json.loads((bad / "tracking.json").read_text())["mlflow"]["run_id"])
    assert sorted(m.step for m in client.get_metric_history(resumed.info.run_id, "reward_mean")) == \
        list(range(1, STEPS + 1))
    assert resumed.data.params["algorithm.kl.coef"] == "0.05" and resumed.data.params["seed"] == "2"
    dry = hpc_rl("sync", str(root), "--dry-run").stdout
    assert dry.count("would sync ") == 5 and dry.count("MLflow file store") == 1, dry

    # Plot of the sweep: one line per point, legend naming the overrides.
    png = Path(hpc_rl("plot", str(root)).stdout.strip().splitlines()[-1])
    assert png == root / "plots" / "curves.png" and _png_size(png) == (1300, 600)
    from PIL import Image

    meta = json.loads(Image.open(png).text["Description"])
    assert meta["runs"] == [f"{p['index']}: {p['label']}" for p in state["points"]]

    # Export a point's latest checkpoint: transformers loads it and it generates.
    dest = tmp_path / "export"
    hpc_rl("export", points[0]["run_dir"], str(dest))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(dest)
    tok = AutoTokenizer.from_pretrained(dest)
    ids = tok("copy 7 :", return_tensors="pt").input_ids
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert gen.shape[1] > ids.shape[1]
