"""`hpc-rl status/logs/cancel` on run dirs whose state comes from their own files (no Slurm needed)."""

from __future__ import annotations

import json
import pickle

import pytest

from hpc_rl import cli
from hpc_rl.cluster.slurmq import _merge
from hpc_rl.cluster.status import last_metrics, log_files, run_info
from hpc_rl.errors import HpcRlError
from hpc_rl.rundir import RunDir, write_json_atomic

UNKNOWN_JOB = "987654321"  # no Slurm (or the test cluster) knows it: state must come from files


def make_run(base, name, steps=40, metrics=(), slurm=None) -> RunDir:
    root = base / name
    (root / "logs").mkdir(parents=True)
    (root / "rendezvous").mkdir()
    (root / "job.yaml").write_text(f"name: x\ntrainer:\n  steps: {steps}\n")
    if metrics:
        (root / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if slurm:
        write_json_atomic(root / "slurm.json", slurm)
    return RunDir(root.resolve())


def test_last_metrics_reads_the_last_complete_line(tmp_path):
    p = tmp_path / "m.jsonl"
    rows = [{"step": i, "reward_mean": i / 10, "pad": "x" * 500} for i in range(1, 400)]  # > 64 KiB
    p.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 400, "rew')  # a line being written
    assert last_metrics(p)["step"] == 399
    assert last_metrics(tmp_path / "missing.jsonl") is None


def test_status_of_local_and_slurm_runs_from_files(tmp_path, capsys):
    done = make_run(tmp_path, "a-done", metrics=[{"step": 1, "reward_mean": 0.1}, {"step": 40, "reward_mean": 0.85}])
    write_json_atomic(done.done_file, {"exit_code": 0})
    (done.root / "eval.jsonl").write_text(json.dumps({"step": 40, "source": "train", "eval/pass@1": 0.7,
                                                      "eval/reward_mean": 0.8}) + "\n" + json.dumps(
        {"step": 20, "source": "offline", "eval/pass@1": 0.65, "eval/reward_mean": 0.75}) + "\n")
    ok = make_run(tmp_path, "b-slurm-ok", slurm={"job_id": UNKNOWN_JOB, "trainer_nodes": 1},
                  metrics=[{"step": 3, "reward_mean": 0.5}])
    (ok.root / "submitit").mkdir()
    with open(ok.root / "submitit" / f"{UNKNOWN_JOB}_0_result.pkl", "wb") as f:
        pickle.dump(("success", 0), f)
    bad = make_run(tmp_path, "c-slurm-failed", slurm={"job_id": UNKNOWN_JOB, "trainer_nodes": 1})
    (bad.root / "submitit").mkdir()
    with open(bad.root / "submitit" / f"{UNKNOWN_JOB}_0_result.pkl", "wb") as f:
        pickle.dump(("error", "Traceback ..."), f)
    cancelled = make_run(tmp_path, "d-cancelled", slurm={"job_id": UNKNOWN_JOB, "trainer_nodes": 1})
    write_json_atomic(cancelled.root / "cancelled.json", {"job_id": UNKNOWN_JOB})

    assert cli.main(["status", "--runs-dir", str(tmp_path), "--json"]) == 0
    infos = {i["run"]: i for i in json.loads(capsys.readouterr().out)}
    assert {k: (v["kind"], v["state"], v["step"], v["reward_mean"]) for k, v in infos.items()} == {
        "a-done": ("local", "COMPLETED", 40, 0.85),
        "b-slurm-ok": ("slurm", "COMPLETED", 3, 0.5),
        "c-slurm-failed": ("slurm", "FAILED", None, None),
        "d-cancelled": ("slurm", "CANCELLED", None, None),
    }
    assert infos["b-slurm-ok"]["job_id"] == UNKNOWN_JOB and infos["b-slurm-ok"]["state_source"] == "files"
    # The newest evaluation (here one of `hpc-rl eval`, offline); a run without eval.jsonl has none.
    assert infos["a-done"]["eval"] == {"step": 20, "source": "offline", "pass@1": 0.65, "reward_mean": 0.75}
    assert infos["b-slurm-ok"]["eval"] is None

    assert cli.main(["status", "--runs-dir", str(tmp_path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["RUN", "STATE", "JOB", "STEP", "REWARD", "EVAL_P@1", "SERVERS", "NODES"]
    assert table[1].split() == ["a-done", "COMPLETED", "local", "40/40", "0.850", "0.650@20(offline)", "-"]
    assert table[2].split()[4:6] == ["0.500", "-"]

    assert cli.main(["status", "b-slurm", "--runs-dir", str(tmp_path), "--json"]) == 0  # a unique prefix
    assert json.loads(capsys.readouterr().out)["run"] == "b-slurm-ok"


def test_status_of_a_missing_run_is_a_user_error(tmp_path, capsys):
    assert cli.main(["status", "nope", "--runs-dir", str(tmp_path)]) == 2
    assert "not found" in capsys.readouterr().err
    assert cli.main(["status", "--runs-dir", str(tmp_path / "none")]) == 0
    assert "no runs" in capsys.readouterr().out


def test_logs_by_role(tmp_path, capsys):
    run = make_run(tmp_path, "r", slurm={"job_id": "7", "trainer_nodes": 2})
    sub = run.root / "submitit"
    sub.mkdir()
    for t in range(3):
        (sub / f"7_{t}_log.out").write_text(f"task {t} out\n")
    (run.logs / "trainer-0.log").write_text("rank 0 says hi\n")
    (run.logs / "rollout-0.log").write_text("server up\n")
    names = lambda role: [p.name for p in log_files(run, role)]  # noqa: E731
    assert names("trainer") == ["7_0_log.out", "7_1_log.out", "trainer-0.log"]
    assert names("rollout") == ["7_2_log.out", "rollout-0.log"]
    assert len(names("all")) == 5
    assert cli.main(["logs", str(run.root), "--role", "rollout"]) == 0
    out = capsys.readouterr().out
    assert "==> submitit/7_2_log.out <==\ntask 2 out\n" in out and "server up" in out and "rank 0" not in out


def test_cancel_of_a_local_run_is_a_user_error(tmp_path, capsys):
    run = make_run(tmp_path, "local")
    with pytest.raises(HpcRlError, match="not submitted to Slurm"):
        cli.dispatch(cli.build_parser().parse_args(["cancel", str(run.root)]))


def test_merge_states_of_components():
    assert _merge(["RUNNING", "COMPLETED"]) == "RUNNING"
    assert _merge(["COMPLETED", "FAILED"]) == "FAILED"
    assert _merge(["CANCELLED+", "CANCELLED"]) == "CANCELLED"
    assert _merge(["CANCELLED by 0"]) == "CANCELLED"
    assert _merge([" ", ""]) is None


def test_run_info_without_job_yaml_fields(tmp_path):
    run = make_run(tmp_path, "bare")
    run.job_yaml.write_text("name: x\n")
    assert run_info(run)["steps"] is None
