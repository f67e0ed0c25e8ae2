"""Rollout servers (vLLM or HF engine behind one HTTP API), their client, and weight transport."""
