"""Prompt datasets (toy generators, jsonl, parquet, HF datasets) and the deterministic sampler."""
