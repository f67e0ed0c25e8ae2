"""GSM8K reward: exact match of the final number, with verl's `#### answer` parsing.

`strict` (verl's default) reads the number after the last `#### ` in the last 300 characters of the
completion; `flexible` takes the last number anywhere in it. Numbers compare after dropping `,` and `$`
(as verl does) and as decimals, so `72.0` matches `72` (verl compares strings; it would not).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# verl clips the completion before the regex: a long ramble cannot hide an early `####`.
SOLUTION_CLIP_CHARS = 300
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def _clean(number: str) -> str:
    return number.replace(",", "").replace("$", "").strip()


def extract_solution(text: str, method: str = "strict") -> str | None:
    """The final answer in `text` as a string without `,`/`$`, or None when there is none."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    text = text[-SOLUTION_CLIP_CHARS:] if len(text) > SOLUTION_CLIP_CHARS else text
    if method == "strict":
        found = _STRICT.findall(text)
        return _clean(found[-1]) if found else None
    for cand in reversed(_NUMBER.findall(text)):
        if cand.strip(".,") not in ("", "-"):
            return _clean(cand).rstrip(".")
    return None


def ground_truth_of(answer: str) -> str:
    """The reference number of a GSM8K `answer` field ("...reasoning...\\n#### 72" -> "72")."""
    if "####" not in answer:
        raise ValueError(f"GSM8K answer without '####': {answer[-80:]!r}")
    return _clean(answer.split("####")[-1])


def _same_number(a: str, b: str) -> bool:
    try:
        return Decimal(a) == Decimal(b)
    except InvalidOperation:
        return a == b


def compute_score(prompt: str, completion: str, ground_truth: str, method: str = "strict",
                  format_score: float = 0.0, score: float = 1.0, **_) -> float:
    """`score` when the completion's final number equals `ground_truth`; `format_score` when it gave a
    final number that is wrong; 0 when it gave none (verl's gsm8k.compute_score)."""
    answer = extract_solution(completion, method)
    if answer is None:
        return 0.0
    return score if _same_number(answer, _clean(str(ground_truth))) else format_score
