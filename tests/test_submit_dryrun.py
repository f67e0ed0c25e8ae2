"""`hpc-rl submit --dry-run` and the rendering behind it: no Slurm needed."""

from __future__ import annotations

import os
import re
from collections import namedtuple

import pytest

from hpc_rl import cli, config, netutil
from hpc_rl.cluster import env as cenv
from hpc_rl.cluster.layout import node_roles, role_of, total_nodes
from hpc_rl.cluster.render import executor_params, render, time_minutes
from hpc_rl.errors import ConfigError
from hpc_rl.nccl import nccl_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dry_run(capsys, job: str, *overrides: str) -> str:
    assert cli.main(["submit", os.path.join(REPO, job), *overrides, "--dry-run"]) == 0
    return capsys.readouterr().out


def sbatch_flags(script: str) -> dict:
    """#SBATCH --key=value lines of the first (or only) component -> {key: value or True}."""
    out = {}
    for line in script.splitlines():
        if line.strip() == "#SBATCH hetjob":
            break
        m = re.match(r"#SBATCH --([\w-]+)(?:=(.*))?$", line)
        if m:
            out[m.group(1)] = True if m.group(2) is None else m.group(2).strip("'")
    return out


def test_toy_spec_on_three_nodes(capsys, tmp_path):
    out = dry_run(capsys, "jobs/toy-grpo-cpu.yaml", "trainer.nodes=2", "rollout.nodes=1",
                  "slurm.partition=debug", "slurm.time=00:20:00", f"output_dir={tmp_path}")
    f = sbatch_flags(out)
    assert f["nodes"] == "3" and f["ntasks-per-node"] == "1"
    assert f["partition"] == "debug" and f["time"] == "00:20:00"
    assert f["signal"] == "USR2@120" and f["requeue"] is True
    assert "gpus-per-node" not in f and "exclusive" not in f
    assert f["output"].startswith(f"{tmp_path}/toy-grpo-") and f["output"].endswith("/submitit/%j_0_log.out")
    assert "srun --unbuffered" in out and "--kill-on-bad-exit=1" in out and "-m submitit.core._submit" in out
    assert "# node 0: trainer 0 (2 trainer rank(s))" in out
    assert "# node 1: trainer 1 (2 trainer rank(s))" in out
    assert "# node 2: rollout 0 (1 rollout server(s), tensor parallel 1)" in out
    assert "nothing submitted" in out
    assert not list(tmp_path.iterdir()), "a dry run must not create the run dir"


def test_grpo_recipe_one_trainer_one_rollout_node(capsys):
    out = dry_run(capsys, "jobs/qwen2.5-0.5b-gsm8k-grpo.yaml", "slurm.partition=a100", "slurm.account=proj42")
    f = sbatch_flags(out)
    assert (f["nodes"], f["gpus-per-node"], f["cpus-per-task"]) == ("2", "8", "64")
    assert (f["partition"], f["account"], f["time"], f["mem"]) == ("a100", "proj42", "12:00:00", "0")
    assert f["signal"] == "USR2@300" and f["exclusive"] is True
    lines = out.splitlines()
    # setup lines come before the project env and the job's exports, all before srun.
    i_setup, i_path, i_srun = (lines.index("source envs/activate.sh"),
                               next(i for i, ln in enumerate(lines) if ln.startswith("export PATH=")),
                               next(i for i, ln in enumerate(lines) if ln.startswith("srun ")))
    assert i_setup < i_path < i_srun
    assert "export NCCL_DEBUG=WARN" in lines and "export HPC_RL_NCCL_TIMEOUT_S=1800" in lines
    assert "# node 1: rollout 0 (8 rollout server(s), tensor parallel 1)" in out


def test_ppo_recipe_two_trainer_nodes_tp2_rollout(capsys):
    out = dry_run(capsys, "jobs/qwen2.5-7b-gsm8k-ppo.yaml", "slurm.time=2-00:00:00", "slurm.signal_delay_s=900",
                  "slurm.setup=[module load cuda/12.4, source envs/activate.sh]",
                  "slurm.additional={reservation: rl, gres-flags: enforce-binding}", "slurm.qos=high")
    f = sbatch_flags(out)
    assert (f["nodes"], f["gpus-per-node"], f["time"], f["qos"]) == ("3", "8", "2-00:00:00", "high")
    assert f["signal"] == "USR2@900"
    assert f["reservation"] == "rl" and f["gres-flags"] == "enforce-binding"
    assert "module load cuda/12.4\nsource envs/activate.sh\n" in out
    assert "# node 2: rollout 0 (4 rollout server(s), tensor parallel 2)" in out
    assert "# node 1: trainer 1 (8 trainer rank(s))" in out


def test_hetjob_components_have_their_own_partition_and_gpus(capsys):
    out = dry_run(capsys, "jobs/qwen2.5-7b-gsm8k-ppo.yaml", "slurm.layout=hetjob",
                  "slurm.rollout_partition=inference", "slurm.rollout_gpus_per_node=4", "rollout.servers_per_node=2")
    head, _, second = out.partition("#SBATCH hetjob\n")
    assert second, "no hetjob separator"
    f0 = sbatch_flags(head)
    f1 = sbatch_flags(second)
    assert (f0["partition"], f0["nodes"], f0["gpus-per-node"]) == ("gpu", "2", "8")
    assert (f1["partition"], f1["nodes"], f1["gpus-per-node"]) == ("inference", "1", "4")
    assert f0["signal"] == "B:USR2@600" and "signal" not in f1
    assert re.search(r"srun --het-group=0 .*\n\s+\S+python\S* -u -m hpc_rl.cluster.task \S+ --node-offset 0 "
                     r"--num-nodes 3 &", out)
    assert re.search(r"srun --het-group=1 .*--node-offset 2 --num-nodes 3 &", out.replace("\\\n", ""))
    assert "scontrol requeue" in out and "source envs/activate.sh" in out


def test_dry_run_errors_are_config_errors(capsys):
    with pytest.raises(ConfigError, match="slurm.time"):
        cli.dispatch(cli.build_parser().parse_args(
            ["submit", os.path.join(REPO, "jobs/toy-grpo-cpu.yaml"), "slurm.time=soon", "--dry-run"]))
    assert cli.main(["submit", os.path.join(REPO, "jobs/toy-grpo-cpu.yaml"), "slurm.layout=hetjob",
                     "rollout.nodes=0", "--dry-run"]) == 2
    assert "hetjob needs rollout.nodes >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("text,minutes", [("90", 90), ("01:30:00", 90), ("1:00", 1), ("0:30", 1),
                                          ("2-00:00:00", 2880), ("1-2", 1560), ("1-0:30", 1470),
                                          ("00:00:59", 1)])
def test_time_minutes(text, minutes):
    assert time_minutes(text) == minutes


def test_time_minutes_rejects_nonsense():
    for bad in ("", "1h", "00:00:00", "-5"):
        with pytest.raises(ConfigError, match="slurm.time"):
            time_minutes(bad)


def _cfg(**kw) -> config.JobConfig:
    base = {"model": {"tiny": {}}, "trainer": {"nodes": 2, "procs_per_node": 2, "mini_batch_size": 32},
            "rollout": {"nodes": 2, "servers_per_node": 3}}
    for k, v in kw.items():
        base.setdefault(k, {}).update(v)
    return config.load_dict(base)


def test_layout_roles():
    cfg = _cfg()
    assert total_nodes(cfg) == 4
    assert [(n.index, n.role, n.role_index, n.procs) for n in node_roles(cfg)] == \
        [(0, "trainer", 0, 2), (1, "trainer", 1, 2), (2, "rollout", 0, 3), (3, "rollout", 1, 3)]
    assert [role_of(cfg, i) for i in range(4)] == ["trainer", "trainer", "rollout", "rollout"]
    with pytest.raises(ValueError):
        role_of(cfg, 4)


def test_executor_params_map_the_slurm_block():
    cfg = _cfg(slurm={"partition": "p", "account": "a", "qos": "q", "time": "02:00:00", "gpus_per_node": 4,
                      "cpus_per_task": 32, "mem": "200G", "constraint": "h100", "exclusive": True,
                      "signal_delay_s": 60, "mail_user": "me@x", "mail_type": "END", "array_parallelism": 3,
                      "requeue": False, "additional": {"--reservation": "r", "hint": None}},
               trainer={"device": "cpu"})
    p = executor_params(cfg, "/runs/r1")
    assert (p["nodes"], p["ntasks_per_node"], p["time"], p["signal_delay_s"]) == (4, 1, 120, 60)
    assert (p["partition"], p["account"], p["qos"], p["gpus_per_node"], p["cpus_per_task"]) == ("p", "a", "q", 4, 32)
    assert (p["constraint"], p["exclusive"], p["mail_user"], p["mail_type"], p["array_parallelism"]) == \
        ("h100", True, "me@x", "END", 3)
    assert p["additional_parameters"] == {"time": "02:00:00", "mem": "200G", "reservation": "r"}
    assert p["srun_args"] == ["--kill-on-bad-exit=1"]
    assert "export HPC_RL_RUN_DIR=/runs/r1" in p["setup"]


def test_nccl_env_defaults_and_spec(monkeypatch):
    monkeypatch.delenv("HPC_RL_DEBUG", raising=False)
    assert nccl_env(_cfg()) == {"NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                                "HPC_RL_NCCL_TIMEOUT_S": "1800"}
    monkeypatch.setenv("HPC_RL_DEBUG", "1")
    assert nccl_env(_cfg())["NCCL_DEBUG"] == "INFO"
    cfg = _cfg(env={"nccl": {"socket_ifname": "ib0", "ib_disable": True, "debug": "TRACE", "timeout_s": 60}})
    assert nccl_env(cfg) == {"NCCL_SOCKET_IFNAME": "ib0", "NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "TRACE",
                             "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "HPC_RL_NCCL_TIMEOUT_S": "60"}
    script = render(cfg, "/runs/x")
    assert "export NCCL_SOCKET_IFNAME=ib0\n" in script and "export NCCL_IB_DISABLE=1\n" in script


StatVfs = namedtuple("StatVfs", "f_blocks f_frsize")


def test_shm_check(monkeypatch):
    monkeypatch.setattr(cenv.os, "statvfs", lambda p: StatVfs(16384, 4096))  # 64 MiB, as in Docker
    msg = cenv.shm_problem()
    assert "64 MiB" in msg and "NCCL_SHM_DISABLE=1" in msg
    monkeypatch.setattr(cenv.os, "statvfs", lambda p: StatVfs(4 << 20, 4096))  # 16 GiB
    assert cenv.shm_problem() is None

    def missing(p):
        raise FileNotFoundError(2, "No such file or directory")
    monkeypatch.setattr(cenv.os, "statvfs", missing)
    assert "not usable" in cenv.shm_problem()


def test_prepare_node_env_spec_wins_and_node_values_are_fresh(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "wrong-from-login-node")
    monkeypatch.setenv("NCCL_DEBUG", "VERSION")
    for k in ("HPC_RL_NODE_ADDR", "MY_VAR", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "HPC_RL_NCCL_TIMEOUT_S"):
        monkeypatch.delenv(k, raising=False)
    used = cenv.prepare_node_env(_cfg(env={"vars": {"MY_VAR": 7}}))
    addr, ifname = cenv.node_address()
    assert used["HPC_RL_NODE_ADDR"] == addr == os.environ["HPC_RL_NODE_ADDR"]
    assert os.environ["GLOO_SOCKET_IFNAME"] == ifname != "wrong-from-login-node"
    assert netutil.interfaces()[ifname] == addr
    assert os.environ["NCCL_DEBUG"] == "WARN" and os.environ["MY_VAR"] == "7"


def test_debug_logs_the_node_settings(monkeypatch, caplog):
    import logging

    monkeypatch.setenv("HPC_RL_DEBUG", "1")
    for k in ("HPC_RL_NODE_ADDR", "GLOO_SOCKET_IFNAME", "NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
              "HPC_RL_NCCL_TIMEOUT_S", "NCCL_IB_DISABLE"):
        monkeypatch.delenv(k, raising=False)
    logger = logging.getLogger("hpc_rl")
    logger.addHandler(caplog.handler)  # the project logger may not propagate to the root
    # setLevel, not a bare `level`: it clears the logger's isEnabledFor cache, which an earlier test in this worker
    # may have filled at INFO (then debug lines vanish, depending on the order tests ran in).
    caplog.set_level(logging.DEBUG, logger="hpc_rl")
    try:
        cenv.prepare_node_env(_cfg(env={"nccl": {"ib_disable": True}}))
    finally:
        logger.removeHandler(caplog.handler)
    text = caplog.text
    assert "NCCL_DEBUG=INFO" in text and "NCCL_IB_DISABLE=1" in text and "GLOO_SOCKET_IFNAME=" in text


def test_rollout_nodes_0_shows_the_servers_beside_the_trainer(capsys, tmp_path):
    out = dry_run(capsys, "jobs/toy-grpo-cpu.yaml", "rollout.nodes=0", f"output_dir={tmp_path}")
    assert "# node 0: trainer 0 (2 trainer rank(s) + 1 rollout server(s) beside them, rollout.nodes 0)" in out
    out = dry_run(capsys, "jobs/toy-grpo-cpu.yaml", "rollout.nodes=0", "rollout.servers_per_node=0", f"output_dir={tmp_path}")
    assert "no rollout server of its own: `hpc-rl rollout add` brings them" in out
