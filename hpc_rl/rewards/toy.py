"""Rewards of the built-in toy tasks (hpc_rl.data.toy)."""


def repeat_digit(prompt: str, completion: str, ground_truth: str, **_) -> float:
    """Fraction of the first 4 non-space characters of the completion that equal the prompt's digit."""
    chars = [c for c in completion if not c.isspace()][:4]
    return sum(c == ground_truth for c in chars) / 4.0


def copy_pair(prompt: str, completion: str, ground_truth: str, **_) -> float:
    """Fraction of the 2 digits of `A B` that the first 2 non-space characters of the completion get right."""
    want = ground_truth.split()
    chars = [c for c in completion if not c.isspace()][:2]
    return sum(c == w for c, w in zip(chars, want)) / 2.0
