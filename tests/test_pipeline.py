"""`hpc-rl run` end to end on this machine: ZeRO-3 over 2 ranks, HF rollout server, weight sync checked
every step, checkpoints (HF + DeepSpeed), export, resume with the same data order and the same results; held-out
evaluation during the run (eval.jsonl, best checkpoint) and offline (`hpc-rl eval`), which changes no training sample."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpc_rl import config
from hpc_rl.data.sampler import indices_for_step
from hpc_rl.eval.pass_at_k import pass_at_k
from hpc_rl.metrics import read_metrics
from tests.runs import hpc_rl, only_run

from . import golden_samples

REPO = Path(__file__).resolve().parent.parent
TOY = REPO / "jobs" / "toy-grpo-cpu.yaml"
pytestmark = pytest.mark.slow


# Evaluation in the short run: 8 of the toy prompts, 2 samples each (pass@1 and pass@2), at steps 0, 2, 4 (and 6
# after the resume); a sample passes with 2 of its 4 digits right; the best eval/reward_mean keeps its checkpoint.
EVAL = ["eval.source=toy:repeat_digit", "eval.every=2", "eval.max_prompts=8", "eval.samples_per_prompt=2",
        "eval.temperature=1.0", "eval.pass_threshold=0.5", "checkpoint.keep_best=eval/reward_mean"]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """4 steps, checkpoints at 2 and 4, sync check after every push, evaluations at 0, 2 and 4."""
    cwd = tmp_path_factory.mktemp("short")
    # A constant lr: a decay spans trainer.steps, so a 4-step run resumed to 6 would not match a 6-step run.
    r = hpc_rl("run", TOY, "trainer.steps=4", "checkpoint.every=2", "trainer.check_sync_every=1", "trainer.lr_schedule=constant",
               "trainer.sync_tolerance=1e-4", *EVAL, cwd=cwd)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return cwd, only_run(cwd), r


def test_samples_and_evaluations_equal_the_golden_ones(short_run):
    """GRPO with evaluations at steps 0, 2 and 4 (tests/golden_samples.py)."""
    golden_samples.check("toy-grpo-eval-short", short_run[1], steps=4)


def test_one_line_per_step_from_rank_0(short_run):
    _, _, r = short_run
    lines = [ln for ln in r.stdout.splitlines() if " step " in ln and "/4 |" in ln]
    assert len(lines) == 4, r.stdout
    for key in ("reward", "kl", "pg_loss", "entropy", "grad", "s/step", "wait s", "rollout idle s", "gen tok/s",
                "elapsed", "eta"):
        assert key in lines[0]
    assert "elapsed" in lines[-1] and "eta" not in lines[-1]  # nothing left to estimate after the last step
    summary = [ln for ln in r.stdout.splitlines() if "summary: " in ln]
    assert "summary: 4 steps in " in summary[0] and "over the last 4" in summary[0], summary
    assert any("`hpc-rl plot " in ln for ln in summary), summary
    assert "[rank 1]" not in r.stdout


def test_evaluations_at_start_every_and_end_with_per_sample_results(short_run):
    _, run, r = short_run
    # The toy eval prompts are training prompts too: said at load, once.
    assert r.stdout.count("eval.source toy:repeat_digit shares") + r.stderr.count("eval.source toy:repeat_digit shares") == 1
    rows = read_metrics(run / "eval.jsonl")
    assert [e["step"] for e in rows] == [0, 2, 4]
    for e in rows:
        assert e["policy_version"] == e["step"] and e["source"] == "train" and e["k"] == 2
        assert (e["temperature"], e["pass_threshold"], e["eval/prompts"]) == (1.0, 0.5, 8)
        assert set(k for k in e if k.startswith("eval/")) == {
            "eval/reward_mean", "eval/mean@2", "eval/pass@1", "eval/pass@2", "eval/response_tokens_mean",
            "eval/truncated_frac", "eval/seconds", "eval/prompts"}
        # The metrics are recomputed from the per-sample file: 8 prompts x 2 samples, in prompt order.
        samples = read_metrics(run / "eval" / f"step_{e['step']}.jsonl")
        assert len(samples) == 16 and set(samples[0]) == {"prompt_id", "prompt", "completion", "score", "truncated"}
        scores = [x["score"] for x in samples]
        assert e["eval/reward_mean"] == pytest.approx(sum(scores) / 16)
        passes = [sum(s >= 0.5 for s in scores[i:i + 2]) for i in range(0, 16, 2)]
        assert e["eval/pass@1"] == pytest.approx(sum(pass_at_k(2, c, 1) for c in passes) / 8)
        assert e["eval/pass@2"] == pytest.approx(sum(c > 0 for c in passes) / 8)
        assert e["eval/truncated_frac"] == pytest.approx(sum(x["truncated"] for x in samples) / 16)
    # The prompts are a fixed subset: the same at every step.
    assert len({tuple(x["prompt_id"] for x in read_metrics(run / "eval" / f"step_{s}.jsonl")) for s in (0, 2, 4)}) == 1
    # The metrics rows of steps 2 and 4 carry them (TensorBoard and the trackers follow), the step line too.
    m = {x["step"]: x for x in read_metrics(run / "metrics.jsonl")}
    assert m[2]["eval/step"] == 2 and m[2]["eval/pass@1"] == rows[1]["eval/pass@1"]
    assert m[1]["eval/step"] == 0 and "eval/step" not in m[3]  # the baseline joins step 1's row
    assert any("eval pass@1" in ln and " step 4/4 " in ln for ln in r.stdout.splitlines()), r.stdout[-2000:]


def test_best_checkpoint_is_kept_and_linked(short_run, tmp_path):
    cwd, run, _ = short_run
    rows = read_metrics(run / "eval.jsonl")
    best = max(rows, key=lambda e: e["eval/reward_mean"])  # the first of equal ones: a later one must be better
    rec = json.loads((run / "checkpoints" / "best.json").read_text())
    assert (rec["step"], rec["metric"], rec["mode"]) == (best["step"], "eval/reward_mean", "max")
    link = run / "checkpoints" / "best"
    out = tmp_path / "best"
    r = hpc_rl("export", run.name, out, "--best", cwd=cwd)
    if best["step"] == 0:  # the initial policy has no checkpoint
        assert not link.exists() and r.returncode == 2, r.stderr
        assert "the best evaluation is step 0's, of the initial policy (model.path), which no step improved on" in r.stderr
    else:
        assert link.is_symlink() and os.readlink(link) == f"step_{best['step']}"
        assert r.returncode == 0, r.stderr
        assert (out / "model.safetensors").read_bytes() == (link / "hf" / "model.safetensors").read_bytes()


def test_offline_eval_of_a_checkpoint_equals_the_evaluation_during_training(short_run):
    """`hpc-rl eval RUN --step 2` starts its own server on the checkpoint: same seeds, same samples, same numbers."""
    cwd, run, _ = short_run
    r = hpc_rl("eval", run.name, "--step", "2", cwd=cwd)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "step 2: pass@1 " in r.stdout
    rows = read_metrics(run / "eval.jsonl")
    online = [e for e in rows if e["step"] == 2 and e["source"] == "train"]
    offline = [e for e in rows if e["step"] == 2 and e["source"] == "offline"]
    assert len(online) == len(offline) == 1
    skip = {"source", "time", "eval/seconds"}
    assert {k: v for k, v in offline[0].items() if k not in skip} == {k: v for k, v in online[0].items() if k not in skip}
    assert read_metrics(run / "eval" / "step_2.offline.jsonl") == read_metrics(run / "eval" / "step_2.jsonl")
    assert not [p for p in (run / "eval").iterdir() if p.is_dir()]  # its scratch server dir is gone
    bad = hpc_rl("eval", run.name, "--step", "3", cwd=cwd)
    assert bad.returncode == 2 and "no complete checkpoint for step 3; available steps: 2, 4" in bad.stderr
    bad = hpc_rl("eval", run.name, "trainer.lr=1", cwd=cwd)
    assert bad.returncode == 2 and "takes eval.* and rollout.* overrides only" in bad.stderr
    bad = hpc_rl("eval", run.name, "eval.source=missing.jsonl", cwd=cwd)
    assert bad.returncode == 2 and "eval.source: " in bad.stderr and "/missing.jsonl not found" in bad.stderr
    assert len(read_metrics(run / "eval.jsonl")) == 4  # the bad calls wrote nothing

    # An HF folder with a job spec: its own run dir, evaluated as step 0; here step 4's weights.
    out = cwd / "folder-evals"
    r = hpc_rl("eval", run / "checkpoints" / "step_4" / "hf", "--job", TOY, f"output_dir={out}", *EVAL[:-1], cwd=cwd)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (folder_run,) = list(out.iterdir())
    (row,) = read_metrics(folder_run / "eval.jsonl")
    (at4,) = [e for e in rows if e["step"] == 4]
    assert (row["step"], row["source"]) == (0, "offline")
    # The seeds follow the step evaluated: the same samples need eval_seed of step 4, so only the prompts agree here.
    got = [x["prompt_id"] for x in read_metrics(folder_run / "eval" / "step_0.offline.jsonl")]
    assert got == [x["prompt_id"] for x in read_metrics(run / "eval" / "step_4.jsonl")]
    assert at4["eval/prompts"] == row["eval/prompts"] == 8


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


@pytest.fixture(scope="module")
def straight6(tmp_path_factory):
    """The uninterrupted 6-step run of the short run's seed (2 ranks), without checkpoints."""
    cwd = tmp_path_factory.mktemp("straight")
    r = hpc_rl("run", TOY, "trainer.steps=6", "checkpoint.every=0", "trainer.lr_schedule=constant", cwd=cwd)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return read_metrics(only_run(cwd) / "metrics.jsonl")


def test_a_checkpoint_of_two_ranks_resumes_on_one(short_run, straight6, tmp_path):
    """The short run's step-4 checkpoint (2 ZeRO-3 ranks) resumed by `hpc-rl run --resume RUN
    trainer.procs_per_node=1`: the optimizer state is re-partitioned (logged with both sizes; the exact equality of
    the moments is test_reshape's), step 5 generates the straight run's samples (its weights are the checkpoint's),
    and its updates are the straight run's up to float32 summation order (one rank sums what two summed and
    all-reduced: gradient norms within 1e-6 relative; ~1e-8 measured)."""
    import shutil

    _, original, _ = short_run
    run = tmp_path / original.name
    shutil.copytree(original, run, ignore=shutil.ignore_patterns("step_6", "universal"))
    for f in (run / "job.yaml", run / "checkpoints" / "latest"):
        f.write_text(f.read_text().replace(str(original), str(run)).replace("step_6", "step_4"))
    r = hpc_rl("run", TOY, "--resume", run, "trainer.steps=6", "trainer.procs_per_node=1", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "checkpoint written by 2 trainer rank(s), resumed on 1: the optimizer state of actor re-partitioned " \
        "through DeepSpeed's universal checkpoint in " in r.stdout
    assert "1 trainer rank(s)" in r.stdout and "resumed from" in r.stdout and "step_4" in r.stdout
    assert (run / "checkpoints" / "step_4" / "universal" / "actor" / "state" / "zero").is_dir()
    assert config.load(run / "job.yaml").trainer.procs_per_node == 1
    rows = read_metrics(run / "metrics.jsonl")
    assert [x["step"] for x in rows] == [1, 2, 3, 4, 5, 6]
    five, want = rows[4], straight6[4]
    assert (five["samples_sha1"], five["reward_mean"], five["prompt_ids"]) == \
        (want["samples_sha1"], want["reward_mean"], want["prompt_ids"])
    # The optimizer steps of steps 5 and 6 are the straight run's: the same samples in the same mini-batches, the
    # loss weighted over all ranks (micro_batch_weight); the gradient norms differ by float32 summation order only.
    # (Per-micro-batch statistics such as policy_loss are averaged per rank first and do depend on the split.)
    for got, ref in zip(rows[4:], straight6[4:]):
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-6), (got["step"], got["grad_norm"], ref["grad_norm"])
    # Step 6's samples come from weights that equal the straight run's up to rounding: the same tokens.
    assert rows[5]["samples_sha1"] == straight6[5]["samples_sha1"]
    assert rows[5]["prompt_ids"] == straight6[5]["prompt_ids"]


def test_resume_continues_steps_data_order_and_results(short_run, straight6):
    """Resume the 4-step run to 6 steps; compare with an uninterrupted 6-step run of the same seed."""
    cwd, run, _ = short_run
    r = hpc_rl("run", TOY, "--resume", run, "trainer.steps=6", cwd=cwd)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed from" in r.stdout and "step_4" in r.stdout
    resumed = read_metrics(run / "metrics.jsonl")
    assert [x["step"] for x in resumed] == [1, 2, 3, 4, 5, 6]
    # The evaluation of step 4 is not made again; step 6's is added (besides the offline one of step 2).
    assert [(e["step"], e["source"]) for e in read_metrics(run / "eval.jsonl")] == [
        (0, "train"), (2, "train"), (4, "train"), (2, "offline"), (6, "train")]

    straight = straight6
    cfg = config.load(TOY)
    for a, b in zip(resumed, straight):
        assert a["prompt_ids"] == b["prompt_ids"]
        assert a["prompt_ids"] == indices_for_step(cfg.data.toy_size, cfg.trainer.prompts_per_step, cfg.seed,
                                                   a["step"] - 1)
    # Same seed, same first-step reward; and the resumed steps reproduce the uninterrupted run.
    assert resumed[0]["reward_mean"] == straight[0]["reward_mean"]
    for a, b in zip(resumed[4:], straight[4:]):
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], abs=1e-9)
    # Evaluation (on in the resumed run, off in the straight one) changes no training sample.
    assert [a["samples_sha1"] for a in resumed] == [b["samples_sha1"] for b in straight]


def huge_reward(prompt, completion, **_):
    """Finite for the validator, but overflows float32: every loss and gradient becomes non-finite."""
    return 1e300


def test_nonfinite_steps_are_skipped_then_stop_the_run(tmp_path):
    """Every optimizer step of step 1 (4 of them) has a non-finite loss: each is skipped, the weights stay the
    initial ones (so the policy check passes), and trainer.max_skipped_in_a_row (3) stops the run after the step."""
    env_path = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    r = subprocess.run([sys.executable, "-m", "hpc_rl.cli", "run", str(REPO / "jobs" / "toy-ppo-cpu.yaml"),
                        "trainer.steps=6", "checkpoint.every=0", "reward.function=tests.test_pipeline:huge_reward"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=900,
                       env=dict(os.environ, PYTHONPATH=env_path))
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "step 1: non-finite loss or gradient; 4 optimizer step(s) skipped (4 in a row at the step's end)" in out
    assert ("4 optimizer steps in a row were skipped for a non-finite loss or gradient (the last at step 1; "
            "trainer.max_skipped_in_a_row 3)") in out
    assert "Traceback" not in out
    run = only_run(tmp_path)
    init_like = read_metrics(run / "metrics.jsonl")
    assert [x["step"] for x in init_like] == [1]
    assert init_like[0]["skipped_updates"] == 4


FORMAT1 = REPO / "tests" / "fixtures" / "checkpoint-format1"


def test_a_checkpoint_of_an_earlier_version_resumes_exactly(tmp_path):
    """tests/fixtures/checkpoint-format1 is a run dir written by hpc-rl before the typed rollout batch (a 1-layer
    tiny model, 3 steps of async GRPO with reward normalization; its step_2 checkpoint holds step 3's batch, generated
    ahead, as a format-1 dict, and the shaper's running statistics). Resumed by this version, step 3 trains on that
    stored batch: its samples and reward are the original run's (its metrics.jsonl still has step 3)."""
    import secrets
    import shutil

    run = tmp_path / "runs" / "ckpt-v1-20261204-205842"
    shutil.copytree(FORMAT1, run)
    job = run / "job.yaml"
    job.write_text(job.read_text().replace("RUN_DIR", str(run)))
    (run / "token").write_text(secrets.token_hex(32))
    os.chmod(run / "token", 0o600)
    os.chmod(run, 0o700)
    original = read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in original] == [1, 2, 3]
    r = hpc_rl("run", job, "--resume", run, cwd=tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "resumed from" in r.stdout and "step 2, 1 batch(es) generated ahead" in r.stdout
    rows = read_metrics(run / "metrics.jsonl")
    assert [m["step"] for m in rows] == [1, 2, 3]
    for key in ("samples_sha1", "reward_mean", "prompt_ids", "policy_version"):
        assert rows[2][key] == original[2][key], key
