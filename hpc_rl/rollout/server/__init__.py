"""The rollout server side: the HTTP app, the engines (vLLM, HF, LoRA merging) and the weight receivers.
`python -m hpc_rl.rollout.server` starts one server (service.py)."""
