"""What a generation request asks for and what each sample returns: the types both sides of the wire use."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Per-request sampling settings; top_k -1 means off, seed None means nondeterministic."""

    n: int = 1
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None


@dataclass
class SampleOut:
    """One sample: generated token ids (EOS included when it ended the sample), their raw log-probs
    (log_softmax of the logits at temperature 1, before top-k/top-p), and "stop" or "length"."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
