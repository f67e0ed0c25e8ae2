"""hpc-rl: RL post-training of language models on Slurm clusters, installed without containers."""

__version__ = "0.1.0"
