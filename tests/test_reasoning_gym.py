"""reasoning-gym tasks as prompts and rewards (the package's own generators and scorers, offline): the items' own
answers score 1.0 through hpc-rl's reward function, wrong ones less; bad task names and configs are one-line errors
naming the key; the GPU recipe's mix loads."""

from pathlib import Path

import pytest

from hpc_rl import config
from hpc_rl.config import DataConfig
from hpc_rl.data.datasets import load_rows
from hpc_rl.errors import DataError
from hpc_rl.rewards.base import compute_rewards
from hpc_rl.rewards.reasoning_gym import score

REPO = Path(__file__).resolve().parents[1]

RECIPE = REPO / "jobs" / "qwen2.5-1.5b-reasoning-gym.yaml"
TASKS = config.load(RECIPE).data.source.split(":", 1)[1].split(",")


def _rows(source: str, **kwargs) -> list[dict]:
    return load_rows(DataConfig(source=source, kwargs={"size": 12, **kwargs}), seed=3)


def _extra(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "prompt"}


@pytest.mark.parametrize("task", TASKS)
def test_each_task_of_the_recipe_scores_its_own_answers_1_and_wrong_ones_less(task):
    rows = _rows(f"reasoning_gym:{task}")
    assert len(rows) == 12
    for row in rows:
        assert row["prompt"][0]["role"] == "system" and row["prompt"][1]["content"] == row["reasoning_gym"]["question"]
        right = f"thinking...\n<answer>{row['ground_truth']}</answer>"
        assert score(row["prompt"], right, **_extra(row)) == 1.0, (task, row["ground_truth"])
        assert score(row["prompt"], "<answer>no idea</answer>", **_extra(row)) < 1.0
        assert score(row["prompt"], row["ground_truth"], **_extra(row)) == 0.0  # no <answer> tag
        assert score(row["prompt"], row["ground_truth"], answer_tag=None, **_extra(row)) == 1.0


def test_a_mix_seeds_and_the_reward_path():
    mix = _rows("reasoning_gym:leg_counting,basic_arithmetic", weights={"leg_counting": 1.0, "basic_arithmetic": 3.0})
    kinds = {r["reasoning_gym"]["metadata"]["source_dataset"] for r in mix}
    assert kinds == {"leg_counting", "basic_arithmetic"}
    assert _rows("reasoning_gym:leg_counting") == _rows("reasoning_gym:leg_counting")  # seeded
    assert _rows("reasoning_gym:leg_counting") != _rows("reasoning_gym:leg_counting", seed=4)
    held_out = load_rows(DataConfig(source="reasoning_gym:leg_counting", kwargs={"size": 12}), seed=3, section="eval")
    assert [r["prompt"] for r in held_out] != [r["prompt"] for r in _rows("reasoning_gym:leg_counting")]
    plain = _rows("reasoning_gym:leg_counting", system_prompt=None)
    assert isinstance(plain[0]["prompt"], str)
    cfg = config.load(RECIPE).reward
    completions = [f"<answer>{r['ground_truth']}</answer>" if i % 2 else "<answer>0</answer>" for i, r in enumerate(mix)]
    got = compute_rewards(score, cfg, [r["prompt"] for r in mix], completions, mix)
    assert [x == 1.0 for x in got[1::2]] == [True] * 6 and all(x < 1.0 for x in got[0::2])


@pytest.mark.parametrize("source,kwargs,message", [
    ("reasoning_gym:leg_countin", {}, "data.source: unknown reasoning-gym task 'leg_countin'; did you mean leg_counting"),
    ("reasoning_gym:", {}, "data.source: reasoning_gym: names no task"),
    ("reasoning_gym:leg_counting", {"bogus": 1}, "data.kwargs: reasoning-gym 'leg_counting' refused its config: TypeError"),
    ("reasoning_gym:leg_counting", {"size": 0}, "data.kwargs.size: expected a positive integer"),
    ("reasoning_gym:leg_counting,basic_arithmetic", {"chain_sum": {}}, "data.kwargs.chain_sum: not a task of the mix"),
])
def test_bad_tasks_and_configs_are_one_line_errors_naming_the_key(source, kwargs, message):
    with pytest.raises(DataError) as e:
        load_rows(DataConfig(source=source, kwargs=kwargs), seed=1)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
