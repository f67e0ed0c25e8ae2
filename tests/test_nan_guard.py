"""A bad update never poisons the run: a non-finite loss or gradient norm skips that optimizer step at every ZeRO
stage; a policy that is not finite after its update is never pushed nor checkpointed; one that is finite in the
trainer but not on the servers stops the run as a model error, and `checkpoints/latest` rolls back to the newest
policy that generated finite samples."""

import math
import re

import pytest

from hpc_rl.metrics import read_metrics
from tests.runs import hpc_rl, only_run

from .test_pipeline import REPO, TOY

LORA_TOY = REPO / "jobs" / "toy-grpo-lora-cpu.yaml"
STAGE_0 = ["trainer.procs_per_node=1", "trainer.zero_stage=0"]
pytestmark = pytest.mark.slow


def error_line(r) -> str:
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    lines = [ln for ln in out.splitlines() if " error: " in ln or ln.startswith("error: ")]
    assert len(lines) == 1, lines
    return lines[0]


def served_versions(run) -> list[int]:
    """The policy versions the rollout server loaded (its log says so for every transport)."""
    return [int(v) for v in re.findall(r"weights: .*?policy_version (\d+)", (run / "logs" / "rollout-0.log").read_text())]


SKIP_LIMIT = ("3 optimizer steps in a row were skipped for a non-finite loss or gradient (the last at step 1; "
              "trainer.max_skipped_in_a_row 3); lower trainer.lr")
NOT_FINITE = "step 1: the policy is not finite after the update"


# One optimizer step per RL step at ZeRO-3: it applies (finite, absurd weights; nothing skipped), so the weights are
# gathered for the push and the check runs on rank 0's gathered copy (train/gathered_forward.py).
ONE_STEP = ["trainer.mini_batch_size=256"]


@pytest.mark.parametrize("job, layout, stops", [(TOY, STAGE_0, (SKIP_LIMIT, NOT_FINITE)), (LORA_TOY, [], (NOT_FINITE,)),
                                                (TOY, ONE_STEP, (NOT_FINITE,))],
                         ids=["stage0", "stage3-lora", "stage3-gathered"])
def test_a_diverged_update_stops_the_run_before_any_push_or_checkpoint(tmp_path, job, layout, stops):
    """lr 1e30: the first optimizer step applies (finite but absurd weights), the next ones overflow and are skipped.
    Under LoRA the check after the update finds the forward non-finite, and so it does at ZeRO-3 with one optimizer
    step a step (on the weights gathered for the push). At stage 0 (GuardedAdamW) the last 3 of step
    1's 4 optimizer steps are skipped, which is trainer.max_skipped_in_a_row; whether the check after the update
    finds the forward of those weights non-finite first depends on the CPU's float32 kernels (it does on an AVX-512
    Xeon, not on an AMD EPYC), so either guard may stop it (tests/test_pipeline.py pins the skip limit alone).
    Either way nothing of the update leaves the trainer."""
    r = hpc_rl("run", job, "trainer.lr=1e30", "trainer.steps=3", "checkpoint.every=1", *layout, cwd=tmp_path)
    line = error_line(r)
    stop = next((s for s in stops if s in line), None)
    assert stop is not None, line
    if stop == NOT_FINITE:
        assert "lr 1e+30" in line and "latest checkpoint: none" in line, line
        assert ("grad_norm inf" in line) == (layout != ONE_STEP), line  # one step: its gradient was finite
        assert line.endswith("lower trainer.lr (or check the reward scale)"), line
    run = only_run(tmp_path)
    assert served_versions(run) == [], "a version after the initial one reached the server"
    assert not (run / "checkpoints" / "latest").exists()
    assert not list(run.glob("checkpoints/step_*"))
    assert "not finite" not in (run / "logs" / "rollout-0.log").read_text()


def test_a_policy_not_finite_on_the_servers_rolls_latest_back_and_resumes(tmp_path):
    """A float16 server overflows on weights the float32 trainer computes with: version 2 (weights ~1.5, attention
    scores past 65504) is finite in the trainer, not on the server. Its checkpoint was written before anyone knew:
    it is set aside, `latest` names step_1, whose policy generated step 2's samples; resumed, it trains on."""
    slow_warmup = ["trainer.lr=25", "trainer.warmup_steps=50", "trainer.lr_schedule=constant",
                   "trainer.mini_batch_size=256", "rollout.dtype=float16", "checkpoint.every=1", "checkpoint.keep_last=8"]
    r = hpc_rl("run", TOY, "trainer.steps=6", *slow_warmup, cwd=tmp_path)
    line = error_line(r)
    assert "step 3: the policy is not finite on the rollout servers" in line, line
    assert "policy version 2 is not finite here: the model's logits are not finite" in line, line
    assert "latest checkpoint: step_1, rolled back from step_2 (kept as step_2.nonfinite)" in line, line
    assert "no rollout server answered" not in r.stdout + r.stderr
    run = only_run(tmp_path)
    ck = run / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step_1"
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_1", "step_2.nonfinite"]
    assert served_versions(run) == [1, 2]
    # The server's forward of step_1's policy is finite: resumed with a float32 server, step 2 trains and is kept.
    r2 = hpc_rl("run", TOY, "--resume", run, "trainer.steps=2", *slow_warmup[:-3], "rollout.dtype=float32",
                "checkpoint.every=1", cwd=tmp_path)
    assert r2.returncode == 0, (r2.stdout + r2.stderr)[-3000:]
    assert "resumed from" in r2.stdout and "step_1" in r2.stdout
    assert (ck / "latest").read_text().strip() == "step_2"
    assert [m["step"] for m in read_metrics(run / "metrics.jsonl")] == [1, 2]


@pytest.mark.parametrize("layout", [STAGE_0, []], ids=["stage0", "stage3"])
def test_a_nan_loss_skips_exactly_its_optimizer_step(tmp_path, layout):
    """The loss of RL step 2's third optimizer step (of 4) is made NaN on every rank: that step alone is skipped,
    the run goes on; grad_norm is reported (finite) at every stage otherwise."""
    r = hpc_rl("run", TOY, "trainer.steps=3", "checkpoint.every=0", *layout, cwd=tmp_path,
               env={"HPC_RL_INJECT_NAN_LOSS": "2:3"})
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "step 2: non-finite loss or gradient; 1 optimizer step(s) skipped (0 in a row at the step's end)" in r.stdout + r.stderr
    rows = read_metrics(only_run(tmp_path) / "metrics.jsonl")
    assert [m["skipped_updates"] for m in rows] == [0, 1, 0]
    assert math.isfinite(rows[0]["grad_norm"]) and math.isfinite(rows[2]["grad_norm"]), rows
    assert 0 < rows[0]["grad_norm"] and rows[1]["grad_norm_max"] == math.inf
