"""Reward functions (rule-based, by dotted path) and their validation."""
