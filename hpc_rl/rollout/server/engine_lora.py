"""A rollout engine that takes LoRA adapters as weight updates (model.lora): the trainer pushes the adapters only,
this wrapper merges each into its weight (W0 + alpha / rank * B @ A, W0 read once from model.path) and loads the
merged weights into the engine it wraps. Generation then runs at the base model's speed, with no adapter kernels;
see bench/README.md "LoRA" for the measurements behind this choice.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ...models.lora import adapter_specs, group_adapters, merged, scaling, unpaired
from ..wire.sampling import SampleOut, SamplingParams
from ..wire.weights import WeightError
from .engine import Engine

log = logging.getLogger("hpc_rl")


def read_base_weights(model_path: str, names: set[str]) -> dict[str, torch.Tensor]:
    """The tensors `names` (named as in the loaded model) of an HF folder's safetensors files, on CPU (only the files
    that hold them are opened; a name transformers renames at load is read under the file's own name)."""
    from safetensors import safe_open

    from ...models.checkpoint_names import file_names

    where = file_names(model_path, names)
    missing = names - set(where)
    if missing:
        raise WeightError(f"weights: {model_path} has no tensor {sorted(missing)[0]!r} to merge an adapter into; "
                          "model.path must hold the base model's safetensors weights")
    out: dict[str, torch.Tensor] = {}
    for f in sorted({file for _, file in where.values()}):
        with safe_open(str(Path(model_path) / f), framework="pt") as sf:
            for n, (key, file) in where.items():
                if file == f:
                    out[n] = sf.get_tensor(key)
    return out


class LoraMergingEngine(Engine):
    """Serves `inner`; accepts adapter tensors (models.lora wire names) besides whole weights."""

    def __init__(self, inner: Engine, model_path: str, lora):
        self.inner = inner
        self.name = inner.name
        self.loop = inner.loop
        self.device = getattr(inner, "device", "cpu")
        self.model_path = model_path
        self.scale = scaling(lora.alpha, lora.rank)
        self.rank = int(lora.rank)
        self._base: dict[str, torch.Tensor] = {}  # W0 of every adapted weight, read from model_path once
        self._pending: list[tuple[str, torch.Tensor]] = []  # this version's tensors until reset_cache
        self.whole_layers = bool(getattr(inner, "reloads_whole_layers", False))
        self._specs = None

    @property
    def takes_images(self) -> bool:
        return self.inner.takes_images

    @property
    def inflight(self) -> bool:
        return self.inner.inflight

    @property
    def weights_version(self) -> int:
        return self.inner.weights_version

    @weights_version.setter
    def weights_version(self, version: int) -> None:
        self.inner.weights_version = version

    def swapping(self):
        return self.inner.swapping()

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams, cancel=None,
                 images=None) -> list[list[SampleOut]]:
        return self.inner.generate(prompt_token_ids, params, cancel, images)

    def prompt_top_logprobs(self, token_ids, prompt_lens, k, cancel=None, images=None):
        return self.inner.prompt_top_logprobs(token_ids, prompt_lens, k, cancel, images)

    async def generate_async(self, prompt_token_ids, params, cancel=None, images=None):
        return await self.inner.generate_async(prompt_token_ids, params, cancel, images)

    async def prompt_top_logprobs_async(self, token_ids, prompt_lens, k, cancel=None, images=None):
        return await self.inner.prompt_top_logprobs_async(token_ids, prompt_lens, k, cancel, images)

    def param_specs(self) -> dict:
        if self._specs is None:
            base = self.inner.param_specs()
            self._specs = {**base, **adapter_specs(base, self.rank)}
        return self._specs

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Buffer a version's tensors (a collective push may bring an adapter's A and B in different buckets);
        reset_cache, which the servers call after a version's last load, merges and loads them."""
        self._pending.extend(named_tensors)

    def reset_cache(self) -> None:
        """Merge the buffered adapters into their weights and load everything into the engine at once."""
        pending, self._pending = self._pending, []
        plain, pairs = group_adapters(pending)
        half = unpaired(pairs)
        if half:
            raise WeightError(f"weights: {half}; push both halves of every adapter in one version")
        need = set(pairs)
        if self.whole_layers:  # every weight of each layer an adapter touches (see reloads_whole_layers)
            parents = {w.rsplit(".", 2)[0] for w in pairs}
            need |= {n for n in self.inner.param_specs() if n.rsplit(".", 2)[0] in parents and n not in plain}
        missing = need - set(self._base)
        if missing:
            self._base.update(read_base_weights(self.model_path, missing))
        out = {n: self._base[n] for n in need}
        # float32: the engine casts to what it serves (a bfloat16 W0 file must not round the trainer's sum).
        out.update({w: merged(self._base[w], p["lora_A"], p["lora_B"], self.scale, torch.float32)
                    for w, p in pairs.items()})
        out.update(plain)
        if out:
            self.inner.load_weights(list(out.items()))
        self.inner.reset_cache()

    def close(self) -> None:
        self.inner.close()
