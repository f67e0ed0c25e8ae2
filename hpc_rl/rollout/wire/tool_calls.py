"""Tool calls on the OpenAI-compatible routes: the `tools` and `tool_choice` of a chat request checked, and the
Hermes/Qwen2.5 convention that chat templates with tools use (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
in the completion's text) parsed into OpenAI's `message.tool_calls`, as vLLM's `hermes` tool parser does.

A completion whose blocks are not valid JSON calls is returned as text, unparsed (the agent sees what the model wrote);
the tokens trained on are the engine's either way.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from .protocol import BadRequest

CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def check_tools(body: dict) -> tuple[list[dict] | None, bool]:
    """(the request's tools for the chat template, whether the completion's tool calls are parsed); BadRequest naming
    the field. tool_choice: auto (the default with tools) or none; a forced call needs constrained decoding, which the
    engines here do not do."""
    tools, choice = body.get("tools"), body.get("tool_choice", "auto")
    if tools is None:
        if choice not in ("auto", "none"):
            raise BadRequest("tool_choice: set without tools; send tools or leave tool_choice out")
        return None, False
    if not isinstance(tools, list) or not tools:
        raise BadRequest("tools: expected a non-empty list of {\"type\": \"function\", \"function\": {...}} objects")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(f"tools[{i}]: expected {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                             "\"parameters\": {...}}}")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise BadRequest(f"tools[{i}].function.parameters: expected a JSON schema object")
    if choice not in ("auto", "none"):
        raise BadRequest(f"tool_choice: {json.dumps(choice)[:80]} is not served (only \"auto\" and \"none\": forcing a "
                         "call needs constrained decoding); send \"auto\" and check the reply's tool_calls")
    return tools, choice == "auto"


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as chat templates take them: an assistant's tool-call arguments as objects (OpenAI clients send
    them JSON-encoded; the templates write them with `tojson`)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and isinstance(calls, list):
            fixed = []
            for c in calls:
                fn = dict(c.get("function") or {}) if isinstance(c, dict) else {}
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        pass  # the template writes the string as it came
                fixed.append({**c, "function": fn} if isinstance(c, dict) else c)
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(the text outside the tool-call blocks, or None when there is none; the calls as OpenAI's tool_calls) of a
    completion; ([text], []) when a block is not a JSON object with a name."""
    blocks = CALL_RE.findall(text)
    if not blocks:
        return text, []
    calls = []
    for raw in blocks:
        try:
            call = json.loads(raw)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        args: Any = call.get("arguments", call.get("parameters", {}))
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"],
                                   "arguments": args if isinstance(args, str) else json.dumps(args)}})
    rest = CALL_RE.sub("", text).strip()
    return (rest or None), calls


def check_template_tools(tokenizer, tools: list[dict] | None, where: str) -> None:
    """BadRequest when a request's tools would be dropped: a chat template that never reads `tools`."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if tools and "tools" not in (template if isinstance(template, str) else json.dumps(template)):
        raise BadRequest(f"tools: the chat template of {where} does not render tools; use a model whose template "
                         "does (Qwen2.5, Hermes) or put them in a system message")
