"""`hpc-rl run` end to end on this machine: ZeRO-3 over 2 ranks, HF rollout server, weight sync checked
every step, checkpoints (HF + DeepSpeed), export, resume with the same data order and the same results."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpc_rl import config
from hpc_rl.data.sampler import indices_for_step
from hpc_rl.metrics import read_metrics
from tests.runs import hpc_rl, only_run

REPO = Path(__file__).resolve().parent.parent
TOY = REPO / "jobs" / "toy-grpo-cpu.yaml"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """4 steps, checkpoints at 2 and 4, sync check after every push."""
    cwd = tmp_path_factory.mktemp("short")
    # A constant lr: a decay spans trainer.steps, so a 4-step run resumed to 6 would not match a 6-step run.
    r = hpc_rl("run", TOY, "trainer.steps=4", "checkpoint.every=2", "trainer.check_sync_every=1", "trainer.lr_schedule=constant",
               "trainer.sync_tolerance=1e-4", cwd=cwd)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return cwd, only_run(cwd), r


def test_one_line_per_step_from_rank_0(short_run):
    _, _, r = short_run
    lines = [ln for ln in r.stdout.splitlines() if " step " in ln and "/4 |" in ln]
    assert len(lines) == 4, r.stdout
    for key in ("reward", "kl", "pg_loss", "entropy", "grad", "s/step", "wait s", "rollout idle s", "gen tok/s"):
        assert key in lines[0]
    assert "[rank 1]" not in r.stdout


def test_run_dir_layout_and_permissions(short_run):
    _, run, _ = short_run
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    assert stat.S_IMODE((run / "token").stat().st_mode) == 0o600
    cfg = config.load(run / "job.yaml")  # fully resolved and loadable
    assert cfg.model.tiny is None and Path(cfg.model.path).is_dir()
    assert cfg.trainer.steps == 4
    for d in ("rendezvous", "logs", "checkpoints", "tensorboard"):
        assert (run / d).is_dir()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert (run / "rendezvous" / "done.json").is_file()


def test_metrics_and_weight_sync_equality(short_run):
    _, run, _ = short_run
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        # After each push the server's log-probs of a sample equal the actor's (fp32 both sides).
        assert r["sync_max_diff"] is not None and r["sync_max_diff"] < 1e-4, r
        assert r["policy_version"] == r["step"]
        assert 0.0 <= r["reward_mean"] <= 1.0
        assert r["sync_bytes"] > 0


def test_checkpoints_hf_folder_equals_deepspeed_state(short_run):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    _, run, _ = short_run
    ck = run / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step_4"
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step_")) == ["step_2", "step_4"]
    hf = AutoModelForCausalLM.from_pretrained(ck / "step_4" / "hf")  # plain transformers, no hpc-rl
    sd = get_fp32_state_dict_from_zero_checkpoint(str(ck / "step_4" / "deepspeed" / "actor"), tag="state")
    ds_model = AutoModelForCausalLM.from_pretrained(ck / "step_4" / "hf")
    missing, unexpected = ds_model.load_state_dict(sd, strict=False)
    assert not unexpected and not [m for m in missing if m != "lm_head.weight"]
    x = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        assert torch.allclose(hf(x).logits, ds_model(x).logits, atol=1e-6)
    init = AutoModelForCausalLM.from_pretrained(run / "model-init")
    with torch.no_grad():
        assert not torch.allclose(init(x).logits, hf(x).logits)  # it trained


def test_export_writes_a_loadable_model(short_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cwd, run, _ = short_run
    r = hpc_rl("export", run.name, tmp_path / "out", "--step", "2", cwd=cwd)
    assert r.returncode == 0, r.stderr
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    ids = tok("copy 3 :", return_tensors="pt")
    out = m.generate(**ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids["input_ids"].shape[1]
    r = hpc_rl("export", run.name, tmp_path / "out2", "--step", "3", cwd=cwd)
    assert r.returncode == 2 and "no checkpoint for step 3; available steps: 2, 4" in r.stderr
    r = hpc_rl("export", run.name, tmp_path / "out3", "--adapter", cwd=cwd)
    assert r.returncode == 2 and "trained all weights (no model.lora): there is no adapter to export" in r.stderr
    assert not (tmp_path / "out3").exists()


def test_resume_continues_steps_data_order_and_results(short_run, tmp_path_factory):
    """Resume the 4-step run to 6 steps; compare with an uninterrupted 6-step run of the same seed."""
    cwd, run, _ = short_run
    r = hpc_rl("run", TOY, "--resume", run, "trainer.steps=6", cwd=cwd)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed from" in r.stdout and "step_4" in r.stdout
    resumed = read_metrics(run / "metrics.jsonl")
    assert [x["step"] for x in resumed] == [1, 2, 3, 4, 5, 6]

    cwd2 = tmp_path_factory.mktemp("straight")
    r2 = hpc_rl("run", TOY, "trainer.steps=6", "checkpoint.every=0", "trainer.lr_schedule=constant", cwd=cwd2)
    assert r2.returncode == 0, r2.stdout[-3000:] + r2.stderr[-3000:]
    straight = read_metrics(only_run(cwd2) / "metrics.jsonl")
    cfg = config.load(TOY)
    for a, b in zip(resumed, straight):
        assert a["prompt_ids"] == b["prompt_ids"]
        assert a["prompt_ids"] == indices_for_step(cfg.data.toy_size, cfg.trainer.prompts_per_step, cfg.seed,
                                                   a["step"] - 1)
    # Same seed, same first-step reward; and the resumed steps reproduce the uninterrupted run.
    assert resumed[0]["reward_mean"] == straight[0]["reward_mean"]
    for a, b in zip(resumed[4:], straight[4:]):
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], abs=1e-9)


def huge_reward(prompt, completion, **_):
    """Finite for the validator, but overflows float32: every loss and gradient becomes non-finite."""
    return 1e300


def test_nonfinite_steps_are_skipped_then_stop_the_run(tmp_path):
    env_path = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    r = subprocess.run([sys.executable, "-m", "hpc_rl.cli", "run", str(REPO / "jobs" / "toy-ppo-cpu.yaml"),
                        "trainer.steps=6", "checkpoint.every=0", "reward.function=tests.test_pipeline:huge_reward"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=900,
                       env=dict(os.environ, PYTHONPATH=env_path))
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "non-finite loss or gradient; optimizer step skipped (1 in a row)" in out
    assert "3 steps in a row had a non-finite loss or gradient (last at step 3)" in out
    assert "Traceback" not in out
    run = only_run(tmp_path)
    init_like = read_metrics(run / "metrics.jsonl")
    assert [x["step"] for x in init_like] == [1, 2, 3]
    assert all(x["skipped_updates"] > 0 for x in init_like)
