"""pass@k and the other evaluation metrics against hand-computed values and brute force."""

from __future__ import annotations

import itertools
import math

import pytest

from hpc_rl.eval.pass_at_k import eval_metrics, k_values, pass_at_k


def test_pass_at_k_by_hand():
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    # k=1 is the fraction of passing samples
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    # every draw of 4 from 5 holds one of the 2 passes
    assert pass_at_k(5, 2, 4) == 1.0
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6])
def test_pass_at_k_is_the_expectation_over_every_subset_of_k_samples(n):
    for c in range(n + 1):
        samples = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            brute = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_stays_finite_for_large_n():
    v = pass_at_k(1000, 1, 500)
    assert v == pytest.approx(0.5) and math.isfinite(v)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_k_values():
    assert k_values(1) == [1]
    assert k_values(4) == [1, 2, 4]
    assert k_values(6) == [1, 2, 4, 6]


def test_eval_metrics_by_hand():
    # two prompts, 4 samples each; threshold 1.0: prompt A passes 2 of 4, prompt B none (0.5 < 1.0)
    m = eval_metrics([[1.0, 0.0, 1.0, 0.0], [0.5, 0.5, 0.0, 0.0]], 1.0)
    assert m["eval/reward_mean"] == pytest.approx(3.0 / 8)
    assert m["eval/mean@4"] == pytest.approx((0.5 + 0.25) / 2)
    assert m["eval/pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert m["eval/pass@2"] == pytest.approx((1 - 1 / 6 + 0.0) / 2)  # 1 - C(2,2)/C(4,2)
    assert m["eval/pass@4"] == pytest.approx(0.5)
    assert set(m) == {"eval/reward_mean", "eval/mean@4", "eval/pass@1", "eval/pass@2", "eval/pass@4"}
    # a lower threshold lets 0.5 pass
    assert eval_metrics([[0.5]], 0.5)["eval/pass@1"] == 1.0


def test_a_best_evaluation_at_step_0_names_the_initial_policy(tmp_path):
    """No step improved on the initial policy: there is no checkpoint to link, and export --best says why instead
    of claiming a checkpoints/best that does not exist."""
    from hpc_rl.checkpoints import record_eval
    from hpc_rl.errors import CheckpointError
    from hpc_rl.rundir import RunDir
    from hpc_rl.train.export import best_step

    run = RunDir(tmp_path / "run")
    assert record_eval(run, {"step": 0, "eval/pass@1": 0.5}, "eval/pass@1", "max")
    assert not record_eval(run, {"step": 10, "eval/pass@1": 0.25}, "eval/pass@1", "max")
    assert not (run.checkpoints / "best").exists()
    with pytest.raises(CheckpointError, match="the best evaluation is step 0's, of the initial policy"):
        best_step(run)


def test_step_line_durations():
    from hpc_rl.metrics import duration, format_step_line

    assert [duration(x) for x in (4.4, 125, 3 * 3600 + 7 * 60 + 30)] == ["4s", "2m05s", "3h07m"]
    assert format_step_line(3, 10, {}, 30.0, 70.0) == "step 3/10 | elapsed 30s | eta 1m10s"
    assert format_step_line(10, 10, {}, 100.0, 0.0) == "step 10/10 | elapsed 1m40s"


def test_run_summary_from_the_run_dir(tmp_path):
    import json

    from hpc_rl.checkpoints import record_eval
    from hpc_rl.run_summary import summary_lines
    from hpc_rl.rundir import RunDir

    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    rows = [{"step": s, "reward_mean": r} for s, r in enumerate([0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.0], start=1)]
    (run.root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    record_eval(run, {"step": 0, "eval/pass@1": 0.5}, "eval/pass@1", "max")
    lines = summary_lines(run, 125.0)
    assert lines[0] == "summary: 7 steps in 2m05s; reward 0.000 at step 1, 0.760 over the last 5"
    assert lines[1] == "summary: best eval/pass@1 0.5000 at step 0 (the initial policy (model.path))"
    assert lines[2].startswith("summary: no checkpoint kept")
