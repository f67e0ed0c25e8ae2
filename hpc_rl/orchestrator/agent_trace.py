"""An agent episode's recorded calls become training samples, on the engine's exact tokens.

Each call an episode makes through the OpenAI-compatible API is recorded with the prompt's token ids, the generated
token ids, their log-probs and the policy version that generated them. A call whose prompt extends a sample's
prompt + response (the agent appended the reply and what came back, as a chat does; the newest such sample, so a
conversation resumed after a sub-task's calls continues too) continues that sample: the new prompt tokens join the
response masked (0: not trained), the generated ones unmasked (1). A call that extends none (the agent rewrote its
history, or started a sub-task) starts a sample of its own. All samples of an episode share its reward and group.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Call:
    """One recorded generation: what the engine was given and what it generated."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # the engine's raw log-prob of each completion token
    version: int  # the policy version that generated it
    finish_reason: str  # "stop" or "length"

    def __post_init__(self):
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(f"Call: {len(self.logprobs)} log-probs for {len(self.completion_ids)} completion tokens")


@dataclass
class TraceSample:
    """One training sequence of an episode: the first call's prompt, then every later token (masked or not)."""

    prompt: list[int]
    response: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # 0.0 at masked tokens
    versions: list[int] = field(default_factory=list)  # per call of the sample
    truncated: bool = False  # its last call stopped at max_tokens
    calls: int = 0

    @property
    def version(self) -> int:
        """The oldest policy version among its calls (what off-policy corrections compare against)."""
        return min(self.versions)

    def extends(self, call: Call) -> bool:
        full = self.prompt + self.response
        return len(call.prompt_ids) >= len(full) and call.prompt_ids[:len(full)] == full

    def add(self, call: Call, inserted: list[int]) -> None:
        self.response += inserted + call.completion_ids
        self.loss_mask += [0] * len(inserted) + [1] * len(call.completion_ids)
        self.logprobs += [0.0] * len(inserted) + list(call.logprobs)
        self.versions.append(call.version)
        self.truncated = call.finish_reason == "length"
        self.calls += 1


def samples_of(calls: list[Call]) -> list[TraceSample]:
    """The samples of an episode's calls, in call order (see the module's docstring)."""
    samples: list[TraceSample] = []
    for call in calls:
        into = next((s for s in reversed(samples) if s.extends(call)), None)
        if into is not None:
            into.add(call, call.prompt_ids[len(into.prompt) + len(into.response):])
        else:
            sample = TraceSample(prompt=list(call.prompt_ids))
            sample.add(call, [])
            samples.append(sample)
    return samples
