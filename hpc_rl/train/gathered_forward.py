"""The policy's forward on rank 0 from the weights a push has just gathered, without ZeRO-3's per-module fetches.

Under ZeRO-3 every forward all-gathers each module's weights as it reaches it; for a small model on CPU that is most
of a one-row forward (the toy's 2 layers: ~9 ms over gloo, on every rank at once). The weight push gathers the whole
policy onto rank 0 anyway (train.engines.gather_state_dict, CPU tensors). Where the trainer runs on CPU those copies
are on the device the forward runs on, so the check after the update and the weight-sync probe use them: a skeleton
of the model on the meta device whose parameters are the gathered tensors for the length of the call
(torch.func.functional_call), so nothing is copied and nothing outlives the call. On GPUs the gathered copies are in
host memory: there the engine's own forward stays.
"""

from __future__ import annotations

import copy

import torch


def can_stand_in(device: torch.device, zero_stage: int, lora: bool, vision: bool) -> bool:
    """Whether the gathered weights can stand in for the engine's forward: a CPU trainer under ZeRO-3 (below stage 3
    the engine's forward fetches nothing), the whole policy pushed (not LoRA's adapters alone), a text model."""
    return device.type == "cpu" and zero_stage == 3 and not lora and not vision


class GatheredPolicy:
    """The engine's model as a skeleton; `on(named)` gives a callable like the engine (`model(**inputs)`) that runs
    on the gathered (name, tensor) pairs of the HF state dict."""

    def __init__(self, engine):
        module = engine.module
        with torch.device("meta"):
            self.module = type(module)(copy.deepcopy(module.config))
        self.module.eval().requires_grad_(False)
        # Tied weights (an output layer sharing the embedding) are one parameter here: one name each.
        self.names = [n for n, _ in self.module.named_parameters()]
        # Buffers are not partitioned; the non-persistent ones (rotary frequencies) are in no state dict.
        self.buffers = dict(module.named_buffers())

    def on(self, named: list) -> OnWeights:
        given = dict(named)
        missing = [n for n in self.names if n not in given]
        if missing:
            raise KeyError(f"the gathered policy lacks {missing[:3]}")
        return OnWeights(self.module, {**self.buffers, **{n: given[n] for n in self.names}})


class OnWeights:
    """The skeleton `module` called on `tensors` (its parameters and buffers by name)."""

    def __init__(self, module, tensors: dict[str, torch.Tensor]):
        self.module, self.tensors = module, tensors

    def __call__(self, **inputs):
        return torch.func.functional_call(self.module, self.tensors, args=(), kwargs=inputs, tie_weights=True,
                                          strict=False)
