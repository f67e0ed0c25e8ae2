"""Experience tensors: packing prompts + responses, and the forward passes over them (log-probs, values)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from ..algos.losses import entropy_from_logits, logprobs_from_logits
from ..models.vision import RowPixels, mrope_positions

# fp32 bytes of logits that one chunk of the log-softmax/entropy computation works on: with Qwen2.5's 151,936-token
# vocabulary that is ~55 tokens at a time, so the [tokens, vocab] temporaries stay small whatever the batch.
LOGIT_CHUNK_BYTES = 32 * 2**20


@dataclass
class Batch:
    """Prompt left-padded to P, response right-padded to R: input_ids [B, P+R]."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor  # [B, R] float, 1 on generated tokens
    prompt_len: int
    # A vision-language policy's rows: their images' pixel_values and grids (positions are then M-RoPE's, computed
    # in the forward from ids and grids); None: text.
    pixels: RowPixels | None = None

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def responses(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_len:]

    def slice(self, idx) -> Batch:
        return Batch(self.input_ids[idx], self.attention_mask[idx], self.position_ids[idx],
                     self.response_mask[idx], self.prompt_len, None if self.pixels is None else self.pixels.select(idx))

    def trim(self) -> Batch:
        """The same rows cut to their own longest prompt and response (less padding to compute)."""
        P = self.prompt_len
        p = max(1, int(self.attention_mask[:, :P].sum(-1).max()))
        # Responses are right-padded; the attention mask counts observation tokens too (response_mask 0 inside).
        r = max(1, int(self.attention_mask[:, P:].sum(-1).max()))
        cols = slice(P - p, P + r)
        return Batch(self.input_ids[:, cols], self.attention_mask[:, cols], self.position_ids[:, cols],
                     self.response_mask[:, :r], p, self.pixels)

    def to(self, device) -> Batch:
        return Batch(self.input_ids.to(device), self.attention_mask.to(device), self.position_ids.to(device),
                     self.response_mask.to(device), self.prompt_len,
                     None if self.pixels is None else self.pixels.to(device))

    def model_inputs(self, model) -> dict:
        """The forward's kwargs: ids, mask and positions (with images: their pixels and M-RoPE positions)."""
        inputs = {"input_ids": self.input_ids, "attention_mask": self.attention_mask,
                  "position_ids": self.position_ids, "use_cache": False}
        vis = self.pixels.inputs(model) if self.pixels is not None else {}
        if vis:
            inputs["position_ids"] = mrope_positions(model, self.input_ids, self.attention_mask,
                                                     vis["image_grid_thw"], self.pixels.image_pad_id)
            inputs.update(vis)
        return inputs


def without_truncated(responses: list[list[int]], truncated: list[bool],
                      masks: list[list[int]] | None = None) -> list[list[int]]:
    """Per-token training masks (for pack) with the truncated samples' all 0 (algorithm.mask_truncated: DAPO's
    overlong filtering, TRL's mask_truncated_completions); their rewards still count in their group's advantages."""
    return [[0] * len(resp) if cut else (list(masks[i]) if masks else [1] * len(resp))
            for i, (resp, cut) in enumerate(zip(responses, truncated))]


def pack(prompts: list[list[int]], responses: list[list[int]], pad_id: int,
         masks: list[list[int]] | None = None, pixels: RowPixels | None = None) -> Batch:
    """Pack token lists; position ids count real tokens only, so left padding does not shift positions.
    `masks`: per response token 1 (trained) or 0 (an observation of a multi-turn sample); default all 1.
    `pixels`: the rows' images (a vision-language policy)."""
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
    if masks is not None:
        for i, m in enumerate(masks):
            if m:
                resp_mask[i, :len(m)] *= torch.tensor(m, dtype=torch.float32)
    return Batch(ids, att, pos, resp_mask, P, pixels)


def pad_rows(rows: list[list[float]], width: int, fill: float = 0.0) -> torch.Tensor:
    """[len(rows), width] float32 tensor of ragged rows, right-padded with `fill` (as pack pads responses)."""
    out = torch.full((len(rows), width), fill, dtype=torch.float32)
    for i, r in enumerate(rows):
        if r:
            out[i, :len(r)] = torch.tensor(r[:width], dtype=torch.float32)
    return out


def pad_top_rows(rows: list[list[list[float]]], width: int, k: int, dtype=torch.float32) -> torch.Tensor:
    """[B, width, k] from per-row lists of k values per position (a teacher's top-k ids or log-probs), 0-padded."""
    out = torch.zeros((len(rows), width, k), dtype=dtype)
    for i, r in enumerate(rows):
        r = [pos for pos in r[:width] if len(pos) == k]  # a filler row's positions hold nothing
        if r:
            out[i, :len(r)] = torch.tensor(r, dtype=dtype)
    return out


def policy_forward(model, batch: Batch, temperature: float = 1.0, with_entropy: bool = False):
    """Log-probs [B, R] of the response tokens (and entropies) under `model` (a DeepSpeed engine or module).

    Memory-lean: the model computes the output layer on the response positions only (logits_to_keep), and
    for the architectures of LEAN_HEAD_MODEL_TYPES the output layer itself works in chunks of LOGIT_CHUNK_BYTES
    (logits, fp32 log-softmax, entropy), recomputed in the backward pass: no [B, R, vocab] tensor is ever
    whole. Other models return their logits, and only the log-softmax runs in chunks.
    """
    lp, ent = _forward(model, batch, batch.responses.unsqueeze(-1), temperature, with_entropy)
    return lp[..., 0], ent


def policy_forward_top(model, batch: Batch, top_ids: torch.Tensor, temperature: float = 1.0,
                       with_entropy: bool = False):
    """policy_forward, and in the same forward the log-probs [B, R, k] of other tokens at each response position
    (top_ids [B, R, k]: the teacher's top k of on-policy distillation): (log-probs, entropies, their log-probs)."""
    labels = torch.cat([batch.responses.unsqueeze(-1), top_ids.to(batch.responses.device, torch.long)], -1)
    lp, ent = _forward(model, batch, labels, temperature, with_entropy)
    return lp[..., 0], ent, lp[..., 1:]


def _forward(model, batch: Batch, labels: torch.Tensor, temperature: float, with_entropy: bool):
    """[B, R, C] log-probs of labels[b, j, :] at response position j, and [B, R] entropies (or None)."""
    P, R = batch.prompt_len, batch.responses.shape[1]
    inputs = batch.model_inputs(model)
    if not _takes_logits_to_keep(model):
        logits = model(**inputs).logits[:, P - 1:-1, :]
        return token_logprobs(logits, labels, temperature, with_entropy)
    # Logits at position t predict token t+1: response token j comes from position P-1+j.
    keep = torch.arange(P - 1, P + R - 1, device=batch.input_ids.device)
    head = _lean_head(model)
    if head is None:
        return token_logprobs(model(**inputs, logits_to_keep=keep).logits, labels, temperature, with_entropy)
    # For this call only, the output layer returns log-probs; its parameter hooks (ZeRO-3 gathers) still run.
    own_forward = head.__dict__.get("forward")
    head.forward = lambda h: _chunked_head(h, head.weight, head.bias, labels, temperature, with_entropy)
    try:
        out = model(**inputs, logits_to_keep=keep).logits  # [B, R, C + 1]: log-probs and entropy per position
    finally:
        if own_forward is None:
            del head.forward
        else:
            head.forward = own_forward
    return out[..., :-1], (out[..., -1] if with_entropy else None)


# Causal LMs whose forward is `logits = self.lm_head(hidden_states[:, logits_to_keep])` with nothing applied
# to the logits after it (no soft-capping or scaling), so the output layer may return log-probs instead.
LEAN_HEAD_MODEL_TYPES = {"qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "llama", "mistral", "phi3", "olmo2"}


def _lean_head(model) -> torch.nn.Linear | None:
    module = getattr(model, "module", model)
    head = getattr(module, "lm_head", None)
    if getattr(module.config, "model_type", None) in LEAN_HEAD_MODEL_TYPES and isinstance(head, torch.nn.Linear):
        return head
    return None


def _chunked_head(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                  temperature: float, with_entropy: bool) -> torch.Tensor:
    """The output layer and log-softmax over chunks of tokens: [B, R, H] -> [B, R, C + 1] (the log-probs of the C
    labels of each position, then its entropy or 0)."""
    B, R, H = hidden.shape
    C = labels.shape[-1]
    flat = hidden.reshape(B * R, H)
    flat_labels = labels.reshape(B * R, C)
    step = max(1, LOGIT_CHUNK_BYTES // (4 * weight.shape[0]))
    # Recomputing in backward only pays where the logits would not fit one chunk anyway.
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad) and B * R > step
    outs = []
    for s in range(0, B * R, step):
        args = (flat[s:s + step], weight, bias, flat_labels[s:s + step], temperature, with_entropy)
        outs.append(checkpoint(_head_chunk, *args, use_reentrant=False) if recompute else _head_chunk(*args))
    return torch.cat(outs).view(B, R, C + 1)


def _head_chunk(h, weight, bias, labels, temperature, with_entropy):
    lp, ent = _chunk_logprobs(torch.nn.functional.linear(h, weight, bias), labels, temperature, with_entropy)
    return torch.cat([lp, (ent if with_entropy else torch.zeros_like(lp[:, 0])).unsqueeze(-1)], -1)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature)[labels] and the entropies, [B, R, V] -> [B, R] (labels [B, R]) or
    [B, R, C] (labels [B, R, C]: C tokens per position), in fp32 chunks."""
    B, R, V = logits.shape
    step = max(1, LOGIT_CHUNK_BYTES // (4 * V))
    # Recomputing a chunk in backward costs a softmax; it only pays where the whole would not fit a chunk.
    recompute = torch.is_grad_enabled() and logits.requires_grad and B * R > step
    lps, ents = [], []
    for b in range(B):  # row by row: a row of the logits is contiguous whatever slicing made them
        for s in range(0, R, step):
            args = (logits[b, s:s + step], labels[b, s:s + step], temperature, with_entropy)
            lp, ent = checkpoint(_chunk_logprobs, *args, use_reentrant=False) if recompute else _chunk_logprobs(*args)
            lps.append(lp)
            ents.append(ent)
    logp = torch.cat(lps).view(B, R, *labels.shape[2:])
    return logp, (torch.cat(ents).view(B, R) if with_entropy else None)


def _chunk_logprobs(z: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool):
    """[N, V] logits, [N] or [N, C] labels -> their log-probs, and [N] entropies (or a zero-size placeholder)."""
    z = z.float()
    if temperature != 1.0:
        z = z / temperature
    lp = logprobs_from_logits(z, labels)
    # Without entropy, a zero-size placeholder keeps checkpoint's outputs tensors.
    return lp, (entropy_from_logits(z) if with_entropy else lp.new_zeros(0))


_KEEP_ARG: dict[type, bool] = {}


def _takes_logits_to_keep(model) -> bool:
    """Whether the (wrapped) model's forward accepts logits_to_keep, as transformers' causal LMs do; a PeftModel
    passes it on to the model it wraps."""
    module = getattr(model, "module", model)
    if hasattr(module, "get_base_model"):  # PEFT's forward(*args, **kwargs)
        module = module.get_base_model()
    cls = type(module)
    if cls not in _KEEP_ARG:
        _KEEP_ARG[cls] = "logits_to_keep" in inspect.signature(module.forward).parameters
    return _KEEP_ARG[cls]


def value_forward(critic, batch: Batch) -> torch.Tensor:
    """Values [B, R]: V of the state before each response token."""
    out = critic(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
    P = batch.prompt_len
    return out.logits[:, P - 1:-1, 0].float()


@torch.no_grad()
def forward_micro_batches(fn, model, micro_batches, size: int, width: int, **kw) -> torch.Tensor:
    """Apply a forward fn ([b, R'] output) over micro-batches without gradients; the outputs land in the rows
    they came from of a [size, width] tensor (zeros beyond each micro-batch's width)."""
    out = None
    for mb in micro_batches:
        r = fn(model, mb.batch, **kw)
        r = r[0] if isinstance(r, tuple) else r
        if out is None:
            out = torch.zeros((size, width), dtype=r.dtype, device=r.device)
        out[mb.rows, :r.shape[1]] = r
    return out
