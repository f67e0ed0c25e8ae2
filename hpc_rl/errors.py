"""User-facing errors: one line naming the cause and the fix; the CLI prints them and exits 2."""

from __future__ import annotations

# str.splitlines() breaks on all of these; a message printed as "one line" must contain none of them.
_LINE_BREAKS = {c: repr(c)[1:-1] for c in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"}
_FOLD = str.maketrans(_LINE_BREAKS)


def one_line(text: str) -> str:
    """`text` with every line-break character written as its escape (a key "a\\nb" stays visible)."""
    return text.translate(_FOLD)


def first_line(e: BaseException | str, limit: int = 200) -> str:
    """The first non-empty line of an error's message (at most `limit` characters), else its type name."""
    text = e if isinstance(e, str) else str(e)
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:limit]
    return "" if isinstance(e, str) else type(e).__name__


class HpcRlError(Exception):
    """An error the user can fix; its message is one line naming the cause and the fix, whatever the
    input it quotes (line breaks in a quoted key or value are shown escaped)."""

    def __str__(self) -> str:
        return one_line(super().__str__())


class ConfigError(HpcRlError):
    """A job spec, sweep file or CLI override is invalid."""


class DataError(HpcRlError):
    """A prompt dataset is missing, unreadable or malformed."""


class RewardError(HpcRlError):
    """A reward function could not be loaded, raised, or returned an invalid value."""


class ModelError(HpcRlError):
    """A model or tokenizer folder is missing or unusable."""


class RolloutError(HpcRlError):
    """Rollout servers could not be reached, or answered with an error."""


class PolicyNotFiniteError(HpcRlError):
    """A rollout server's forward of the policy gave non-finite probabilities: the pushed weights are broken, not the
    server, so the request is not retried elsewhere. `version` is the policy version the server held."""

    def __init__(self, message: str, version: int | None = None):
        super().__init__(message)
        self.version = version


class TrainingError(HpcRlError):
    """Training cannot continue (e.g. non-finite losses several steps in a row)."""


class CheckpointError(HpcRlError):
    """A checkpoint is missing or cannot be used for resume/export."""


class ClusterError(HpcRlError):
    """Slurm or submitit refused a job, or a run cannot be found."""
