"""The doctor's checks, one module per area; importing this package registers them (order = output order)."""

from . import env, cuda, system, slurm, job  # noqa: F401
