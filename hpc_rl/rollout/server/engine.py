"""The Engine interface every rollout engine implements (HF fallback, vLLM), and engine selection.

Tensor names are the HF `state_dict()` names of the causal LM (e.g. `model.layers.0.self_attn.q_proj.weight`).
`load_weights` receives tensors already validated by `hpc_rl.rollout.wire.weights.validate_named_tensors`
against `param_specs()`; engines cast to their own dtype on load.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from typing import TYPE_CHECKING

from ...errors import first_line
from ..wire.sampling import SampleOut, SamplingParams

if TYPE_CHECKING:  # torch is heavy; importing this module must stay cheap for the client
    import torch

    from ...config import JobConfig

log = logging.getLogger("hpc_rl")


class Engine(abc.ABC):
    """A model that samples completions and can swap its weights in place."""

    name: str = "engine"
    # The event loop the engine itself runs on (vLLM's AsyncLLM), or None. The rollout server serves HTTP on
    # that loop, so that its endpoints await the engine directly.
    loop: asyncio.AbstractEventLoop | None = None
    # load_weights rebuilds each layer it touches from the tensors given (vLLM's layerwise reload: a fused
    # qkv_proj loaded with q_proj alone would keep garbage in k and v), so a partial update must hold every
    # weight of the layers it changes.
    reloads_whole_layers: bool = False

    @abc.abstractmethod
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[list[SampleOut]]:
        """For each prompt, `params.n` samples; deterministic for a given `params.seed`."""

    @abc.abstractmethod
    def prompt_logprobs(self, token_ids: list[list[int]], prompt_lens: list[int]) -> list[list[float]]:
        """Raw log-probs of token_ids[i][prompt_lens[i]:] given their prefix."""

    async def generate_async(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[list[SampleOut]]:
        """generate for a caller on an event loop; engines without a loop of their own compute in a worker thread."""
        return await asyncio.to_thread(self.generate, prompt_token_ids, params)

    async def prompt_logprobs_async(self, token_ids: list[list[int]], prompt_lens: list[int]) -> list[list[float]]:
        """prompt_logprobs for a caller on an event loop (as generate_async)."""
        return await asyncio.to_thread(self.prompt_logprobs, token_ids, prompt_lens)

    @abc.abstractmethod
    def param_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """HF state-dict name -> (shape, dtype) of every weight the engine accepts."""

    @abc.abstractmethod
    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Copy the (validated) tensors into the model in place; cast to the engine's dtype."""

    def reset_cache(self) -> None:  # noqa: B027 (an optional hook: engines without caches keep this no-op)
        """Drop any cached state computed with old weights (prefix/KV caches)."""

    def close(self) -> None:  # noqa: B027 (an optional hook, like reset_cache)
        """Release the engine's resources."""


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
