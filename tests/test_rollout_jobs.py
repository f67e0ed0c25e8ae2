"""`hpc-rl rollout add|list|remove` without a cluster: what a rollout job may override, its indexes, the listing
of a run's servers from its rendezvous files, and one-line errors for bad input (the jobs themselves run in
tests/test_rollout_jobs_slurm.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_rl import cli, config
from hpc_rl.cluster.rollout_jobs import ROLLOUT_JOBS_JSON, next_first_index, rollout_servers, split_overrides
from hpc_rl.errors import ConfigError
from hpc_rl.rundir import RunDir, write_json_atomic, write_new_token

REPO = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, *overrides: str) -> RunDir:
    run = RunDir(tmp_path / "toy-grpo-20260101-000000")
    run.ensure_layout()
    cfg = config.load(REPO / "jobs" / "toy-grpo-cpu.yaml", list(overrides))
    run.job_yaml.write_text(config.dump(cfg))
    write_new_token(run)
    return run


def test_only_engine_and_slurm_settings_may_differ(tmp_path):
    assert split_overrides(["slurm.partition=preempt", "rollout.tensor_parallel=2", "slurm.qos=low"]) == [
        "rollout.tensor_parallel=2"]
    with pytest.raises(ConfigError, match=r"^rollout.temperature: a rollout job sets only its engine"):
        split_overrides(["rollout.temperature=0.5"])
    with pytest.raises(ConfigError, match=r"^trainer.lr: a rollout job sets only"):
        split_overrides(["trainer.lr=1"])
    with pytest.raises(ConfigError, match="an override is KEY=VALUE"):
        split_overrides(["slurm.partition"])


def test_indexes_follow_the_runs_own_servers_and_earlier_jobs(tmp_path):
    run = _run(tmp_path, "rollout.nodes=2", "rollout.servers_per_node=2")
    cfg = config.load(run.job_yaml)
    assert next_first_index(run, cfg) == 4
    write_json_atomic(run.root / ROLLOUT_JOBS_JSON, {"jobs": [{"job_id": "7", "first_index": 4, "servers": 3}]})
    assert next_first_index(run, cfg) == 7
    only_jobs = _run(tmp_path / "b", "rollout.nodes=0", "rollout.servers_per_node=0")
    assert next_first_index(only_jobs, config.load(only_jobs.job_yaml)) == 0


def test_list_shows_registrations_and_what_does_not_answer(tmp_path, capsys):
    run = _run(tmp_path)
    # The run's own server 0 registered (nobody listens at that port: "not answering"), a forged one, a garbage file.
    write_json_atomic(run.rollout_file(0), {"index": 0, "url": "http://127.0.0.1:9", "hostname": "n2",
                                            "slurm_job_id": "5"})
    write_json_atomic(run.rollout_file(42), {"index": 42, "url": "http://127.0.0.1:9"})
    run.rollout_file(43).write_text("{nope")
    rows = {r["index"]: r for r in rollout_servers(run)}
    assert set(rows) == {0, 42}
    assert rows[0]["job_id"] == "5" and rows[0]["node"] == "n2" and rows[0]["state"].startswith("not answering")
    assert rows[42]["job_id"] == "?" and not rows[42]["rollout_job"]
    assert cli.main(["rollout", "list", str(run.root)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["ROLE", "INDEX", "JOB", "NODE", "ADDRESS", "STATE", "VERSION", "TOKENS", "TOK/S"]
    assert table[1].split()[:5] == ["rollout", "0", "5", "(run)", "n2"]
    assert cli.main(["rollout", "list", str(run.root), "--json"]) == 0
    assert [r["index"] for r in json.loads(capsys.readouterr().out)] == [0, 42]


def test_bad_rollout_commands_are_one_line_errors(tmp_path, capsys):
    run = _run(tmp_path)
    assert cli.main(["rollout", "remove", str(run.root), "12"]) == 2
    err = capsys.readouterr().err
    assert "JOBID: 12 is not a rollout job of run toy-grpo-20260101-000000 (its rollout jobs: none)" in err
    assert len(err.strip().splitlines()) == 1
    assert cli.main(["rollout", "frobnicate", str(run.root)]) == 2
    assert "use `rollout add RUN" in capsys.readouterr().err
    assert cli.main(["rollout", "add", str(run.root), "rollout.top_p=0.5"]) == 2
    assert "rollout.top_p: a rollout job sets only its engine" in capsys.readouterr().err
    assert cli.main(["rollout", "add", str(run.root), "--nodes", "0", "--dry-run"]) == 2
    assert "--nodes: 0" in capsys.readouterr().err
    run.done_file.write_text("{}")
    assert cli.main(["rollout", "add", str(run.root)]) == 2
    assert "has finished" in capsys.readouterr().err
    assert cli.main(["rollout", "add", str(run.root), "--dry-run"]) == 0  # the script, and the note
    assert "# note: run toy-grpo-20260101-000000 has finished" in capsys.readouterr().out


def test_dry_run_prints_the_script_and_the_indexes(tmp_path, capsys):
    run = _run(tmp_path)
    assert cli.main(["rollout", "add", str(run.root), "--nodes", "2", "slurm.partition=preempt", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --partition=preempt" in out and "#SBATCH --nodes=2" in out
    assert "rendezvous/*.json" not in out  # a rollout job never clears the run's registrations
    assert "2 node(s) x 1 rollout server(s), indexes 1..2 of run toy-grpo-20260101-000000" in out
    assert not (run.root / ROLLOUT_JOBS_JSON).exists()  # nothing recorded


def test_servers_per_node_zero_goes_with_nodes_zero():
    with pytest.raises(ConfigError, match="rollout.servers_per_node 0"):
        config.load(REPO / "jobs" / "toy-grpo-cpu.yaml", ["rollout.servers_per_node=0"])
    cfg = config.load(REPO / "jobs" / "toy-grpo-cpu.yaml", ["rollout.servers_per_node=0", "rollout.nodes=0"])
    assert cfg.rollout_servers == 0 and cfg.rollout.server_wait_s == cfg.rollout.startup_timeout_s
    with pytest.raises(ConfigError, match="rollout.wait_for_servers_s must be >= 0"):
        config.load(REPO / "jobs" / "toy-grpo-cpu.yaml", ["rollout.wait_for_servers_s=-1"])
