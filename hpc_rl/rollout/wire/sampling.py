"""What a generation request asks for and what each sample returns: the types both sides of the wire use."""

from __future__ import annotations

from dataclasses import dataclass, field

GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    """Per-request sampling settings; top_k -1 means off.

    Seeds: `seeds` (one per prompt) wins over `seed` (the request's: prompt i then has seed + i * n); sample j of a
    prompt with seed s samples with s + j (vLLM's convention for a request's n children). None: nondeterministic."""

    n: int = 1
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    seeds: list[int] | None = None

    @property
    def greedy(self) -> bool:
        """Temperatures this small sample the argmax (vLLM's threshold): dividing logits by them overflows."""
        return self.temperature < GREEDY_BELOW

    def prompt_seed(self, i: int) -> int | None:
        """The seed of prompt i of the request (None: nondeterministic)."""
        if self.seeds is not None:
            return int(self.seeds[i])
        return None if self.seed is None else int(self.seed) + i * self.n


@dataclass
class SampleOut:
    """One sample: generated token ids (EOS included when it ended the sample), their raw log-probs
    (log_softmax of the logits at temperature 1, before top-k/top-p), and "stop" or "length"."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    # The policy version that sampled each token, when weights changed during the sample (in-flight updates);
    # None: every token comes from the response's policy_version.
    versions: list[int] | None = None

    def token_versions(self, version: int) -> list[int]:
        """The version of each token, `version` (the response's) where the engine reported none."""
        return list(self.versions) if self.versions is not None else [int(version)] * len(self.token_ids)


@dataclass
class TopLogprobs:
    """What /logprobs with top_k returns for each row: the raw log-prob of every token after the prompt, and at each
    of those positions the k likeliest tokens (ids, likeliest first) and their raw log-probs."""

    logprobs: list[list[float]]
    top_ids: list[list[list[int]]]
    top_logprobs: list[list[list[float]]]
    version: int | None = None  # the policy version that computed them, when the engine knows (in-flight updates)
