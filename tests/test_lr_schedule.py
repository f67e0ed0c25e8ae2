"""The learning-rate schedule (trainer.warmup_steps, lr_schedule, min_lr_ratio) against hand-computed values."""

import math
from pathlib import Path

import pytest

from hpc_rl.config import ConfigError, load
from hpc_rl.train.engines import lr_factor

REPO_JOB = Path(__file__).resolve().parent.parent / "jobs" / "toy-grpo-cpu.yaml"


def test_constant_with_warmup():
    assert [lr_factor(s, 4, 100, "constant", 0.0) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor(99, 0, 100, "constant", 0.5) == 1.0


def test_linear_decay_reaches_min_ratio_at_the_last_step():
    # 2 warm-up steps, then 9 steps from 1.0 down to 0.1: step 2 -> 1.0, step 10 -> 0.1
    assert lr_factor(1, 2, 11, "linear", 0.1) == 1.0
    assert lr_factor(2, 2, 11, "linear", 0.1) == 1.0
    assert lr_factor(6, 2, 11, "linear", 0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(10, 2, 11, "linear", 0.1) == pytest.approx(0.1)
    assert lr_factor(50, 2, 11, "linear", 0.1) == pytest.approx(0.1)  # past the end (a resumed, longer run)


def test_cosine_decay():
    assert lr_factor(0, 0, 5, "cosine", 0.0) == 1.0
    assert lr_factor(1, 0, 5, "cosine", 0.0) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_factor(2, 0, 5, "cosine", 0.0) == pytest.approx(0.5)
    assert lr_factor(4, 0, 5, "cosine", 0.2) == pytest.approx(0.2)


def test_optimizer_steps_and_validation():
    cfg = load(REPO_JOB, ["trainer.steps=10", "algorithm.ppo_epochs=2"])
    # 32 prompts x 8 samples / mini-batch 64 = 4 optimizer steps per epoch
    assert cfg.optimizer_steps == 10 * 2 * 4
    with pytest.raises(ConfigError, match="trainer.min_lr_ratio"):
        load(REPO_JOB, ["trainer.min_lr_ratio=1.5"])
    with pytest.raises(ConfigError, match="trainer.lr_schedule"):
        load(REPO_JOB, ["trainer.lr_schedule=step"])
