"""Slurm: submitit executor, node-role layout, sbatch rendering, sweeps as arrays, status/logs/cancel."""
