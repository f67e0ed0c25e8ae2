"""Held-out evaluation: pass@k and the other per-evaluation metrics (pass_at_k.py), and the evaluator that
generates through the rollout client and writes eval.jsonl and eval/step_N.jsonl (evaluator.py)."""
