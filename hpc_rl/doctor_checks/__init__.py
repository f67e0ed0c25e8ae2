"""The doctor's checks, one module per area; importing this package registers them (order = output order)."""

from . import cuda, env, job, slurm, system  # noqa: F401
