"""Job spec loading: unknown keys, wrong types, impossible values -> one-line errors naming the key."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hpc_rl import config
from hpc_rl.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
TOY = {"model": {"tiny": {}}}


def load(data, overrides=()):
    return config.load_dict(yaml.safe_load(yaml.safe_dump(data)), list(overrides))


@pytest.mark.parametrize("data,overrides,message", [
    ({"modle": {}}, [], "modle: unknown key; did you mean 'model'?"),
    ({**TOY, "trainer": {"stpes": 3}}, [], "trainer.stpes: unknown key; did you mean 'trainer.steps'?"),
    ({**TOY, "algorithm": {"kl": {"cof": 1}}}, [], "algorithm.kl.cof: unknown key; did you mean 'algorithm.kl.coef'?"),
    ({**TOY, "trainer": {"lr": "fast"}}, [], "trainer.lr: expected a number, got str 'fast'"),
    ({**TOY, "trainer": {"steps": 2.5}}, [], "trainer.steps: expected an integer, got float 2.5"),
    ({**TOY, "trainer": {"steps": True}}, [], "trainer.steps: expected an integer, got bool True"),
    ({**TOY, "checkpoint": {"save_hf": "yes"}}, [], "checkpoint.save_hf: expected true/false"),
    ({**TOY, "algorithm": {"name": "grpoo"}}, [], "algorithm.name: 'grpoo' is not valid"),
    ({**TOY, "trainer": "fast"}, [], "trainer: expected a mapping of settings"),
    ({**TOY, "algorithm": {"name": "grpo", "group_size": 1}}, [], "algorithm.group_size must be >= 2 for grpo"),
    ({**TOY, "trainer": {"mini_batch_size": 48}}, [], "trainer.mini_batch_size (48) must divide the samples per step"),
    ({**TOY, "trainer": {"mini_batch_size": 2, "prompts_per_step": 2}, "algorithm": {"group_size": 2},
      "trainer_": None}, [], "trainer_: unknown key"),
    ({**TOY, "trainer": {"procs_per_node": 3, "mini_batch_size": 64}}, [],
     "must be divisible by the number of trainer ranks"),
    ({**TOY, "trainer": {"local_devices": [0, 1]}, "rollout": {"local_devices": [1]}}, [],
     "rollout.local_devices: GPUs ['1'] are also in trainer.local_devices"),
    ({}, [], "model.path: no model given"),
    ({**TOY, "rollout": {"max_model_len": 64}, "data": {"max_prompt_tokens": 64}}, [],
     "rollout.max_model_len (64) must exceed data.max_prompt_tokens (64)"),
    (TOY, ["trainer.lr"], "expected KEY=VALUE"),
    (TOY, ["trainer.lr=-1"], "trainer.lr must be > 0"),
    (TOY, ["trainer.lr.x=1"], "trainer.lr: expected a number, got dict"),
    ({**TOY, "trainer": {"lr": 0.1}}, ["trainer.lr.x=1"], "trainer.lr is not a section"),
    (TOY, ["=3"], "the key is empty"),
])
def test_bad_config_names_the_key(data, overrides, message):
    with pytest.raises(ConfigError) as e:
        load(data, overrides)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_overrides_are_typed_and_nested():
    cfg = load(TOY, ["trainer.lr=1e-6", "algorithm.kl.coef=0.01", "rollout.stop=[a, b]", "name=x"])
    assert cfg.trainer.lr == 1e-6 and isinstance(cfg.trainer.lr, float)
    assert cfg.algorithm.kl.coef == 0.01
    assert cfg.rollout.stop == ["a", "b"]
    assert cfg.name == "x"


def test_yaml_string_float_is_accepted():
    # PyYAML reads 1e-6 (no dot) as a string; a float field must still take it.
    cfg = config.load_dict({"model": {"tiny": {}}, "trainer": {"lr": "1e-6"}})
    assert cfg.trainer.lr == 1e-6


def test_resolved_config_round_trips(tmp_path):
    cfg = load(TOY, ["trainer.steps=7"])
    p = tmp_path / "job.yaml"
    p.write_text(config.dump(cfg))
    again = config.load(p)
    assert config.to_dict(again) == config.to_dict(cfg)


def test_jobs_in_repo_load():
    for job in sorted((REPO / "jobs").glob("*.yaml")):
        if job.name.startswith("sweep"):
            continue
        config.load(job)


def test_invalid_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: {lr: [1,\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: line \d+: invalid YAML"):
        config.load(bad)
    with pytest.raises(ConfigError, match="job spec not found"):
        config.load(tmp_path / "nope.yaml")
    notutf = tmp_path / "latin1.yaml"
    notutf.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        config.load(notutf)


def test_cli_prints_one_line_and_exits_2(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("model: {tiny: {}}\ntrainer: {stpes: 3}\n")
    r = subprocess.run([sys.executable, "-m", "hpc_rl.cli", "run", str(job)], capture_output=True, text=True,
                       cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip() == "hpc-rl: error: trainer.stpes: unknown key; did you mean 'trainer.steps'?"
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


@pytest.mark.parametrize("override,message", [
    ("reward.clip=.nan", "reward.clip: nan is not a finite number"),
    ("trainer.lr=.inf", "trainer.lr: inf is not a finite number"),
    ("trainer.lr=nan", "trainer.lr: 'nan' is not a finite number"),
    ("reward.clip=-1", "reward.clip must be > 0"),
])
def test_non_finite_numbers_are_rejected(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load(TOY, [override])


def test_a_key_with_a_line_break_gives_a_one_line_error():
    """Found by the mutation test on a fresh clone: the unknown-key message quoted the key's newline."""
    for data in ({"trainer": {"a\nb": 1}}, {"a\u2028b": {}}, {"rollout": {"x\r\n": 2}}):
        with pytest.raises(ConfigError) as e:
            config.load_dict(data)
        msg = str(e.value)
        assert len(msg.splitlines()) == 1 and "unknown key" in msg, repr(msg)
    with pytest.raises(ConfigError, match=r"trainer\.a\\nb: unknown key"):
        config.load_dict({"trainer": {"a\nb": 1}})


def test_config_show_documents_every_key(capsys):
    """`hpc-rl config show`: every key of the job spec with its type, default and a one-line doc."""
    from hpc_rl import cli
    from hpc_rl.config_show import rows

    table = rows()
    undocumented = [key for key, _, _, doc in table if not doc]
    assert not undocumented, f"config keys without a doc comment in config.py: {undocumented}"
    keys = {key for key, *_ in table}
    assert {"trainer.lr", "rollout.kv_cache_bytes", "algorithm.clip_ratio_high", "model.tiny.head_dim",
            "env.nccl.timeout_s", "slurm.requeue_on_failure"} <= keys
    assert len(keys) == len(table) > 100
    assert cli.main(["config", "show"]) == 0
    out = capsys.readouterr().out
    assert "trainer.lr" in out and "1e-05" in out and "Actor learning rate" in out and "[a number]" in out
    job = Path(__file__).resolve().parents[1] / "jobs" / "toy-ppo-cpu.yaml"
    assert cli.main(["config", "show", str(job), "trainer.lr=0.5"]) == 0
    out = capsys.readouterr().out
    assert any(ln.split()[:4] == ["trainer.lr", "0.5", "[default", "1e-05]"] for ln in out.splitlines())
    assert any(ln.split()[:4] == ["algorithm.name", "ppo", "[default", "grpo]"] for ln in out.splitlines())
    seed = next(ln for ln in out.splitlines() if ln.startswith("seed "))
    assert "[default" not in seed  # the toy's seed 1 is the default


def test_eval_every_beyond_a_shortened_run_warns_and_the_final_evaluation_stays(caplog):
    """The eval toy shortened (trainer.steps=5, eval.every 10) loads: only its evaluation after the last step runs,
    and the warning says so."""
    with caplog.at_level("WARNING", logger="hpc_rl"):
        cfg = config.load(REPO / "jobs" / "toy-grpo-eval-cpu.yaml", ["trainer.steps=5"])
    assert cfg.eval.every == 10 and cfg.trainer.steps == 5
    assert "eval.every (10) is beyond trainer.steps (5): only the evaluation after the last step runs" in caplog.text


@pytest.mark.parametrize("nodes,message", [
    ("3-1", "trainer.nodes: the range '3-1' needs 1 <= MIN <= MAX"),
    ("0-2", "trainer.nodes: the range '0-2' needs 1 <= MIN <= MAX"),
    ("two", "trainer.nodes: 'two' is neither a node count nor a range"),
    ("1-3", "(trainer.nodes x trainer.procs_per_node = 6 (3 node(s) of trainer.nodes 1-3))"),
])
def test_a_trainer_node_range_is_checked_at_every_size(nodes, message):
    with pytest.raises(ConfigError) as e:
        config.load_dict({"model": {"path": "m"}, "trainer": {"nodes": nodes, "mini_batch_size": 64}})
    assert message in str(e.value)


def test_a_node_range_resolves_to_the_nodes_the_job_got():
    from hpc_rl.cluster.layout import nodes_request, total_nodes
    from hpc_rl.cluster.render import executor_params

    cfg = config.load_dict({"model": {"path": "m"}, "trainer": {"nodes": "1-4", "procs_per_node": 1, "prompts_per_step": 12,
                                                                "mini_batch_size": 48}, "rollout": {"nodes": 1}})
    assert (nodes_request(cfg), total_nodes(cfg), cfg.fewest_ranks) == ("2-5", 5, 1)
    with pytest.raises(ConfigError, match="known once the job runs"):
        cfg.world_size  # noqa: B018
    params = executor_params(cfg, "/tmp/run")
    extra = params["additional_parameters"]
    assert (extra["nodes"], extra["ntasks"], extra["spread_job"]) == ("2-5", 5, True)
    assert "ntasks_per_node" not in params and "--ntasks-per-node=1" in params["srun_args"]
    with pytest.raises(ConfigError, match="this job has 5 trainer node"):
        cfg.resolve_trainer_nodes(5)
    cfg.resolve_trainer_nodes(3)
    assert (cfg.trainer.nodes, cfg.world_size) == (3, 3)
    fixed = config.load_dict({"model": {"path": "m"}, "trainer": {"nodes": 2}, "rollout": {"nodes": 1}})
    assert (nodes_request(fixed), executor_params(fixed, "/tmp/run")["nodes"]) == ("3", 3)


@pytest.mark.parametrize("override,message", [
    ("model.path=other", "model.path: the run's checkpoints were written with m, not other"),
    ("model.lora.rank=4", "model.lora: the run's checkpoints were written with no adapters, not adapters of rank 4 "
                          "on all-linear"),
    ("algorithm.name=ppo", "algorithm.name: the run's checkpoints were written with an algorithm without a critic, "
                           "not an algorithm with a critic"),
    ("trainer.zero_stage=2", "trainer.zero_stage: the run's checkpoints were written with ZeRO stage 3, not ZeRO "
                             "stage 2"),
])
def test_a_resume_cannot_change_what_the_checkpoint_holds(override, message):
    from hpc_rl.config.resume import check_resume

    spec = {"model": {"path": "m"}, "algorithm": {"name": "grpo"}}
    written = config.load_dict(spec)
    check_resume(written, config.load_dict(spec, ["trainer.nodes=2", "trainer.procs_per_node=1", "trainer.lr=1e-4"]))
    with pytest.raises(ConfigError) as e:
        check_resume(written, config.load_dict(spec, [override]))
    assert message in str(e.value) and "a resume cannot change it" in str(e.value)


def test_run_resume_refuses_a_changed_model_in_one_line(tmp_path):
    run = tmp_path / "runs" / "r-20261205-000000"
    run.mkdir(parents=True)
    (run / "job.yaml").write_text(config.dump(config.load_dict({"model": {"path": str(tmp_path)}})))
    r = subprocess.run([sys.executable, "-m", "hpc_rl.cli", "run", "x", "--resume", str(run), "model.lora.rank=8"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "model.lora: the run's checkpoints were written with no adapters" in r.stderr
    assert config.load(run / "job.yaml").model.lora is None  # the run's job is unchanged
