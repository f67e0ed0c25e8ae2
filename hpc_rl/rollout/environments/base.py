"""The environment interface of multi-turn rollouts (`rollout.env: pkg.mod:Class`).

One instance per trajectory, built as `Class(**rollout.env_kwargs)`; the rollout loop then sets `context` (the
tools' sandbox settings) and calls:

    reset(row) -> messages                       the first chat messages, from the dataset row
    step(message) -> (observations, reward, done)
        message: {"role": "assistant", "content": text} of the turn just sampled
        observations: chat messages (e.g. {"role": "tool", "content": ...}) appended before the next turn, or None
        reward: a float added to the trajectory's environment reward, or None
        done: True ends the trajectory (its last assistant turn is the final answer)

`tools` (JSON schemas) go to the chat template. An observation whose content starts with "error: " counts as a
tool error. step runs in a worker thread of the controller, many trajectories at a time: keep state on the
instance, not in globals.
"""

from __future__ import annotations

from .tools import ToolContext


class Environment:
    """Base class (optional: any class with reset and step works)."""

    tools: list[dict] = []
    context: ToolContext = ToolContext()

    def reset(self, row: dict) -> list[dict]:
        raise NotImplementedError

    def step(self, message: dict) -> tuple[list[dict] | None, float | None, bool]:
        raise NotImplementedError


def first_messages(row: dict, system: str | None = None) -> list[dict]:
    """A row's prompt as chat messages (a string is one user message), after an optional system message."""
    p = row["prompt"]
    msgs = [{"role": "user", "content": p}] if isinstance(p, str) else [dict(m) for m in p]
    return ([{"role": "system", "content": system}] if system else []) + msgs
