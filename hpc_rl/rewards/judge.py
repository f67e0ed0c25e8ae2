"""An LLM judge's prompt and verdict (reward.judge): the jinja2 template rendered over a sample and its row, and the
parser that turns the judge's answer into a score in [0, 1] (or None: it does not parse, the fallback applies).
Who answers (the run's judge servers or an endpoint) is the orchestrator's (orchestrator/judge.py)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from ..config.reward import JUDGE_PARSERS, JudgeConfig
from ..errors import ConfigError, RewardError, first_line
from .base import load_reward_fn

# The variables every sample gives the template besides its row's fields.
SAMPLE_VARIABLES = ("prompt", "completion")


def compile_template(text: str):
    """The template; an unknown variable is an error when rendered, not an empty string."""
    import jinja2

    return jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True).from_string(text)


def check_template_variables(text: str, row: dict) -> None:
    """ConfigError naming a variable the template uses that neither a sample nor the row (`row`: the data's first)
    gives."""
    import jinja2
    from jinja2 import meta

    used = meta.find_undeclared_variables(jinja2.Environment().parse(text))
    unknown = sorted(used - set(SAMPLE_VARIABLES) - set(row))
    if unknown:
        raise ConfigError(f"reward.judge.template: unknown variable {unknown[0]!r}; the template sees "
                          f"{', '.join(SAMPLE_VARIABLES)} and the row's fields ({', '.join(map(str, row))})")


def render(template, prompt: str, completion: str, row: dict) -> str:
    return template.render(**{**row, "prompt": prompt, "completion": completion})


def yes_no(answer: str, row: dict | None = None) -> float | None:
    """1.0 for an answer that starts with yes, 0.0 for no (case, spaces and punctuation around it ignored)."""
    word = re.match(r"\W*(\w+)", answer or "")
    if word is None:
        return None
    w = word.group(1).lower()
    return 1.0 if w == "yes" else 0.0 if w == "no" else None


def score_parser(regex: str, low: float, high: float) -> Callable[..., float | None]:
    """The first group of the first match of `regex`, a number in [low, high], mapped to [0, 1]."""
    pattern = re.compile(regex)

    def parse(answer: str, row: dict | None = None) -> float | None:
        m = pattern.search(answer or "")
        if m is None:
            return None
        try:
            v = float(m.group(1))
        except (TypeError, ValueError):
            return None
        return (v - low) / (high - low) if low <= v <= high else None

    return parse


def make_parser(j: JudgeConfig) -> Callable[[str, dict], float | None]:
    """reward.judge.parser as fn(answer, row) -> score or None, its errors naming the key."""
    if j.parser == "yes_no":
        return yes_no
    if j.parser == "score":
        return score_parser(j.regex, float(j.score_range[0]), float(j.score_range[1]))
    assert j.parser not in JUDGE_PARSERS
    fn = load_reward_fn(j.parser, "reward.judge.parser")

    def parse(answer: str, row: dict) -> float | None:
        try:
            v = fn(answer, row)
        except Exception as e:  # the user's code: one line naming it and the answer
            raise RewardError(f"reward.judge.parser {j.parser} raised {type(e).__name__} on the answer {answer!r}: "
                              f"{first_line(e)}; return a float, or None when the answer does not parse") from None
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise RewardError(f"reward.judge.parser {j.parser} returned {v!r} for the answer {answer!r}; return a "
                              "finite float, or None when the answer does not parse")
        return float(v)

    return parse
