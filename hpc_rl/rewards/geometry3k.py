"""Geometry3K reward (verl's geo3k, https://github.com/volcengine/verl/blob/main/verl/utils/reward_score/geo3k.py):
0.9 x accuracy (the last `\\boxed{}` of the completion equals the ground truth) + 0.1 x format (`<think>...</think>`
then a `\\boxed{}` answer). Answers compare after the normalization of final answers that dapo_math uses (wrappers,
`$`, units, spaces), numbers as decimals; verl grades with mathruler, which also accepts some equivalent LaTeX forms.
"""

from __future__ import annotations

import re

from .dapo_math import _same, normalize_answer

FORMAT_WEIGHT = 0.1
_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (braces inside it matched), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def format_reward(completion: str) -> float:
    return 1.0 if _FORMAT.fullmatch(completion) else 0.0


def accuracy_reward(completion: str, ground_truth: str) -> float:
    answer = last_boxed(completion)
    return 1.0 if answer is not None and _same(normalize_answer(answer), normalize_answer(str(ground_truth))) else 0.0


def compute_score(prompt: str, completion: str, ground_truth: str, **_) -> float:
    return (1 - FORMAT_WEIGHT) * accuracy_reward(completion, ground_truth) + FORMAT_WEIGHT * format_reward(completion)
