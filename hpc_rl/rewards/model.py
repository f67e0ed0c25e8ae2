"""The reward model: a sequence-classification head read at the last real token of prompt + response.

Every pitfall of reward models that users of RLHF frameworks report is checked here, once: a folder without a
trained classification head, a head of several labels read without saying which, an output of shape (B, 1) or
(B, T) instead of one score per sample, the first token's score instead of the last real token's (HF pools at
the last token that is not the pad id, which is the token *before* an eos when pad is eos), raw logits far from
the rule rewards' range (`transform`/`scale`/`shift`), a tokenizer without a pad token, and a reward model with
another tokenizer than the policy's (the sample is decoded and tokenized again, with its chat template).
"""

from __future__ import annotations

import json
import logging
import math
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..config import JobConfig, RewardModelConfig
from ..errors import ConfigError, ModelError, RewardError
from ..models.loading import check_model_dir, load_tokenizer, torch_dtype

log = logging.getLogger("hpc_rl")
_warned: set[str] = set()

KEY = "reward.model"

if TYPE_CHECKING:  # torch is imported where a forward runs: the launcher checks folders without it
    import torch


def _warn_once(key: str, msg: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


# --------------------------------------------------------------------------- the folder and its head


def read_head(path: str | Path) -> dict:
    """config.json of a reward-model folder; ModelError when it is not a sequence classifier (an untrained head
    would be added at load and score noise)."""
    try:
        p = check_model_dir(path)
    except ModelError as e:
        raise ModelError(str(e).replace("model.path", f"{KEY}.path")) from None
    cfg = json.loads((p / "config.json").read_text())
    archs = cfg.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ModelError(f"{KEY}.path: {path} is a {', '.join(archs) or 'model without architectures'}, not a "
                         "...ForSequenceClassification: loading it would add an untrained head that scores noise; "
                         "point it at a reward model folder (a sequence-classification head trained on preferences)")
    return cfg


def label_to_read(config: dict, label_index: int | None, path) -> int:
    """The head's output that scores: 0 for a one-label head; `label_index` for larger ones (ConfigError
    naming the head's size when it is missing or out of range)."""
    n = int(config.get("num_labels") or len(config.get("id2label") or {}) or 1)
    names = config.get("id2label") or {}
    if label_index is None:
        if n != 1:
            raise ConfigError(f"{KEY}.label_index: the head of {path} has {n} labels ({dict(names) or 'unnamed'}); "
                              f"set {KEY}.label_index to the one that scores the sample (0..{n - 1})")
        return 0
    if not 0 <= label_index < n:
        raise ConfigError(f"{KEY}.label_index: {label_index} is outside the head of {path}, which has {n} "
                          f"label(s); use 0..{n - 1}")
    return label_index


def check_reward_model(rm: RewardModelConfig):
    """What can be checked before any weight loads: a sequence-classification folder, the label to read, a
    tokenizer with a pad token. Returns (label index, tokenizer)."""
    label = label_to_read(read_head(rm.path), rm.label_index, rm.path)
    return label, load_reward_tokenizer(rm)


def load_reward_tokenizer(rm: RewardModelConfig):
    """The reward model's tokenizer; without a pad token it gets eos (warned once, the policy's rule)."""
    tok = load_tokenizer(rm.path, rm.trust_remote_code, key=f"{KEY}.path")
    tok.padding_side = "right"
    return tok


def load_reward_module(rm: RewardModelConfig, cfg: JobConfig, device: str | torch.device = "cpu"):
    """The reward model as a plain module in eval mode on `device` (a reward server's); use the ZeRO-3 engine of
    train/engines.py on trainer ranks. Returns (module, tokenizer, label index)."""
    from transformers import AutoModelForSequenceClassification

    label, tok = check_reward_model(rm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForSequenceClassification.from_pretrained(
            rm.path, dtype=torch_dtype(rm.dtype or cfg.model.dtype), trust_remote_code=rm.trust_remote_code)
    model.config.pad_token_id = tok.pad_token_id
    model.requires_grad_(False)
    return model.to(device).eval(), tok, label


# --------------------------------------------------------------------------- scores from the head's output


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    import torch

    """[B] position of each row's last real token, whether the rows are padded on the left or the right."""
    pos = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (attention_mask.long() * (pos + 1)).argmax(-1)


def select_scores(out: torch.Tensor, n: int, label_index: int, num_labels: int) -> torch.Tensor:
    """One score per sample from a reward model's output; (B, 1) is squeezed (warned once), (B, labels) read at
    label_index, any other shape is a RewardError naming it and the fix."""
    shape = tuple(out.shape)
    if shape == (n,):
        return out
    if shape == (n, 1) and num_labels == 1:
        _warn_once("squeeze", "reward model output has shape (B, 1); squeezed to (B,): one score per sample")
        return out[:, 0]
    if len(shape) == 2 and shape[0] == n and shape[1] == num_labels:
        return out[:, label_index]
    raise RewardError(f"reward model output has shape {shape} for {n} samples; a reward model gives one score per "
                      f"sample, shape ({n},) or ({n}, num_labels={num_labels}): load a sequence-classification head "
                      "(AutoModelForSequenceClassification), not a token-level or language-model head")


def transform(logits: np.ndarray, rm: RewardModelConfig) -> np.ndarray:
    """transform(scale * (logit - shift)) for the reward model's raw logits."""
    z = rm.scale * (np.asarray(logits, dtype=np.float64) - rm.shift)
    if rm.transform == "sigmoid":
        return 1.0 / (1.0 + np.exp(-z))
    if rm.transform == "tanh":
        return np.tanh(z)
    return z


def check_finite(values: np.ndarray, what: str = "reward model") -> None:
    """RewardError naming the first sample whose score is not finite."""
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        i = int(bad[0])
        raise RewardError(f"{what}: sample {i} scored {values[i]} ({bad.size} non-finite score(s)); check the "
                          f"model's dtype ({KEY}.dtype float32 or bfloat16, not float16) and its weights")


class HeadTap:
    """Calls a reward model and reads its per-token head output at the last real token.

    Decoder reward models (Llama, Qwen2, Mistral, Gemma, GPT-2, ...) compute `score(hidden)` at every position and
    then pool by the pad id; the pooling is done here instead, from the attention mask. Other heads (BERT-like
    classifiers on a pooled first token) return their own (B, labels) output.
    """

    def __init__(self, model, label_index: int):
        self.model = model
        module = getattr(model, "module", model)
        self.num_labels = int(getattr(module.config, "num_labels", 1))
        head = getattr(module, "score", None)
        import torch

        self.head = head if isinstance(head, torch.nn.Linear) else None
        self.label_index = label_index

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B] raw logits (float32) of right-padded rows."""
        import torch

        with torch.no_grad():
            return self._scores(input_ids, attention_mask)

    def _scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        import torch

        n = input_ids.shape[0]
        seen: list[torch.Tensor] = []
        hook = self.head.register_forward_hook(lambda _m, _i, o: seen.append(o)) if self.head is not None else None
        try:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask)
        finally:
            if hook is not None:
                hook.remove()
        if seen and seen[0].dim() == 3 and seen[0].shape[-1] == self.num_labels:  # [B, T, labels]: at the last real token
            per_token = seen[0]
            pooled = per_token[torch.arange(n, device=per_token.device), last_token_index(attention_mask)]
            return pooled[:, self.label_index].float()
        logits = out.logits if hasattr(out, "logits") else out
        return select_scores(logits.float(), n, self.label_index, self.num_labels)


def pad_right(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows right-padded: (input_ids, attention_mask), the positions counted from 0 as the model expects."""
    import torch

    width = max(1, max(len(r) for r in rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        att[i, :len(r)] = 1
    return ids.to(device), att.to(device)


def score_sequences(tap: HeadTap, sequences: list[list[int]], batch_size: int, pad_id: int, device,
                    batches: int | None = None) -> np.ndarray:
    """Raw logits of token sequences, `batch_size` at a time, sorted by length (little padding); with `batches`,
    exactly that many forwards (ZeRO-3 ranks must run as many as each other; extra ones score a 1-token row)."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    chunks = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
    out = np.zeros(len(sequences), dtype=np.float64)
    for c in range(max(len(chunks), batches or 0)):
        idx = chunks[c] if c < len(chunks) else []
        ids, att = pad_right([sequences[i] for i in idx] or [[pad_id]], pad_id, device)
        logits = tap(ids, att).double().cpu().numpy()
        if idx:
            out[idx] = logits
    return out


def forwards_needed(n: int, batch_size: int) -> int:
    return math.ceil(n / batch_size)


# --------------------------------------------------------------------------- the reward model's inputs


def same_tokenizer(a, b) -> bool:
    """Whether token ids of `a` mean the same text to `b`, rendered the same way (vocabulary and chat template)."""
    return a.get_vocab() == b.get_vocab() and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)


class RewardInputs:
    """The reward model's token ids of a sample: the policy's ids as they are when both tokenizers agree, else
    the decoded text tokenized again (with the reward model's chat template when it has one); the last
    max_length tokens (the scored token is the last)."""

    def __init__(self, policy_tok, rm_tok, max_length: int):
        self.policy_tok, self.rm_tok, self.max_length = policy_tok, rm_tok, max_length
        self.same = same_tokenizer(policy_tok, rm_tok)
        self.truncated = 0

    def __call__(self, prompt_ids: list[int], response_ids: list[int], prompt, response_text: str) -> list[int]:
        """`prompt` is the dataset row's prompt (a string or chat messages) for the re-tokenized case."""
        if self.same:
            ids = list(prompt_ids) + list(response_ids)
        elif getattr(self.rm_tok, "chat_template", None):
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            ids = self.rm_tok.apply_chat_template(list(messages) + [{"role": "assistant", "content": response_text}],
                                                  tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers returns a BatchEncoding lately
                ids = ids["input_ids"]
            ids = list(ids)
        else:
            text = prompt if isinstance(prompt, str) else self.policy_tok.decode(prompt_ids, skip_special_tokens=False)
            ids = self.rm_tok(text + response_text)["input_ids"]
        if len(ids) > self.max_length:
            self.truncated += 1
            ids = ids[-self.max_length:]
        return ids
