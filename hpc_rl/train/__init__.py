"""Trainer ranks: DeepSpeed engines (actor, critic, reference), the RL step, checkpoints."""
