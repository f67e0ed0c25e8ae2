"""Tool calls on the OpenAI-compatible routes: the `tools` and `tool_choice` of a chat request checked, and the
completion's tool calls parsed into OpenAI's `message.tool_calls` (rollout.tool_call_parser), in the conventions of
the model families' chat templates, as vLLM's tool parsers of the same names read them:

  hermes       Hermes, Qwen2.5, Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in the text
  llama3_json  Llama 3.1-3.3: the completion is one JSON object `{"name": ..., "parameters": {...}}` (or several
               separated by `;`), after `<|python_tag|>` or not
  mistral      Mistral: `[TOOL_CALLS]` and a JSON list of `{"name": ..., "arguments": {...}}` (the marker is a special
               token that decoding drops: a completion that is such a list)
  auto         (default) whichever of the three the completion is written in

A completion whose calls are not valid JSON calls is returned as text, unparsed (the agent sees what the model wrote);
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


def parse_tool_calls(text: str, parser: str = "hermes") -> tuple[str | None, list[dict]]:
    """(the text outside the tool calls, or None when there is none; the calls as OpenAI's tool_calls) of a
    completion, read by `parser` (TOOL_CALL_PARSERS, or auto: the first that finds calls); (text, []) when it finds
    none or a call is not a JSON object with a name."""
    if parser == "auto":
        for fn in TOOL_CALL_PARSERS.values():
            content, calls = fn(text)
            if calls:
                return content, calls
        return text, []
    return TOOL_CALL_PARSERS[parser](text)


def parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    """`<tool_call>{...}</tool_call>` blocks anywhere in the text (vLLM's hermes parser)."""
    blocks = CALL_RE.findall(text)
    if not blocks:
        return text, []
    calls = []
    for raw in blocks:
        try:
            call = json.loads(raw)
        except json.JSONDecodeError:
            return text, []
        if not _is_call(call):
            return text, []
        calls.append(_tool_call(call))
    rest = CALL_RE.sub("", text).strip()
    return (rest or None), calls


def parse_llama3_json(text: str) -> tuple[str | None, list[dict]]:
    """The whole completion as JSON call objects separated by `;`, after an optional `<|python_tag|>` (vLLM's
    llama3_json parser; the arguments under "parameters", as Llama's templates ask, or "arguments")."""
    s = text.strip()
    if s.startswith(PYTHON_TAG):
        s = s[len(PYTHON_TAG):].lstrip()
    if not s.startswith("{"):
        return text, []
    calls, i, decoder = [], 0, json.JSONDecoder()
    while i < len(s):
        try:
            call, i = decoder.raw_decode(s, i)
        except json.JSONDecodeError:
            return text, []
        if not _is_call(call):
            return text, []
        calls.append(_tool_call(call))
        while i < len(s) and s[i] in "; \n\t":
            i += 1
    return None, calls


def parse_mistral(text: str) -> tuple[str | None, list[dict]]:
    """A JSON list of call objects after `[TOOL_CALLS]` (the text before it is the content), or the whole completion
    when decoding dropped the marker (vLLM's mistral parser)."""
    content, marker, rest = text.partition(MISTRAL_TAG)
    if not marker:
        content, rest = "", text
    rest = rest.strip()
    if not rest.startswith("["):
        return text, []
    try:
        calls, end = json.JSONDecoder().raw_decode(rest)
    except json.JSONDecodeError:
        return text, []
    if rest[end:].strip() or not calls or not all(_is_call(c) for c in calls):
        return text, []
    return (content.strip() or None), [_tool_call(c) for c in calls]


PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"
# rollout.tool_call_parser's names (vLLM's --tool-call-parser names), besides auto.
TOOL_CALL_PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral}


def _is_call(call: Any) -> bool:
    return isinstance(call, dict) and isinstance(call.get("name"), str) and bool(call["name"])


def _tool_call(call: dict) -> dict:
    args: Any = call.get("arguments", call.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


def check_template_tools(tokenizer, tools: list[dict] | None, where: str) -> None:
    """BadRequest when a request's tools would be dropped: a chat template that never reads `tools`."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if tools and "tools" not in (template if isinstance(template, str) else json.dumps(template)):
        raise BadRequest(f"tools: the chat template of {where} does not render tools; use a model whose template "
                         "does (Qwen2.5, Hermes) or put them in a system message")
