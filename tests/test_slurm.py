"""On a real 3-node Slurm cluster (tests/cluster/up.sh): nodes with their own addresses, the
submitit path with this project's rendering, `hpc-rl submit/status/logs/cancel`, and the toy GRPO
job end to end across three nodes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import cloudpickle
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster.helpers import NODE_ADDRS, REPO, hpc_rl, job_processes, run_logs, status, submitted_run_dir, wait_for  # noqa: E402,F401

from hpc_rl import config  # noqa: E402
from hpc_rl.cluster import slurmq  # noqa: E402
from hpc_rl.rundir import read_json  # noqa: E402

pytestmark = pytest.mark.slurm
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # nodes cannot import this test module


def test_nodes_have_their_own_hostnames_and_addresses(slurm_cluster):
    p = subprocess.run(["srun", "-N3", "sh", "-c", "echo $(hostname) $(ip -4 -o addr show eth0 | awk '{print $4}')"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    seen = dict(line.split() for line in p.stdout.strip().splitlines())
    assert seen == {h: f"{a}/24" for h, a in NODE_ADDRS.items()}


def _probe():
    """Runs on every node of a submitit job: what the node sees of itself and of the preamble."""
    import socket

    import submitit

    from hpc_rl import config as cfgmod
    from hpc_rl.cluster.env import prepare_node_env

    env = submitit.JobEnvironment()
    cfg = cfgmod.load(os.environ["HPC_RL_RUN_DIR"] + "/job.yaml")
    used = prepare_node_env(cfg)
    return {"node": env.node, "num_nodes": env.num_nodes, "host": socket.gethostname(),
            "addr": used["HPC_RL_NODE_ADDR"], "gloo": used.get("GLOO_SOCKET_IFNAME"),
            "nccl_debug": os.environ.get("NCCL_DEBUG"), "foo": os.environ.get("HPC_RL_TEST_VAR"),
            "setup": os.environ.get("HPC_RL_SETUP_RAN")}


def test_submitit_job_with_rendered_parameters_runs_one_task_per_node(slurm_cluster, tmp_path):
    import submitit

    from hpc_rl.cluster.render import executor_params

    spec = {"name": "probe", "model": {"tiny": {}}, "trainer": {"nodes": 2, "procs_per_node": 1, "mini_batch_size": 8},
            "rollout": {"nodes": 1}, "env": {"vars": {"HPC_RL_TEST_VAR": "a b"}, "nccl": {"debug": "INFO"}},
            "slurm": {"time": "00:05:00", "setup": ["export HPC_RL_SETUP_RAN=yes"], "additional": {"comment": "x"}}}
    cfg = config.load_dict(spec)
    run = tmp_path / "run"
    run.mkdir()
    (run / "job.yaml").write_text(config.dump(cfg))
    ex = submitit.SlurmExecutor(folder=run / "submitit")
    ex.update_parameters(**executor_params(cfg, run))
    job = ex.submit(_probe)
    results = job.results()  # one per task (node); raises if any failed
    by_node = {r["node"]: r for r in results}
    assert sorted(by_node) == [0, 1, 2]
    assert {r["host"] for r in results} == {"n1", "n2", "n3"}
    for r in results:
        assert r["num_nodes"] == 3
        assert r["addr"] == NODE_ADDRS[r["host"]] and r["gloo"] == "eth0"
        assert (r["nccl_debug"], r["foo"], r["setup"]) == ("INFO", "a b", "yes")
    script = (run / "submitit" / f"{job.job_id}_submission.sh").read_text()
    assert "#SBATCH --comment=x" in script and "#SBATCH --time=00:05:00" in script


def _submit(*overrides: str, out: Path) -> Path:
    p = hpc_rl("submit", "jobs/toy-grpo-cpu.yaml", f"output_dir={out}", *overrides, timeout=300)
    run = submitted_run_dir(p.stdout)
    assert read_json(run / "slurm.json")["job_id"]
    return run


@pytest.mark.slow
def test_cancel_ends_every_process_of_the_job(slurm_cluster, tmp_path):
    run = _submit("trainer.nodes=2", "rollout.nodes=1", "trainer.steps=10000", out=tmp_path)
    try:
        server = wait_for(lambda: read_json(run / "rendezvous" / "rollout-0.json"), 300,
                          f"rollout server 0 of {run} to publish its address\n" + run_logs(run))
        wait_for(lambda: len(list((run / "logs").glob("trainer-*.log"))) == 4, 120, "4 trainer ranks to start")
        assert server["hostname"] == "n3" and server["host"] == NODE_ADDRS["n3"]
        before = job_processes(run)
        assert server["pid"] in before, before
        assert sum("hpc_rl.loop" in c for c in before.values()) == 4, before
        assert status(run)["state"] == "RUNNING"

        p = hpc_rl("cancel", str(run), timeout=180)
        assert "cancelled job" in p.stdout
        left = wait_for(lambda: not job_processes(run) or None, 60, "no process of the job to be left",
                        poll_s=0.5) and job_processes(run)
        assert not left, f"orphans after cancel: {left}"
        info = status(run)
        assert info["state"] == "CANCELLED", info
    finally:
        st = read_json(run / "slurm.json")
        if st:
            slurmq.scancel(st["job_id"])
        for pid in job_processes(run):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_toy_grpo_on_three_nodes_completes_and_learns(slurm_cluster, tmp_path):
    """Trainer ranks on n1+n2 (gloo across namespaces), the rollout server on n3 reached by address,
    weights synced every step, checkpoints in the run dir, COMPLETED in `hpc-rl status`.
    Learning criterion: the core issue's own — the mean reward of the last 5 steps is >= 0.8 and at
    least 0.6 above the first step's (chance ~0.03); trainer.stop_at ends the run once it is met, and the job still
    completes with the last step's checkpoint and push. One rank per trainer node: two ranks partition ZeRO-3 across
    the nodes as four would, at half the CPU time on the test machine's 2 cores."""
    run = _submit("trainer.nodes=2", "trainer.procs_per_node=1", "rollout.nodes=1", "trainer.stop_at={reward_mean: 0.8}",
                  out=tmp_path)
    job_id = read_json(run / "slurm.json")["job_id"]
    follow = subprocess.Popen([sys.executable, "-m", "hpc_rl.cli", "logs", str(run), "--role", "rollout", "--follow"],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        final = wait_for(lambda: (s := status(run))["state"] in slurmq.TERMINAL and s, 1800,
                         f"job {job_id} to end", poll_s=5)
        assert final["state"] == "COMPLETED", f"{final}\n{run_logs(run)}"
        followed, _ = follow.communicate(timeout=60)  # --follow ends by itself once the job has ended
    finally:
        follow.kill()
    assert follow.returncode == 0
    assert "==> logs/rollout-0.log <==" in followed and "trainer-0.log" not in followed

    master = read_json(run / "rendezvous" / "master.json")
    assert master["addr"] == NODE_ADDRS["n1"]
    logs = {t: (run / "submitit" / f"{job_id}_{t}_log.out").read_text() for t in range(3)}
    assert "on n1 (10.77.0.11): trainer" in logs[0]
    assert "on n2 (10.77.0.12): trainer" in logs[1]
    assert "on n3 (10.77.0.13): rollout" in logs[2]
    rollout_log = (run / "logs" / "rollout-0.log").read_text()
    assert "serving http://10.77.0.13:" in rollout_log

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = len(rows)  # where stop_at ended it (trainer.steps at most)
    assert 5 <= steps <= config.load(run / "job.yaml").trainer.steps
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    # Weights reached the server on n3 after every step.
    assert all(r["sync_bytes"] > 0 for r in rows)
    assert f"policy_version {steps}" in rollout_log and f"policy_version {steps}" in followed
    assert (run / "checkpoints" / f"step_{steps}" / "hf" / "config.json").is_file()
    assert (run / "checkpoints" / "latest").exists()
    rewards = [r["reward_mean"] for r in rows]
    last5 = sum(rewards[-5:]) / 5
    assert last5 >= 0.8 and last5 - rewards[0] >= 0.6, rewards

    st = hpc_rl("status", "--runs-dir", str(tmp_path)).stdout
    assert run.name in st and "COMPLETED" in st
    trainer_logs = hpc_rl("logs", str(run), "--role", "trainer").stdout
    assert "trainer-0.log" in trainer_logs and "rollout-0.log" not in trainer_logs


@pytest.mark.slow
def test_hetjob_layout_runs_each_role_in_its_component(slurm_cluster, tmp_path):
    """slurm.layout=hetjob: our own sbatch (submitit has no hetjob); the trainer component and the
    rollout component each start their node's role, and the run completes (3 steps)."""
    run = _submit("slurm.layout=hetjob", "trainer.nodes=1", "rollout.nodes=1", "trainer.steps=3",
                  "checkpoint.every=0", out=tmp_path)
    job_id = read_json(run / "slurm.json")["job_id"]
    assert read_json(run / "slurm.json")["layout"] == "hetjob"
    assert "#SBATCH hetjob" in (run / "submitit" / f"{job_id}_submission.sh").read_text()
    final = wait_for(lambda: (s := status(run))["state"] in slurmq.TERMINAL and s, 900,
                     f"heterogeneous job {job_id} to end", poll_s=5)
    assert final["state"] == "COMPLETED", f"{final}\n{run_logs(run)}"
    trainer_out = (run / "submitit" / f"{job_id}_trainer_0_log.out").read_text()
    rollout_out = (run / "submitit" / f"{job_id}_rollout_0_log.out").read_text()
    assert "node 0/2 on " in trainer_out and ": trainer" in trainer_out
    assert "node 1/2 on " in rollout_out and ": rollout" in rollout_out
    host = rollout_out.split("node 1/2 on ")[1].split()[0]
    assert f"serving http://{NODE_ADDRS[host]}:" in (run / "logs" / "rollout-0.log").read_text()
    assert read_json(run / "rendezvous" / "done.json")["step"] == 3


@pytest.mark.slow
def test_async_rollouts_across_a_trainer_node_and_a_rollout_node(slurm_cluster, tmp_path):
    """rollout.async_steps=1 on n1 (trainer) + n2 (rollout server): generation runs one step ahead, every
    sample is at most one version old, pushes reach the other node, and a checkpoint keeps the batch
    generated ahead. The run evaluates (greedy) at steps 0, 3 and 6 on the rollout node; then `hpc-rl eval --all
    --submit` evaluates its two checkpoints as a job array, one element per checkpoint, with the same numbers."""
    run = _submit("trainer.nodes=1", "rollout.nodes=1", "rollout.async_steps=1", "trainer.steps=6",
                  "checkpoint.every=3", "eval.source=toy:repeat_digit", "eval.every=3", "eval.max_prompts=6",
                  out=tmp_path)
    job_id = read_json(run / "slurm.json")["job_id"]
    final = wait_for(lambda: (s := status(run))["state"] in slurmq.TERMINAL and s, 900,
                     f"job {job_id} to end", poll_s=5)
    assert final["state"] == "COMPLETED", f"{final}\n{run_logs(run)}"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    for r in rows:
        assert r["policy_lag_max"] == min(r["step"] - 1, 1), r
        assert r["trainer_wait_seconds"] >= 0 and r["rollout_idle_seconds"] >= 0
    # A push is reported by the step after it finished (the first step has none yet).
    assert all(r["sync_bytes"] > 0 for r in rows[1:])
    assert "policy_version 5" in (run / "logs" / "rollout-0.log").read_text()
    pending = json.loads((run / "checkpoints" / "step_3" / "pending_batches.json").read_text())
    assert [b["step"] for b in pending] == [3] and set(pending[0]["versions"]) == {2}
    online = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert [(e["step"], e["source"]) for e in online] == [(0, "train"), (3, "train"), (6, "train")]

    dry = hpc_rl("eval", str(run), "--all", "--submit", "--dry-run")
    assert "#SBATCH --array=0-1" in dry.stdout and "#SBATCH --nodes=1" in dry.stdout, dry.stdout
    sub = hpc_rl("eval", str(run), "--all", "--submit", timeout=120)
    array_id = read_json(run / "eval" / "submissions.json")["submissions"][0]["array_job_id"]
    assert f"submitted evaluation array {array_id}: 2 checkpoint(s)" in sub.stdout
    final = wait_for(lambda: (s := slurmq.job_state(array_id)) in slurmq.TERMINAL and s, 600,
                     f"evaluation array {array_id} to end", poll_s=3)
    logs = "\n".join(p.read_text() for p in sorted((run / "eval" / "submitit").glob("*_log.*")))
    assert final == "COMPLETED", logs[-4000:]
    rows = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    offline = sorted((e for e in rows if e["source"] == "offline"), key=lambda e: e["step"])
    assert [e["step"] for e in offline] == [3, 6], rows
    skip = {"source", "time", "eval/seconds"}
    for e in offline:  # greedy: the checkpoint answers as the policy did during training
        (same,) = [o for o in online if o["step"] == e["step"]]
        assert {k: v for k, v in e.items() if k not in skip} == {k: v for k, v in same.items() if k not in skip}


@pytest.mark.slow
def test_reward_node_of_a_hetjob_serves_the_reward_model(slurm_cluster, tmp_path):
    """reward.nodes=1 in a heterogeneous job: the trainer component (n1) and the rollout component of a rollout node
    and a reward node; the reward node serves the reward model alone and the run trains on its scores."""
    p = hpc_rl("submit", "jobs/toy-ppo-rm-cpu.yaml", f"output_dir={tmp_path}", "slurm.layout=hetjob", "trainer.nodes=1",
               "rollout.nodes=1", "reward.nodes=1", "reward.model.placement=server", "trainer.steps=3",
               "checkpoint.every=0", timeout=300)
    run = submitted_run_dir(p.stdout)
    job_id = read_json(run / "slurm.json")["job_id"]
    final = wait_for(lambda: (s := status(run))["state"] in slurmq.TERMINAL and s, 900,
                     f"heterogeneous job {job_id} with a reward node to end", poll_s=5)
    assert final["state"] == "COMPLETED", f"{final}\n{run_logs(run)}"
    reward_out = (run / "submitit" / f"{job_id}_rollout_1_log.out").read_text()
    assert "node 2/3 on " in reward_out and ": reward" in reward_out, reward_out
    host = reward_out.split("node 2/3 on ")[1].split()[0]
    assert f"reward server 0 serving http://{NODE_ADDRS[host]}:" in (run / "logs" / "reward-0.log").read_text()
    assert "reward model" not in (run / "logs" / "rollout-0.log").read_text()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all("reward_model_logit_mean" in r for r in rows)


@pytest.mark.slow
def test_sft_on_two_trainer_nodes_without_rollout_nodes(slurm_cluster, tmp_path):
    """jobs/toy-sft-cpu.yaml submitted as a job of two trainer nodes (one rank each, ZeRO-3 across them) and nothing
    else: both nodes are trainers, no rollout server starts, the loss falls, the job COMPLETES with its checkpoint."""
    p = hpc_rl("submit", "jobs/toy-sft-cpu.yaml", f"output_dir={tmp_path}", "trainer.nodes=2", "trainer.procs_per_node=1",
               "trainer.steps=10", "eval.every=5", timeout=300)
    run = submitted_run_dir(p.stdout)
    job_id = read_json(run / "slurm.json")["job_id"]
    final = wait_for(lambda: (s := status(run))["state"] in slurmq.TERMINAL and s, 900, f"job {job_id} to end",
                     poll_s=2)
    assert final["state"] == "COMPLETED", f"{final}\n{run_logs(run)}"
    logs = {t: (run / "submitit" / f"{job_id}_{t}_log.out").read_text() for t in range(2)}
    assert "on n1 (10.77.0.11): trainer" in logs[0] and "on n2 (10.77.0.12): trainer" in logs[1], logs
    assert not list((run / "logs").glob("rollout-*.log")) and not list((run / "rendezvous").glob("rollout-*.json"))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 10 and losses[-1] < 0.5 * losses[0], losses
    assert [r["eval/step"] for r in rows if "eval/loss" in r] == [0, 5, 10]
    assert (run / "checkpoints" / "step_10" / "hf" / "config.json").is_file()


@pytest.mark.slow
def test_a_teacher_node_of_the_job_serves_the_distillation(slurm_cluster, tmp_path):
    """jobs/toy-distill-cpu.yaml as a job of three nodes: trainer (n1), rollout server (n2) and the teacher on a node of
    its own (n3, services.teacher.nodes 1), reached by address; every step has the teacher's scores, the teacher never
    takes weights, the job COMPLETES."""
    p = hpc_rl("submit", "jobs/toy-distill-cpu.yaml", f"output_dir={tmp_path}", "rollout.nodes=1",
               "services.teacher.nodes=1", "trainer.steps=4", "eval.source=null", "checkpoint.every=0", timeout=600)
    run = submitted_run_dir(p.stdout)
    job_id = read_json(run / "slurm.json")["job_id"]
    final = wait_for(lambda: (s := status(run))["state"] in slurmq.TERMINAL and s, 900, f"job {job_id} to end",
                     poll_s=2)
    assert final["state"] == "COMPLETED", f"{final}\n{run_logs(run)}"
    logs = {t: (run / "submitit" / f"{job_id}_{t}_log.out").read_text() for t in range(3)}
    assert "on n1 (10.77.0.11): trainer" in logs[0] and "on n2 (10.77.0.12): rollout" in logs[1], logs
    assert "on n3 (10.77.0.13): teacher" in logs[2] and "teacher server 0" in logs[2], logs[2]
    teacher_log = (run / "logs" / "teacher-0.log").read_text()
    assert "teacher server 0 serving http://10.77.0.13:" in teacher_log and "weights: loaded" not in teacher_log
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["teacher_seconds"] > 0 for r in rows), rows
    assert all(abs(r["distill/reverse_kl"]) < 50 for r in rows)
