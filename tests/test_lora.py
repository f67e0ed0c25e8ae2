"""`hpc-rl run` of a LoRA job end to end (ZeRO-3 over 2 ranks, HF rollout server): the reference is the actor with
its adapters off (no reference engine), weight syncs push the adapters only and the servers serve what the actor
computes, checkpoints hold the adapters (not the frozen base) and resume exactly, and both export forms load
without hpc-rl."""

import json
from pathlib import Path

import pytest
import torch

from hpc_rl.metrics import read_metrics
from tests.runs import hpc_rl, only_run

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "jobs" / "toy-grpo-lora-cpu.yaml"
pytestmark = pytest.mark.slow
# A KL term, so that the reference (the actor with its adapters off) is used; a constant lr so that a resumed
# 4-step run continues like a 6-step run.
COMMON = ("algorithm.kl.coef=0.01", "trainer.lr_schedule=constant", "trainer.check_sync_every=1",
          "trainer.sync_tolerance=1e-4", "trainer.prompts_per_step=8", "trainer.mini_batch_size=32")


# Greedy evaluation of 6 toy prompts at steps 0, 2 and 4: the rollout server serves the adapted policy.
EVAL = ("eval.source=toy:repeat_digit", "eval.every=2", "eval.max_prompts=6")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("lora")
    r = hpc_rl("run", JOB, "trainer.steps=4", "checkpoint.every=2", *COMMON, *EVAL, cwd=cwd)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return cwd, only_run(cwd), r


def _base_bytes(run: Path) -> int:
    return sum(f.stat().st_size for f in (run / "model-init").glob("*.safetensors"))


def test_reference_is_the_actor_with_adapters_off_and_syncs_push_adapters(lora_run):
    _, run, r = lora_run
    assert "reference = the actor with its adapters off" in r.stdout
    assert "trainable parameters of" in r.stdout
    rows = read_metrics(run / "metrics.jsonl")
    assert [x["step"] for x in rows] == [1, 2, 3, 4]
    assert rows[-1]["kl"] > 0  # the adapters moved the policy away from the base
    base = _base_bytes(run)
    adapters = (run / "checkpoints" / "step_4" / "hf" / "adapter_model.safetensors").stat().st_size
    for x in rows:
        # the server serves what the actor computes, after each push of adapters only
        assert x["sync_max_diff"] is not None and x["sync_max_diff"] < 1e-4, x
        assert 0 < x["sync_bytes"] <= adapters and x["sync_bytes"] < 0.25 * base, (x["sync_bytes"], base)
    log = (run / "logs" / "rollout-0.log").read_text()
    assert "weight updates are LoRA adapters" in log


def test_checkpoint_holds_adapters_not_the_frozen_base(lora_run):
    _, run, _ = lora_run
    ck = run / "checkpoints" / "step_4"
    ds = sum(f.stat().st_size for f in (ck / "deepspeed").rglob("*.pt"))
    # adapters + their Adam moments and fp32 copies on 2 ranks; the base (frozen) is not in it
    assert ds < _base_bytes(run), (ds, _base_bytes(run))
    conf = json.loads((ck / "hf" / "adapter_config.json").read_text())
    assert conf["r"] == 16 and conf["base_model_name_or_path"] == str(run / "model-init")


def test_both_export_forms_load_without_hpc_rl(lora_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cwd, run, _ = lora_run
    r = hpc_rl("export", run.name, tmp_path / "adapter", "--adapter", cwd=cwd)
    assert r.returncode == 0 and "PEFT adapter folder" in r.stdout, r.stderr
    r = hpc_rl("export", run.name, tmp_path / "merged", "--step", "4", "--merged", cwd=cwd)
    assert r.returncode == 0 and "weights merged with their adapters" in r.stdout, r.stderr
    x = torch.tensor([[3, 4, 5, 6, 7, 8]])
    base = AutoModelForCausalLM.from_pretrained(run / "model-init").eval()
    with torch.no_grad():
        base_logits = base(x).logits
        peft = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        adapted = peft(input_ids=x).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(x).logits
    assert (adapted - base_logits).abs().max() > 1e-3  # it trained
    assert torch.allclose(merged, adapted, atol=1e-5), (merged - adapted).abs().max()
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    # a full fine-tuning run has no adapter; a non-empty folder is never overwritten
    r = hpc_rl("export", run.name, tmp_path / "merged", cwd=cwd)
    assert r.returncode == 2 and "exists and is not empty" in r.stderr


def test_offline_eval_of_a_lora_checkpoint_answers_as_the_run_did(lora_run):
    """`hpc-rl eval RUN --step 4` of a LoRA run serves the base with the checkpoint's adapters merged in (made for the
    evaluation, removed after it); greedy, it answers the held-out prompts as the run's server did at step 4 (the
    server merged the same adapters itself; one answer of six may differ where two tokens tie within rounding)."""
    cwd, run, _ = lora_run
    r = hpc_rl("eval", run.name, "--step", "4", cwd=cwd)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = read_metrics(run / "eval.jsonl")
    assert [(e["step"], e["source"]) for e in rows] == [(0, "train"), (2, "train"), (4, "train"), (4, "offline")]
    online = read_metrics(run / "eval" / "step_4.jsonl")
    offline = read_metrics(run / "eval" / "step_4.offline.jsonl")
    assert [x["prompt_id"] for x in online] == [x["prompt_id"] for x in offline]
    assert sum(a["completion"] == b["completion"] for a, b in zip(online, offline)) >= 5, (online, offline)
    assert not [p for p in (run / "eval").iterdir() if p.is_dir()]  # the merged folder and the server dir are gone


def test_resume_continues_exactly(lora_run, tmp_path_factory):
    cwd, run, _ = lora_run
    r = hpc_rl("run", JOB, "--resume", run, "trainer.steps=6", "checkpoint.every=2", *COMMON, cwd=cwd)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed from" in r.stdout and "step_4" in r.stdout
    resumed = read_metrics(run / "metrics.jsonl")
    cwd2 = tmp_path_factory.mktemp("lora-straight")
    r2 = hpc_rl("run", JOB, "trainer.steps=6", "checkpoint.every=0", *COMMON, cwd=cwd2)
    assert r2.returncode == 0, r2.stdout[-3000:] + r2.stderr[-3000:]
    straight = read_metrics(only_run(cwd2) / "metrics.jsonl")
    assert [x["step"] for x in resumed] == [1, 2, 3, 4, 5, 6] == [x["step"] for x in straight]
    for a, b in zip(resumed, straight):
        assert a["prompt_ids"] == b["prompt_ids"]
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], abs=1e-9), a["step"]
        assert a["kl"] == pytest.approx(b["kl"], abs=1e-7), a["step"]
