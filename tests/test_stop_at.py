"""trainer.stop_at: the window's mean against each target, hand-computed; a metric the run does not log is a one-line
error naming the key; a resumed run's steps count. The toy learning tests stop with it (tests/test_toy_learning.py)."""

from pathlib import Path

import pytest

from hpc_rl import config
from hpc_rl.errors import ConfigError, TrainingError
from hpc_rl.stop_at import StopAt

JOB = Path(__file__).resolve().parent.parent / "jobs" / "toy-grpo-cpu.yaml"


def test_stops_when_every_windowed_mean_reaches_its_target():
    rule = StopAt({"reward_mean": 0.8, "calls": 0.9}, window=3)
    steps = [{"reward_mean": 0.7, "calls": 1.0}, {"reward_mean": 0.9, "calls": 1.0}, {"reward_mean": 0.8, "calls": 1.0},
             {"reward_mean": 0.8, "calls": 0.6}, {"reward_mean": 0.8, "calls": 1.0}, {"reward_mean": 0.8, "calls": 1.0}]
    got = [rule.reached(m) for m in steps]
    # step 3: reward (0.7 + 0.9 + 0.8) / 3 = 0.8 >= 0.8 and calls 1.0; but steps 1-2 are short of the window
    assert got[:2] == [None, None]
    assert got[2] == "reward_mean 0.800 >= 0.8, calls 1.000 >= 0.9 over the last 3 steps"
    # step 4: calls (1 + 1 + 0.6) / 3 = 0.867 < 0.9; step 5: 0.867 again; step 6: (0.6 + 1 + 1) / 3 again < 0.9
    assert got[3:] == [None, None, None]
    assert StopAt({"reward_mean": 0.8}, 1).reached({"reward_mean": 0.79}) is None


def test_a_resumed_run_counts_its_earlier_steps_and_skips_non_finite_values():
    rule = StopAt({"reward_mean": 0.5}, 2, history=[{"step": 1, "reward_mean": 0.2}, {"step": 2, "reward_mean": 0.9}])
    assert rule.reached({"reward_mean": float("nan")}) is not None  # (0.2 + 0.9) / 2 = 0.55: NaN is not counted
    assert StopAt({"reward_mean": 0.5}, 2, history=[{"reward_mean": 0.0}]).reached({"reward_mean": 0.9}) is None


def test_a_metric_the_run_does_not_log_names_the_key_and_what_it_logs():
    with pytest.raises(TrainingError, match=r"trainer.stop_at: this run does not log the metric 'rewardmean'; name one "
                                            r"it logs \(kl, reward_mean\)"):
        StopAt({"rewardmean": 0.8}, 5).reached({"reward_mean": 0.1, "kl": 0.0, "sample": "text"})


@pytest.mark.parametrize("override,match", [
    ("trainer.stop_at={reward_mean: high}", "trainer.stop_at must map metric names to numbers"),
    ("trainer.stop_at={reward_mean: .nan}", "trainer.stop_at must map metric names to numbers"),
    ("trainer.stop_window=0", "trainer.stop_window must be >= 1; got 0"),
])
def test_bad_values_are_config_errors(override, match):
    with pytest.raises(ConfigError, match=match):
        config.load(JOB, [override])


def test_dotted_override_sets_one_target():
    assert config.load(JOB, ["trainer.stop_at.reward_mean=0.8"]).trainer.stop_at == {"reward_mean": 0.8}
