"""DAPO-Math reward: +1 when the answer after the last `Answer:` equals the ground truth, else -1 (DAPO's
rule-based reward, Yu et al. 2025, eq. 1, https://arxiv.org/abs/2503.14476; its prompts end with "...the last line
of your response should be of the form Answer: $Answer"). As verl's math_dapo.compute_score, answers compare
after the usual normalization of final answers (Lewkowycz et al. 2022, Minerva, appendix D): `$`, `\\boxed{}`,
`\\text{}`, units words, spaces and a trailing period go; numbers compare as decimals.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# Only the end of a long completion is read (verl reads its last 300 characters).
ANSWER_CLIP_CHARS = 300
_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_WRAPPERS = re.compile(r"\\(?:boxed|text|textbf|mathrm)\{((?:[^{}]|\{[^{}]*\})*)\}")
_UNITS = ("square units", "units", "degrees", "dollars", "cm", "inches", "meters")


def normalize_answer(text: str) -> str:
    """A final answer in a comparable form: wrappers unwrapped, `$`, spaces, units and a trailing period removed."""
    s = text.strip()
    for _ in range(3):  # nested \\boxed{\\text{...}}
        s = _WRAPPERS.sub(r"\1", s)
    s = s.replace("$", "").replace("\\!", "").replace("\\,", "").replace("\\ ", "").replace("dfrac", "frac")
    for unit in _UNITS:
        s = re.sub(rf"\s*{unit}$", "", s)
    s = s.strip().rstrip(".").replace(" ", "")
    if re.fullmatch(r"-?[0-9,]+(\.[0-9]+)?", s):
        s = s.replace(",", "")
    return s


def extract_answer(completion: str) -> str | None:
    """The normalized text after the last `Answer:` in the completion's end, or None when there is none."""
    tail = completion[-ANSWER_CLIP_CHARS:]
    found = _ANSWER.findall(tail)
    return normalize_answer(found[-1]) if found else None


def _same(a: str, b: str) -> bool:
    try:
        return Decimal(a) == Decimal(b)
    except InvalidOperation:
        return a == b


def compute_score(prompt: str, completion: str, ground_truth: str, **_) -> float:
    """+1.0 when the completion's answer equals `ground_truth` (normalized), else -1.0 (none given included)."""
    answer = extract_answer(completion)
    return 1.0 if answer is not None and _same(answer, normalize_answer(str(ground_truth))) else -1.0
