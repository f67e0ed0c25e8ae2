"""Engine selection: the engine rollout.engine names ("hf", "vllm", or "auto": vLLM when it imports and starts,
else HF), wrapped to take LoRA adapters as weight updates under model.lora."""

from __future__ import annotations

import logging

from ...config import JobConfig
from ...errors import first_line
from .engine import Engine

log = logging.getLogger("hpc_rl")


def make_engine(cfg: JobConfig, device: str = "cpu") -> Engine:
    """The engine cfg.rollout.engine names: "hf", "vllm", or "auto" (vLLM when it imports and starts, else HF);
    under model.lora it takes the actor's adapters as weight updates (engine_lora)."""
    engine = _make_engine(cfg, device)
    if cfg.model.lora is None:
        return engine
    from .engine_lora import LoraMergingEngine

    log.info("rollout engine: weight updates are LoRA adapters (rank %d), merged into the served weights",
             cfg.model.lora.rank)
    return LoraMergingEngine(engine, str(cfg.model.path), cfg.model.lora)


def _make_engine(cfg: JobConfig, device: str) -> Engine:
    choice = cfg.rollout.engine
    if choice == "hf":
        from .engine_hf import HFEngine

        log.info("rollout engine: hf (rollout.engine=hf)")
        return HFEngine(cfg, device)
    if choice == "vllm":
        from .engine_vllm import VLLMEngine

        log.info("rollout engine: vllm (rollout.engine=vllm)")
        return VLLMEngine(cfg, device)
    # auto: prefer vLLM, fall back to HF with the reason logged.
    from ...models.vision import is_vision_model

    if is_vision_model(cfg.model.path):
        from .engine_hf import HFEngine

        log.info("rollout engine: hf (rollout.engine=auto; a vision-language model: hpc-rl feeds images to the HF "
                 "engine only)")
        return HFEngine(cfg, device)
    try:
        import vllm  # noqa: F401
    except Exception as e:  # ImportError, or a broken install raising anything at import
        log.info("rollout engine: hf (rollout.engine=auto; vllm does not import: %s)", first_line(e))
        from .engine_hf import HFEngine

        return HFEngine(cfg, device)
    try:
        from .engine_vllm import VLLMEngine

        eng = VLLMEngine(cfg, device)
        log.info("rollout engine: vllm (rollout.engine=auto)")
        return eng
    except Exception as e:
        msg = first_line(e)
        log.warning("rollout engine: hf (rollout.engine=auto; the vLLM engine could not start: %s)", msg)
        from .engine_hf import HFEngine

        return HFEngine(cfg, device)
