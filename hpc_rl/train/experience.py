"""Experience tensors: packing prompts + responses, and the forward passes over them (log-probs, values)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..algos.losses import entropy_from_logits, logprobs_from_logits


@dataclass
class Batch:
    """Prompt left-padded to P, response right-padded to R: input_ids [B, P+R]."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor  # [B, R] float, 1 on generated tokens
    prompt_len: int

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def responses(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_len:]

    def slice(self, idx) -> Batch:
        return Batch(self.input_ids[idx], self.attention_mask[idx], self.position_ids[idx],
                     self.response_mask[idx], self.prompt_len)

    def to(self, device) -> Batch:
        return Batch(self.input_ids.to(device), self.attention_mask.to(device), self.position_ids.to(device),
                     self.response_mask.to(device), self.prompt_len)


def pack(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> Batch:
    """Pack token lists; position ids count real tokens only, so left padding does not shift positions."""
    P = max(len(p) for p in prompts)
    R = max(1, max(len(r) for r in responses))
    B = len(prompts)
    ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    att = torch.zeros((B, P + R), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, P - len(p):P] = torch.tensor(p, dtype=torch.long)
        att[i, P - len(p):P] = 1
        if r:
            ids[i, P:P + len(r)] = torch.tensor(r, dtype=torch.long)
            att[i, P:P + len(r)] = 1
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    resp_mask = att[:, P:].float()
    return Batch(ids, att, pos, resp_mask, P)


def pad_rows(rows: list[list[float]], width: int, fill: float = 0.0) -> torch.Tensor:
    """[len(rows), width] float32 tensor of ragged rows, right-padded with `fill` (as pack pads responses)."""
    out = torch.full((len(rows), width), fill, dtype=torch.float32)
    for i, r in enumerate(rows):
        if r:
            out[i, :len(r)] = torch.tensor(r[:width], dtype=torch.float32)
    return out


def policy_forward(model, batch: Batch, temperature: float = 1.0, with_entropy: bool = False):
    """Log-probs [B, R] of the response tokens (and entropies) under `model` (a DeepSpeed engine or module)."""
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                use_cache=False)
    P = batch.prompt_len
    # Logits at position t predict token t+1: response token j comes from position P-1+j.
    logits = out.logits[:, P - 1:-1, :].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = logprobs_from_logits(logits, batch.responses)
    ent = entropy_from_logits(logits) if with_entropy else None
    return logp, ent


def value_forward(critic, batch: Batch) -> torch.Tensor:
    """Values [B, R]: V of the state before each response token."""
    out = critic(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
    P = batch.prompt_len
    return out.logits[:, P - 1:-1, 0].float()


@torch.no_grad()
def batched_forward(fn, model, batch: Batch, micro: int, **kw) -> torch.Tensor:
    """Apply a forward fn over micro-batches without gradients; concatenates the first output."""
    outs = []
    for s in range(0, batch.size, micro):
        r = fn(model, batch.slice(slice(s, s + micro)), **kw)
        outs.append(r[0] if isinstance(r, tuple) else r)
    return torch.cat(outs, 0)
