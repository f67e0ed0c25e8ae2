"""Multi-turn rollouts: the environment interface, chat formatting of turns, the rollout loop, tools, sandbox."""
