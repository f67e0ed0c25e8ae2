"""The Engine interface every rollout engine implements (HF fallback, vLLM; engines.py picks one).

Tensor names are the HF `state_dict()` names of the causal LM (e.g. `model.layers.0.self_attn.q_proj.weight`).
`load_weights` receives tensors already validated by `hpc_rl.rollout.wire.weights.validate_named_tensors`
against `param_specs()`; engines cast to their own dtype on load.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import contextlib
import logging
import threading
from typing import TYPE_CHECKING

from ..wire.sampling import SampleOut, SamplingParams, TopLogprobs

if TYPE_CHECKING:  # torch is heavy; importing this module must stay cheap for the client
    import torch

log = logging.getLogger("hpc_rl")


class Cancelled(Exception):
    """The request's client went away (disconnect or timeout): its work stops where the engine can stop it."""


class FairLock:
    """One computation at a time, granted in arrival order: a request that chunks its work takes a turn per chunk,
    so a small request arriving beside a large one waits for one chunk, not the whole request."""

    def __init__(self):
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._held = False

    @contextlib.contextmanager
    def turn(self, cancel: threading.Event | None = None):
        me = object()
        with self._cond:
            self._queue.append(me)
            try:
                while self._held or self._queue[0] is not me:
                    if cancel is not None and cancel.is_set():
                        raise Cancelled("the client went away while the request waited for its turn")
                    self._cond.wait(0.1)
            finally:
                if self._queue[0] is me and not self._held:
                    self._queue.popleft()
                    self._held = True
                else:  # cancelled (or interrupted) while waiting: give up the place
                    self._queue.remove(me)
                    self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._held = False
                self._cond.notify_all()


class StepGate:
    """Decoding steps against an in-flight weight swap (rollout.inflight_updates): a swap waits for the steps in
    progress, not for whole generations, and holds the next steps back until the new weights are in; a swap asked
    for goes before steps that have not started, so a busy engine cannot starve it."""

    def __init__(self):
        self._cond = threading.Condition()
        self._stepping = 0
        self._swapping = False
        self._wanted = 0

    @contextlib.contextmanager
    def step(self):
        with self._cond:
            while self._swapping or self._wanted:
                self._cond.wait()
            self._stepping += 1
        try:
            yield
        finally:
            with self._cond:
                self._stepping -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def swap(self):
        with self._cond:
            self._wanted += 1
            try:
                while self._swapping or self._stepping:
                    self._cond.wait()
            finally:
                self._wanted -= 1
            self._swapping = True
        try:
            yield
        finally:
            with self._cond:
                self._swapping = False
                self._cond.notify_all()


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

    # Whether prompts may carry images (a vision-language model the engine feeds them to).
    takes_images: bool = False

    # Whether generations continue across a weight load (rollout.inflight_updates): `swapping()` pauses them between
    # decoding steps instead of waiting for them, and each sample reports the version of every token
    # (SampleOut.versions) from `weights_version`, which the server sets inside `swapping()`.
    inflight: bool = False
    weights_version: int = 0

    def swapping(self) -> contextlib.AbstractContextManager:
        """Hold every decoding step back while the caller loads weights and sets weights_version (engines with
        `inflight` only)."""
        raise NotImplementedError(f"the {self.name} engine cannot swap weights under running generations")

    @abc.abstractmethod
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams,
                 cancel: threading.Event | None = None, images: list[list[bytes]] | None = None
                 ) -> list[list[SampleOut]]:
        """For each prompt, `params.n` samples; sample j of prompt i is deterministic in params.prompt_seed(i) + j,
        whatever else the batch holds. `images[i]`: prompt i's encoded images (its ids hold their expanded pads)."""

    @abc.abstractmethod
    def prompt_top_logprobs(self, token_ids: list[list[int]], prompt_lens: list[int], k: int,
                            cancel: threading.Event | None = None, images: list[list[bytes]] | None = None
                            ) -> TopLogprobs:
        """Raw log-probs of token_ids[i][prompt_lens[i]:] given their prefix, and (k > 0) at each of those positions
        the k likeliest tokens and their raw log-probs."""

    def prompt_logprobs(self, token_ids: list[list[int]], prompt_lens: list[int],
                        cancel: threading.Event | None = None, images: list[list[bytes]] | None = None
                        ) -> list[list[float]]:
        """Raw log-probs of token_ids[i][prompt_lens[i]:] given their prefix."""
        return self.prompt_top_logprobs(token_ids, prompt_lens, 0, cancel, images).logprobs

    async def generate_async(self, prompt_token_ids: list[list[int]], params: SamplingParams,
                             cancel: threading.Event | None = None, images: list[list[bytes]] | None = None
                             ) -> list[list[SampleOut]]:
        """generate for a caller on an event loop. Its work stops when the awaiting task is cancelled (engines with
        a loop of their own abort the request) or `cancel` is set (engines computing in a worker thread check it)."""
        return await asyncio.to_thread(self.generate, prompt_token_ids, params, cancel, images)

    async def prompt_logprobs_async(self, token_ids: list[list[int]], prompt_lens: list[int],
                                    cancel: threading.Event | None = None, images: list[list[bytes]] | None = None
                                    ) -> list[list[float]]:
        """prompt_logprobs for a caller on an event loop (as generate_async)."""
        return (await self.prompt_top_logprobs_async(token_ids, prompt_lens, 0, cancel, images)).logprobs

    async def prompt_top_logprobs_async(self, token_ids: list[list[int]], prompt_lens: list[int], k: int,
                                        cancel: threading.Event | None = None,
                                        images: list[list[bytes]] | None = None) -> TopLogprobs:
        """prompt_top_logprobs for a caller on an event loop (as generate_async)."""
        return await asyncio.to_thread(self.prompt_top_logprobs, token_ids, prompt_lens, k, cancel, images)

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
