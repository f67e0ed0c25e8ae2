"""GSM8K reward (verl-compatible `#### answer` parsing) and `hpc-rl data gsm8k` on a fixture file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hpc_rl import cli
from hpc_rl.config import DataConfig, RewardConfig
from hpc_rl.data.datasets import load_rows
from hpc_rl.errors import DataError
from hpc_rl.rewards.base import compute_rewards, load_reward_fn
from hpc_rl.rewards.gsm8k import compute_score, extract_solution, ground_truth_of

FIXTURE = Path(__file__).parent / "data" / "gsm8k-fixture.jsonl"


@pytest.mark.parametrize("text,method,expected", [
    ("48/2 = 24\n#### 72", "strict", "72"),
    ("#### 1,425", "strict", "1425"),
    ("#### -5", "strict", "-5"),
    ("first #### 3 then #### 4", "strict", "4"),          # the last one counts
    ("The answer is 72.", "strict", None),                # strict needs '#### '
    ("####72", "strict", None),                           # verl's regex wants the space
    ("The answer is 72.", "flexible", "72"),
    ("costs $1,200 in total", "flexible", "1200"),
    ("no digits here", "flexible", None),
])
def test_extract_solution(text, method, expected):
    assert extract_solution(text, method) == expected


def test_only_the_last_300_characters_are_searched():
    early = "#### 7 " + "x" * 300
    assert extract_solution(early) is None
    assert extract_solution("x" * 1000 + "#### 7") == "7"


def test_compute_score():
    assert compute_score("q", "so 40-13 = 27\n#### 27", ground_truth="27") == 1.0
    assert compute_score("q", "#### 1,425", ground_truth="1425") == 1.0
    assert compute_score("q", "#### 72.0", ground_truth="72") == 1.0     # same number
    assert compute_score("q", "#### 28", ground_truth="27") == 0.0
    assert compute_score("q", "#### 28", ground_truth="27", format_score=0.1) == 0.1
    assert compute_score("q", "it is 27", ground_truth="27") == 0.0       # no '####': no score in strict
    assert compute_score("q", "it is 27", ground_truth="27", method="flexible") == 1.0


def test_ground_truth_of_answer_field():
    assert ground_truth_of("a\nb\n#### 1,425") == "1425"
    with pytest.raises(ValueError):
        ground_truth_of("no marker")


def test_prepare_fixture_then_reward_through_the_pipeline(tmp_path, capsys):
    out = tmp_path / "gsm8k"
    assert cli.main(["data", "gsm8k", str(out), "--source", str(FIXTURE)]) == 0
    assert "train: 8 rows" in capsys.readouterr().out
    rows = load_rows(DataConfig(source=str(out / "train.parquet")), 1)
    raw = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    assert len(rows) == len(raw) == 8
    by_q = {r["extra_info"]["question"]: r for r in rows}
    r = by_q[raw[2]["question"]]
    assert r["ground_truth"] == "1425" and r["data_source"] == "openai/gsm8k" and r["ability"] == "math"
    assert r["prompt"] == [{"role": "user", "content": raw[2]["question"] + " Let's think step by step and "
                            "output the final answer after \"####\"."}]
    # The reference solutions themselves score 1 through the project's reward path; a wrong one 0.
    fn = load_reward_fn("hpc_rl.rewards.gsm8k:compute_score")
    completions = [by_q[x["question"]]["extra_info"]["answer"] for x in raw]
    fields = [by_q[x["question"]] for x in raw]
    scores = compute_rewards(fn, RewardConfig(function="hpc_rl.rewards.gsm8k:compute_score"),
                             ["p"] * 8, completions, fields)
    assert scores.tolist() == [1.0] * 8
    wrong = compute_rewards(fn, RewardConfig(function="hpc_rl.rewards.gsm8k:compute_score"),
                            ["p"], ["#### 99999"], fields[:1])
    assert wrong.tolist() == [0.0]


def test_prepare_folder_with_both_splits(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(FIXTURE, src / "train.jsonl")
    (src / "test.jsonl").write_text("\n".join(FIXTURE.read_text().splitlines()[:3]) + "\n")
    assert cli.main(["data", "gsm8k", str(tmp_path / "out"), "--source", str(src)]) == 0
    printed = capsys.readouterr().out
    assert "train: 8 rows" in printed and "test: 3 rows" in printed
    test_rows = load_rows(DataConfig(source=str(tmp_path / "out" / "test.parquet")), 1)
    assert {r["extra_info"]["split"] for r in test_rows} == {"test"}


def test_prepare_rejects_rows_without_final_answer(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q?", "answer": "no marker"}) + "\n")
    with pytest.raises(DataError, match=r"row 0: the answer has no '#### NUMBER' line"):
        cli.dispatch(cli.build_parser().parse_args(["data", "gsm8k", str(tmp_path / "o"), "--source", str(bad)]))
    assert cli.main(["data", "gsm8k", str(tmp_path / "o"), "--source", str(tmp_path / "missing.jsonl")]) == 2
    assert "not found" in capsys.readouterr().err
