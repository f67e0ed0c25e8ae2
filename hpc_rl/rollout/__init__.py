"""Generating samples, in folders that show its sides: server/ (the rollout server: HTTP app, engines, weight
receivers), client/ (the trainer side: the client and the weight sender), wire/ (the formats both share), and
environments/ (multi-turn rollouts, tools, the sandbox: trainer side)."""
