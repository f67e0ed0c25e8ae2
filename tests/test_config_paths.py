"""Relative paths in a job file resolve against the job file, overrides' against the shell's directory, and every
shipped job loads from an empty directory with the paths it names found."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hpc_rl import config
from hpc_rl.cluster.sweep import load_sweep
from hpc_rl.config.paths import PATH_KEYS, SFT_PREFIX
from hpc_rl.data.datasets import load_rows
from hpc_rl.errors import DataError
from hpc_rl.models.sft_built import parse

from .runs import hpc_rl

REPO = Path(__file__).resolve().parents[1]
TOY_JOBS = sorted((REPO / "jobs").glob("toy-*.yaml"))


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """(the job file's directory with a data file and a model folder in it, an empty current directory)."""
    jobs, cwd = tmp_path / "project", tmp_path / "shell"
    (jobs / "data").mkdir(parents=True)
    (jobs / "data" / "train.jsonl").write_text(json.dumps({"prompt": "copy 3 :", "ground_truth": "3"}) + "\n")
    (jobs / "model").mkdir()
    (jobs / "model" / "config.json").write_text("{}")
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return jobs, cwd


def _job(jobs: Path, **sections) -> Path:
    spec = {"name": "t", "model": {"path": "model"}, "data": {"source": "data/train.jsonl"}, **sections}
    path = jobs / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_job_files_relative_paths_resolve_against_its_directory(dirs):
    jobs, cwd = dirs
    cfg = config.load(_job(jobs, eval={"source": "data/train.jsonl"}))
    assert cfg.model.path == str(jobs / "model")
    assert cfg.data.source == cfg.eval.source == str(jobs / "data" / "train.jsonl")
    assert load_rows(cfg.data, 1)[0]["prompt"] == "copy 3 :"
    # the resolved job (what a run writes as job.yaml) means the same from any directory
    again = jobs / "copy" / "job.yaml"
    again.parent.mkdir()
    again.write_text(config.dump(cfg))
    assert config.to_dict(config.load(again)) == config.to_dict(cfg)


def test_overrides_resolve_against_the_current_directory(dirs):
    jobs, cwd = dirs
    (cwd / "mine.jsonl").write_text(json.dumps({"prompt": "copy 5 :"}) + "\n")
    cfg = config.load(_job(jobs), ["data.source=mine.jsonl", "model.path=model"])
    assert cfg.data.source == str(cwd / "mine.jsonl")
    # typed in the shell: found nowhere, it is named beside the shell's directory (not the job file's)
    assert cfg.model.path == str(cwd / "model")
    cfg = config.load(_job(jobs), [f"data.source={jobs / 'data' / 'train.jsonl'}", "trainer.lr=1e-5"])
    assert cfg.data.source == str(jobs / "data" / "train.jsonl") and cfg.trainer.lr == 1e-5


def test_a_missing_file_is_named_where_it_was_looked_for(dirs):
    jobs, _ = dirs
    cfg = config.load(_job(jobs, data={"source": "data/missing.jsonl"}))
    with pytest.raises(DataError, match=f"data.source: {jobs / 'data' / 'missing.jsonl'} not found"):
        load_rows(cfg.data, 1)


def test_names_that_are_not_paths_stay_as_written(dirs):
    jobs, _ = dirs
    (jobs / "saved").mkdir()
    cfg = config.load(_job(jobs, data={"source": "hf:openai/gsm8k"}, eval={"source": "hf:saved"},
                           logging={"mlflow": {"tracking_uri": "sqlite:///mlflow.db"}}))
    assert cfg.data.source == "hf:openai/gsm8k" and cfg.eval.source == f"hf:{jobs / 'saved'}"
    assert cfg.logging.mlflow.tracking_uri == "sqlite:///mlflow.db"
    for source in ("toy:copy_digit", "reasoning_gym:chain_sum", "verifiers:reverse-text"):
        assert config.load(_job(jobs, data={"source": source})).data.source == source
    cfg = config.load(_job(jobs, logging={"mlflow": {"tracking_uri": "mlruns"}}))
    assert cfg.logging.mlflow.tracking_uri == str(jobs / "mlruns")


def test_sft_specs_resolve_the_job_they_name_with_the_checkout_as_fallback(dirs):
    jobs, _ = dirs
    (jobs / "sft.yaml").write_text("name: s\n")
    cfg = config.load(_job(jobs, model={"path": "sft:sft.yaml@4"},
                           services={"teacher": {"path": "sft:jobs/toy-sft-cpu.yaml"}},
                           algorithm={"distill": {"coef": 1.0}}))
    assert cfg.model.path == f"sft:{jobs / 'sft.yaml'}@4"
    assert cfg.services.teacher.path == f"sft:{REPO / 'jobs' / 'toy-sft-cpu.yaml'}"
    assert parse(cfg.model.path, "model.path") == (jobs / "sft.yaml", 4)


def test_a_sweep_files_overrides_resolve_against_the_sweep_file(dirs):
    jobs, cwd = dirs
    _job(jobs, trainer={"device": "cpu"}, rollout={"engine": "hf"})
    (jobs / "data" / "other.jsonl").write_text(json.dumps({"prompt": "copy 4 :"}) + "\n")
    (jobs / "sweep.yaml").write_text(yaml.safe_dump({
        "base": "job.yaml", "overrides": ["model.path=model"],
        "grid": {"data.source": ["data/train.jsonl", "data/other.jsonl"]}}))
    spec = load_sweep(jobs / "sweep.yaml", ["trainer.lr=2e-5"])
    assert f"model.path={json.dumps(str(jobs / 'model'))}" in spec.overrides
    assert [pt.overrides["data.source"] for pt in spec.points] == [str(jobs / "data" / n)
                                                                    for n in ("train.jsonl", "other.jsonl")]
    assert [pt.label for pt in spec.points] == ["data.source=data/train.jsonl", "data.source=data/other.jsonl"]


@pytest.mark.parametrize("job", TOY_JOBS, ids=lambda p: p.stem)
def test_every_toy_job_loads_from_an_empty_directory_with_its_paths_found(job, dirs):
    cfg = config.load(job)
    values = config.to_dict(cfg)
    for key in PATH_KEYS:
        node = values
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, str) or node.startswith(("toy:", "reasoning_gym:", "verifiers:", "hf:")):
            continue
        if node.startswith(SFT_PREFIX):
            path, _ = parse(node, key)  # raises unless the SFT job exists
            config.load(path)
        else:
            assert Path(node).is_absolute() and Path(node).exists(), (key, node)


def test_doctor_checks_the_judge_job_from_an_empty_directory(dirs):
    """`hpc-rl doctor --job` reads the job's sft: models from the checkout, not from a jobs/ beside the shell."""
    _, cwd = dirs
    p = hpc_rl("doctor", "--job", REPO / "jobs" / "toy-judge-cpu.yaml", "--json", cwd=cwd, timeout=300)
    checks = {c["name"]: c for c in json.loads(p.stdout)["checks"]}
    assert checks["job:model"]["status"] == "ok", checks["job:model"]
    assert "toy-sft-cpu.yaml (4 steps)" in checks["job:model"]["message"], checks["job:model"]
