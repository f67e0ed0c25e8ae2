"""User-facing errors: one line naming the cause and the fix; the CLI prints them and exits 2."""


class HpcRlError(Exception):
    """An error the user can fix; its message is one line naming the cause and the fix."""


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


class TrainingError(HpcRlError):
    """Training cannot continue (e.g. non-finite losses several steps in a row)."""


class CheckpointError(HpcRlError):
    """A checkpoint is missing or cannot be used for resume/export."""


class ClusterError(HpcRlError):
    """Slurm or submitit refused a job, or a run cannot be found."""
