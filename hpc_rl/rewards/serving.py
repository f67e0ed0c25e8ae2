"""The reward model on a rollout server (reward.model.placement: server): POST /v1/score behind the server's
token, limits and one-line errors; the server's restarts and the client's retries cover it like generation."""

from __future__ import annotations

import logging
import threading
import time

from ..config import JobConfig
from ..rollout import protocol
from .model import HeadTap, load_reward_module, score_sequences

log = logging.getLogger("hpc_rl")


def reward_device(cfg: JobConfig, device: str) -> str:
    """The reward model's device on a rollout server: the GPU after the engine's tensor-parallel ones (validated
    at load to exist), so that no GPU serves two components; the CPU on CPU."""
    return f"cuda:{cfg.rollout.tensor_parallel}" if str(device).startswith("cuda") else "cpu"


def register_score_route(service, cfg: JobConfig, device: str) -> None:
    """Load the reward model on its device and serve POST /v1/score: {token_ids} -> {logits} (raw, one per row)."""
    rm = cfg.reward.model
    dev = reward_device(cfg, device)
    t0 = time.time()
    module, tok, label = load_reward_module(rm, cfg, dev)
    tap = HeadTap(module, label)
    vocab = int(getattr(module.config, "vocab_size", 0)) or None
    lock = threading.Lock()  # one forward at a time: concurrent requests would only share the same cores/GPU
    log.info("reward model %s loaded on %s in %.1fs (label %d)", rm.path, dev, time.time() - t0, label)

    def score(body) -> dict:
        rows = protocol.parse_score(body, vocab, rm.max_length)
        with lock:
            logits = score_sequences(tap, rows, rm.batch_size, tok.pad_token_id, dev)
        return {"logits": logits.tolist()}

    service.add_route("POST", "/v1/score", score)
