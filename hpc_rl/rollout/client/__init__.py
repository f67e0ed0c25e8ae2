"""The trainer side: the rollout client (discovery, generation, weight push) and the collective weight sender."""
