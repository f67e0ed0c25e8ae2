"""The reward model on a rollout server (reward.model.placement: server): POST /v1/score behind the server's
token, limits and one-line errors; the server's restarts and the client's retries cover it like generation."""

from __future__ import annotations

import logging
import threading
import time

from ..config import JobConfig
from ..rollout.wire import protocol
from .model import HeadTap, load_reward_module, score_sequences

log = logging.getLogger("hpc_rl")


def reward_device(cfg: JobConfig, device: str, own_device: bool = False) -> str:
    """The reward model's device: on a rollout server the GPU after the engine's tensor-parallel ones (validated
    at load to exist), so that no GPU serves two components; on a reward node's server (own_device) its first
    GPU; the CPU on CPU."""
    if not str(device).startswith("cuda"):
        return "cpu"
    return "cuda:0" if own_device else f"cuda:{cfg.rollout.tensor_parallel}"


class RewardService:
    """What the HTTP app needs of a server that only scores (reward nodes): routes, counters, health."""

    engine = None

    def __init__(self, model_path: str):
        self.model_path = model_path
        self.routes: dict = {}
        self.started = time.time()
        self._counters = {"requests": 0, "errors": 0}
        self._lock = threading.Lock()

    def add_route(self, method: str, path: str, fn) -> None:
        self.routes[(method.upper(), path.rstrip("/"))] = fn

    def count(self, key: str, inc: float = 1) -> None:
        with self._lock:
            self._counters[key] += inc

    def health(self) -> dict:
        return {"status": "ok", "engine": "reward-model", "model": self.model_path}

    def metrics(self) -> dict:
        with self._lock:
            return {**self._counters, "uptime_s": round(time.time() - self.started, 3)}


def register_score_route(service, cfg: JobConfig, device: str, own_device: bool = False) -> None:
    """Load the reward model on its device and serve POST /v1/score: {token_ids} -> {logits} (raw, one per row)."""
    rm = cfg.reward.model
    dev = reward_device(cfg, device, own_device)
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
