"""ToolCallEnv: the model calls built-in tools with Hermes/Qwen2.5-style `<tool_call>{json}</tool_call>` blocks.

Each assistant turn with tool calls gets one `tool` message per call (the tool's output, or `error: ...`); a turn
without a tool call is the final answer (scored by reward.function). Rewards come from the reward function only.
"""

from __future__ import annotations

import json

from ..wire.tool_calls import CALL_RE
from .base import Environment, first_messages
from .tools import TOOLS, error, tool_schemas

MAX_CALLS_PER_TURN = 4


class ToolCallEnv(Environment):
    """env_kwargs: tools (names of built-in tools, default [python]), system (an optional system message)."""

    def __init__(self, tools: list | None = None, system: str | None = None):
        names = list(tools) if tools is not None else ["python"]
        unknown = [n for n in names if n not in TOOLS]
        if unknown:
            raise ValueError(f"rollout.env_kwargs.tools: unknown tool {unknown[0]!r}; built-in tools are "
                             f"{', '.join(sorted(TOOLS))}")
        self.names = names
        self.tools = tool_schemas(names)
        self.system = system

    def reset(self, row: dict) -> list[dict]:
        return first_messages(row, self.system)

    def step(self, message: dict):
        calls = CALL_RE.findall(message["content"])
        if not calls:
            return None, None, True
        return [{"role": "tool", "content": self._call(c)} for c in calls[:MAX_CALLS_PER_TURN]], None, False

    def _call(self, raw: str) -> str:
        try:
            call = json.loads(raw)
        except json.JSONDecodeError as e:
            return error(f"tool call: not valid JSON ({e.msg} at character {e.pos}); send "
                         '{"name": ..., "arguments": {...}}')
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return error('tool call: expected {"name": ..., "arguments": {...}}')
        name, args = call["name"], call.get("arguments", {})
        if name not in self.names:
            return error(f"tool call: no tool {name!r}; available: {', '.join(self.names)}")
        if isinstance(args, str):  # some models send the arguments JSON-encoded
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return error("tool call: arguments must be a JSON object")
        if not isinstance(args, dict):
            return error("tool call: arguments must be a JSON object")
        return TOOLS[name][0](args, self.context)
