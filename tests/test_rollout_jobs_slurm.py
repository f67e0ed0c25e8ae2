"""Elastic rollout capacity on the real local Slurm cluster: rollout servers as Slurm jobs of their own
(`hpc-rl rollout add`) join a running run, leave it (scancel, preemption) and re-join after a requeue; a run with no
servers of its own waits for them; forged registrations change nothing. The toy learns in every case."""

from __future__ import annotations

import http.server
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster.helpers import hpc_rl, metrics_rows, run_logs, status, submitted_run_dir, wait_for  # noqa: E402

from hpc_rl import config  # noqa: E402
from hpc_rl.cluster import slurmq  # noqa: E402
from hpc_rl.data.sampler import indices_for_step  # noqa: E402
from hpc_rl.rundir import read_json  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _learned(rows: list[dict]) -> None:
    """The toy's learning criterion (tests/test_slurm.py): last 5 steps' mean reward >= 0.8, 0.6 above step 1's."""
    rewards = [r["reward_mean"] for r in rows]
    last5 = sum(rewards[-5:]) / 5
    assert last5 >= 0.8 and last5 - rewards[0] >= 0.6, rewards


def _every_step_and_sample(run: Path, steps: int) -> list[dict]:
    """Every step is there, in the data order of an uninterrupted run, trained on samples of its own version."""
    rows = metrics_rows(run)
    cfg = config.load(run / "job.yaml")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert r["prompt_ids"] == indices_for_step(cfg.data.toy_size, cfg.trainer.prompts_per_step, cfg.seed,
                                                   r["step"] - 1)
        assert r["policy_version"] == r["step"]
        # Every generated token is some server's (none lost between servers).
        assert sum(v for k, v in r.items() if k.startswith("server_tokens/")) > 0
    return rows


def _served_by(rows: list[dict], index: int) -> list[int]:
    return [r["step"] for r in rows if r.get(f"server_tokens/{index}", 0) > 0]


def _add(run: Path, *args: str) -> str:
    out = hpc_rl("rollout", "add", str(run), *args, timeout=120).stdout
    m = re.search(r"submitted rollout job (\d+)", out)
    assert m, out
    return m.group(1)


def _servers(run: Path) -> dict[int, dict]:
    return {r["index"]: r for r in json.loads(hpc_rl("rollout", "list", str(run), "--json", timeout=120).stdout)}


def _generating(url: str, token: str) -> bool:
    try:
        m = requests.get(url + "/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=2).json()
    except (requests.RequestException, ValueError):
        return False
    return m.get("generating", 0) >= 1


def test_rollout_jobs_join_leave_and_rejoin_a_running_run(slurm_cluster, tmp_path):
    """~3 min. The run's own rollout node gains a rollout job's server mid-run (both serve, each one's tokens in
    metrics.jsonl, version-correct samples); `scancel` of that job while the servers generate: the run goes on with
    no step or sample lost and logs the leave; a second rollout job, preempted (USR2), drains, requeues itself and
    re-joins; the run completes, learns, and its rollout jobs end with it."""
    steps = 200
    p = hpc_rl("submit", "jobs/toy-grpo-cpu.yaml", f"output_dir={tmp_path}", "trainer.nodes=1", "rollout.nodes=1",
               f"trainer.steps={steps}", "checkpoint.every=0", timeout=300)
    run = submitted_run_dir(p.stdout)
    job_id = read_json(run / "slurm.json")["job_id"]
    token = (run / "token").read_text().strip()
    wait_for(lambda: len(metrics_rows(run)) >= 3, 600, f"job {job_id} to train 3 steps\n{run_logs(run)}")

    # Join: a rollout job's server (index 1, after the run's own 0) takes its share of the samples.
    first = _add(run)
    joined = wait_for(lambda: _served_by(metrics_rows(run), 1), 300,
                      f"rollout job {first}'s server to serve\n{run_logs(run)}")
    assert joined[0] > 3
    servers = _servers(run)
    assert servers[1]["job_id"] == first and servers[1]["rollout_job"] and servers[1]["state"] == "serving"
    assert servers[0]["job_id"] == str(job_id) and not servers[0]["rollout_job"]
    info = status(run)
    assert info["rollout_jobs"] == 1, info
    wait_for(lambda: len(_served_by(metrics_rows(run), 1)) >= 5, 300, "5 steps served by both servers")
    rows = metrics_rows(run)
    before = [r["gen_seconds"] for r in rows if 3 < r["step"] < joined[0] - 2]
    both = [r["gen_seconds"] for r in rows if r["step"] in _served_by(rows, 1)]

    # Leave: scancel while the servers generate.
    url1 = servers[1]["url"]
    wait_for(lambda: _generating(url1, token), 120, "server 1 to be generating", poll_s=0.005)
    cancel = subprocess.run(["scancel", first], capture_output=True, text=True, timeout=60)
    assert cancel.returncode == 0, cancel.stderr
    t_cancel = time.time()
    wait_for(lambda: slurmq.job_state(first) in slurmq.TERMINAL, 120, f"rollout job {first} to end")
    left_at = len(metrics_rows(run))

    # Preemption: a second rollout job (index 2) drains on USR2, requeues itself and re-joins at a new address.
    second = _add(run)
    wait_for(lambda: _served_by(metrics_rows(run), 2), 300, f"rollout job {second}'s server to serve\n{run_logs(run)}")
    url2 = _servers(run)[2]["url"]
    usr2 = subprocess.run(["scancel", "--signal=USR2", second], capture_output=True, text=True, timeout=60)
    assert usr2.returncode == 0, usr2.stderr
    preempted_at = len(metrics_rows(run))
    log2 = run / "logs" / "rollout-2.log"
    wait_for(lambda: "stopping (SIGTERM)" in log2.read_text(), 120, f"server 2 to drain\n{log2.read_text()[-2000:]}")
    back = wait_for(lambda: (s := _servers(run).get(2)) and s["url"] != url2 and s["state"] == "serving" and s, 300,
                    f"rollout job {second} to be requeued and re-join\n{run_logs(run)}")
    assert back["job_id"] == second

    final = wait_for(lambda: (s := status(run))["state"] in slurmq.TERMINAL and s, 900, f"job {job_id} to end", poll_s=3)
    assert final["state"] == "COMPLETED", f"{final}\n{run_logs(run)}"
    rows = _every_step_and_sample(run, steps)
    _learned(rows)
    served2 = _served_by(rows, 2)
    assert any(s > preempted_at + 1 for s in served2), (preempted_at, served2)  # served again after the requeue
    assert not [s for s in _served_by(rows, 1) if s > left_at + 1]  # nothing of the cancelled one after it left
    log0 = (run / "logs" / "trainer-0.log").read_text()
    assert re.search(r"step \d+: rollout server 1 at \S+ joined", log0), log0[-3000:]
    assert re.search(r"step \d+: rollout server 1 at \S+ left", log0), log0[-3000:]
    assert re.search(r"rollout server 2 at \S+ answers; it rejoins", log0), log0[-3000:]
    assert "Traceback" not in log0
    # The rollout jobs end with the run: the cancelled one CANCELLED, the requeued one COMPLETED.
    wait_for(lambda: slurmq.job_state(second) in slurmq.TERMINAL, 120, f"rollout job {second} to end with the run")
    assert slurmq.job_state(second) == "COMPLETED"
    assert status(run)["rollout_jobs"] == 0
    listed = _servers(run)
    assert listed[1]["state"].startswith("gone") and listed[2]["state"].startswith("gone"), listed
    print(f"\ngeneration seconds per step: {sum(before) / max(1, len(before)):.3f} with the run's server alone, "
          f"{sum(both) / max(1, len(both)):.3f} with a rollout job's server too (one 2-core machine shared by all "
          f"nodes); scancel -> run end {time.time() - t_cancel:.0f}s")


class _Refuses(http.server.BaseHTTPRequestHandler):
    """A server of another run: every request without its token gets 401."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(401)
        self.end_headers()

    do_POST = do_GET

    def log_message(self, *args):
        pass


def test_a_run_without_servers_of_its_own_waits_for_a_rollout_job_and_learns(slurm_cluster, tmp_path):
    """~1.5 min. rollout.nodes 0, rollout.servers_per_node 0: the trainer waits (saying so) for a rollout job;
    forged registrations written meanwhile (garbage JSON, an address nobody answers at, a server that refuses the
    run's token) are ignored with a warning and get no work; the run learns and completes (trainer.stop_at)."""
    refuser = http.server.ThreadingHTTPServer(("0.0.0.0", 0), _Refuses)
    threading.Thread(target=refuser.serve_forever, daemon=True).start()
    try:
        p = hpc_rl("submit", "jobs/toy-grpo-cpu.yaml", f"output_dir={tmp_path}", "trainer.nodes=1", "rollout.nodes=0",
                   "rollout.servers_per_node=0", "trainer.stop_at={reward_mean: 0.8}", timeout=300)
        run = submitted_run_dir(p.stdout)
        job_id = read_json(run / "slurm.json")["job_id"]
        log0 = run / "logs" / "trainer-0.log"
        wait_for(lambda: log0.is_file() and "waiting for rollout servers" in log0.read_text(), 600,
                 f"the trainer to wait for rollout jobs\n{run_logs(run)}")
        rdv = run / "rendezvous"
        (rdv / "rollout-90.json").write_text("{not json")
        (rdv / "rollout-91.json").write_text(json.dumps({"index": 91, "url": "http://10.77.0.250:9"}))
        (rdv / "rollout-92.json").write_text(json.dumps({"index": 92,
                                                         "url": f"http://10.77.0.1:{refuser.server_address[1]}"}))
        rollout_job = _add(run)
        final = wait_for(lambda: (s := status(run))["state"] in slurmq.TERMINAL and s, 900, f"job {job_id} to end",
                         poll_s=3)
        assert final["state"] == "COMPLETED", f"{final}\n{run_logs(run)}"
    finally:
        refuser.shutdown()
    steps = len(metrics_rows(run))  # where trainer.stop_at ended it, once it learned
    assert 5 <= steps <= config.load(run / "job.yaml").trainer.steps
    rows = _every_step_and_sample(run, steps)
    _learned(rows)
    assert {k for r in rows for k in r if k.startswith("server_tokens/")} == {"server_tokens/0"}
    text = log0.read_text()
    assert "rollout-90.json: it does not parse as JSON" in text
    assert re.search(r"rollout server 91 at http://10.77.0.250:9 is registered but does not answer", text), text
    assert re.search(r"rollout server 92 at \S+ is registered but does not answer /health with this run's token "
                     r"\(HTTP 401", text), text
    assert re.search(r"rollout server\(s\) http://10\.77\.0\.\d+:\d+ answer; the run goes on", text), text
    wait_for(lambda: slurmq.job_state(rollout_job) in slurmq.TERMINAL, 120, "the rollout job to end with the run")
    assert slurmq.job_state(rollout_job) == "COMPLETED"


# A service role's run: its job, what makes its run, and the metric every step has from that service. The judge of
# 20 SFT steps: its accuracy is not what this checks (tests/test_judge.py trains on the full one).
SERVICE_RUNS = {
    "teacher": (["jobs/toy-distill-cpu.yaml"], "teacher_seconds"),
    "judge": (["jobs/toy-judge-cpu.yaml", "services.judge.path=sft:jobs/toy-judge-sft-cpu.yaml@20"], "judge_seconds"),
}


@pytest.mark.parametrize("role", sorted(SERVICE_RUNS))
def test_a_service_job_joins_a_running_run_and_leaves_it(slurm_cluster, tmp_path, role):
    """`hpc-rl rollout add RUN --role teacher|judge` mid-run: a second server of the role (index 1, on a node of its
    own job) registers, the trainer's client of that role takes it in and sends it work; `scancel` of that job: the
    run goes on with the run's own server of the role and completes every step, each with that service's answers."""
    steps = 120
    job, per_step = SERVICE_RUNS[role]
    p = hpc_rl("submit", *job, f"output_dir={tmp_path}", "trainer.nodes=1", "rollout.nodes=0",
               f"trainer.steps={steps}", "checkpoint.every=0", "eval.source=null", timeout=600)
    run = submitted_run_dir(p.stdout)
    job_id = read_json(run / "slurm.json")["job_id"]
    token = (run / "token").read_text().strip()
    wait_for(lambda: len(metrics_rows(run)) >= 3, 600, f"job {job_id} to train 3 steps\n{run_logs(run)}")
    service_job = _add(run, "--role", role)
    log0 = run / "logs" / "trainer-0.log"
    wait_for(lambda: re.search(rf"{role} server 1 at \S+ answers; it joins", log0.read_text()), 300,
             f"the trainer to take in {role} server 1\n{run_logs(run)}")
    listed = [r for r in json.loads(hpc_rl("rollout", "list", str(run), "--json", timeout=120).stdout)
              if r["role"] == role]
    mine = {r["index"]: r for r in listed}
    assert mine[1]["job_id"] == service_job and mine[1]["rollout_job"] and mine[0]["job_id"] == str(job_id), listed

    def requests_served() -> int:
        try:
            return requests.get(mine[1]["url"] + "/metrics", headers={"Authorization": f"Bearer {token}"},
                                timeout=2).json().get("requests", 0)
        except (requests.RequestException, ValueError):
            return 0

    wait_for(lambda: requests_served() >= 3, 120, f"{role} server 1 to answer the trainer's requests")
    cancel = subprocess.run(["scancel", service_job], capture_output=True, text=True, timeout=60)
    assert cancel.returncode == 0, cancel.stderr
    final = wait_for(lambda: (s := status(run))["state"] in slurmq.TERMINAL and s, 900, f"job {job_id} to end", poll_s=3)
    assert final["state"] == "COMPLETED", f"{final}\n{run_logs(run)}"
    rows = metrics_rows(run)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r[per_step] > 0 for r in rows), rows[-3:]
    if role == "teacher":  # (the sampled reverse KL may dip below 0 once the student is close: it is an estimate)
        assert all(abs(r["distill/reverse_kl"]) < 50 for r in rows), rows[-3:]
    else:
        assert all(0 <= r["judge/parse_failed_frac"] <= 1 and r["judge/s"] > 0 for r in rows), rows[-3:]
    assert re.search(rf"{role} server 1 at \S+ (left|failed)", log0.read_text()), log0.read_text()[-3000:]
    assert f"{role} server 1 serving" in (run / "logs" / f"{role}-1.log").read_text()
