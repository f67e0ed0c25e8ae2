"""The OpenAI-compatible side of the rollout server: /v1/models, /v1/completions and /v1/chat/completions bodies in,
responses out, as `openai.OpenAI(base_url=SERVER + "/v1", api_key=RUN_TOKEN)` sends and reads them. `stream: true`
is answered as server-sent events (OpenAI's chunk objects, `stream_options.include_usage` honoured) once the whole
completion is generated: the engines sample a batch at a time, so the events come together, which every streaming
client reads as a fast stream (agent harnesses such as verifiers' stream every call).

Any `model` string is accepted: a server serves the run's one policy. Sampling fields a request leaves out take the
run's `rollout:` settings. `return_token_ids: true` (vLLM's convention) adds the prompt's and each choice's token ids,
so an agent's caller can train on exactly the tokens the engine generated; `logprobs` returns the sampled tokens'
raw log-probs (top alternatives are not served). Every response carries the `policy_version` that generated it.
Chat `tools` go to the chat template, and the completion's tool calls come back as `message.tool_calls`
(tool_calls.py).
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .protocol import BadRequest, RequestLimits, check_text, int_field, json_object, parse_generate
from .sampling import SampleOut, SamplingParams
from .tool_calls import check_tools, parse_tool_calls, template_messages

# Fields OpenAI clients send that change nothing here; anything else unknown is refused by name.
_IGNORED = {"model", "user", "stream", "stream_options", "echo", "frequency_penalty", "presence_penalty", "metadata", "store",
            "parallel_tool_calls", "service_tier"}
_COMPLETIONS_FIELDS = {"prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "logprobs",
                       "return_token_ids"}
_CHAT_FIELDS = {"messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n", "seed",
                "logprobs", "top_logprobs", "return_token_ids", "tools", "tool_choice"}
_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class Defaults:
    """The run's sampling settings: what a request that leaves a field out gets; and how a chat reply's tool calls
    are read (rollout.tool_call_parser)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    tool_call_parser: str = "auto"

    @classmethod
    def of(cls, rollout) -> Defaults:
        return cls(rollout.max_new_tokens, rollout.temperature, rollout.top_p, rollout.top_k, rollout.tool_call_parser)


@dataclass
class Request:
    """A validated completion request: prompts as token ids and what the response should hold."""

    prompts: list[list[int]]
    params: SamplingParams
    logprobs: bool
    token_ids: bool
    stream: bool = False  # answer as server-sent events
    include_usage: bool = False  # stream_options.include_usage: a last event with the usage
    tools: list[dict] | None = None  # a chat request's tools, as the chat template rendered them
    parse_tools: bool = False  # the completion's tool calls become message.tool_calls (tool_choice auto)
    tool_call_parser: str = "auto"  # ... read by this parser (tool_calls.TOOL_CALL_PARSERS or auto)


class Streamed(dict):
    """A response body to send as server-sent events (`sse`), not as one JSON object."""

    include_usage: bool = False


def _stream_fields(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise BadRequest("stream: expected true or false")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
        raise BadRequest("stream_options: expected {\"include_usage\": true or false}")
    if opts and not stream:
        raise BadRequest("stream_options: only with stream: true")
    return stream, bool(opts.get("include_usage", False))


def _common(body: dict, fields: set[str], what: str) -> None:
    extra = sorted(set(body) - fields - _IGNORED)
    if extra:
        raise BadRequest(f"{extra[0]}: not supported by {what}; valid fields are {', '.join(sorted(fields))}")
    if body.get("echo"):
        raise BadRequest("echo: not supported; send echo: false")
    if not isinstance(body.get("return_token_ids", False), bool):
        raise BadRequest("return_token_ids: expected true or false")


def _params(body: dict, prompts: list[list[int]], max_tokens: Any, d: Defaults, vocab: int | None,
            limits: RequestLimits) -> tuple[list[list[int]], SamplingParams]:
    def given(value, default):  # OpenAI's SDK sends null for "not given"
        return default if value is None else value

    gen = {"prompt_token_ids": prompts, "max_new_tokens": given(max_tokens, d.max_tokens),
           "n": given(body.get("n"), 1), "temperature": given(body.get("temperature"), d.temperature),
           "top_p": given(body.get("top_p"), d.top_p), "top_k": given(body.get("top_k"), d.top_k),
           "seed": body.get("seed")}
    try:
        return parse_generate(gen, vocab, limits)
    except BadRequest as e:  # name the OpenAI field, not the internal one
        raise BadRequest(str(e).replace("max_new_tokens", "max_tokens").replace("prompt_token_ids", "prompt")) from None


def parse_completions(body: Any, tokenize: Callable[[str], list[int]], vocab: int | None, limits: RequestLimits,
                      defaults: Defaults) -> Request:
    """Validate a /v1/completions body. `prompt`: a string, a list of strings, a list of token ids, or a list of
    token-id lists; `tokenize(str) -> list[int]` turns text into ids. logprobs: null, or 0 (the sampled tokens')."""
    body = json_object(body)
    _common(body, _COMPLETIONS_FIELDS, "/v1/completions")
    if "prompt" not in body:
        raise BadRequest("prompt: missing; send a string, a list of strings or a list of token ids")
    p = body["prompt"]
    if isinstance(p, str):
        rows: Any = [tokenize(p)]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        rows = [tokenize(x) for x in p]
    elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        rows = [p]
    elif isinstance(p, list) and p and all(isinstance(x, list) for x in p):
        rows = p
    else:
        raise BadRequest("prompt: expected a string, a list of strings, a list of token ids or a list of token-id lists")
    if any(not r for r in rows):
        raise BadRequest("prompt: a prompt tokenizes to no tokens; send non-empty text")
    prompts, params = _params(body, rows, body.get("max_tokens"), defaults, vocab, limits)
    lp = body.get("logprobs")
    if lp is not None:
        int_field(lp, "logprobs", 0)
        if lp > 0:
            raise BadRequest(f"logprobs: {lp} top alternatives are not served; send 0 for the sampled tokens' "
                             "log-probs or null")
    return Request(prompts, params, lp is not None, bool(body.get("return_token_ids", False)), *_stream_fields(body))


def check_messages(messages: Any) -> list[dict]:
    """The chat messages, each {"role", "content"} with text content (a string, or a list of text parts joined);
    BadRequest naming the message otherwise."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: expected a non-empty list of {\"role\": ..., \"content\": ...} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}]: expected an object with role and content")
        role = m.get("role")
        if role not in _ROLES:
            raise BadRequest(f"messages[{i}].role: {role!r} is not one of {', '.join(_ROLES)}")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise BadRequest(f"messages[{i}].content[{j}]: only text parts ({{\"type\": \"text\", \"text\": "
                                     "...}) are served by a text model")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None and role == "assistant" and m.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content: expected a string or a list of text parts")
        check_text(content, f"messages[{i}].content")
        out.append({**m, "content": content})
    return out


def parse_chat(body: Any, render: Callable[[list[dict], list[dict] | None], list[int]], vocab: int | None,
               limits: RequestLimits, defaults: Defaults) -> Request:
    """Validate a /v1/chat/completions body; `render(messages, tools) -> token ids` applies the chat template with
    the generation prompt. logprobs: true gives the sampled tokens' log-probs (top_logprobs must be 0 or absent)."""
    body = json_object(body)
    _common(body, _CHAT_FIELDS, "/v1/chat/completions")
    if "messages" not in body:
        raise BadRequest("messages: missing; send a list of {\"role\": ..., \"content\": ...} objects")
    tools, parse_tools = check_tools(body)
    ids = render(template_messages(check_messages(body["messages"])), tools)
    if not ids:
        raise BadRequest("messages: the chat template renders them to no tokens")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    prompts, params = _params(body, [ids], max_tokens, defaults, vocab, limits)
    lp = body.get("logprobs") or False
    if not isinstance(lp, bool):
        raise BadRequest("logprobs: expected true or false")
    top = body.get("top_logprobs")
    if top not in (None, 0):
        raise BadRequest(f"top_logprobs: {top} alternatives are not served; send 0 or leave it out")
    return Request(prompts, params, lp, bool(body.get("return_token_ids", False)), *_stream_fields(body), tools,
                   parse_tools, defaults.tool_call_parser)


def _usage(req: Request, outputs: list[list[SampleOut]]) -> dict:
    prompt = sum(len(p) for p in req.prompts)
    done = sum(len(s.token_ids) for row in outputs for s in row)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def completion_response(req: Request, outputs: list[list[SampleOut]], decode: Callable[[list[int]], str],
                        model: str, version: int) -> dict:
    """The text_completion object of `outputs` (one row per prompt, n samples each)."""
    choices = []
    for prompt, row in zip(req.prompts, outputs):
        for s in row:
            c = {"index": len(choices), "text": decode(s.token_ids), "finish_reason": s.finish_reason,
                 "logprobs": None}
            if req.logprobs:
                pieces = [decode([t]) for t in s.token_ids]
                offsets = list(itertools.accumulate((len(x) for x in pieces[:-1]), initial=0)) if pieces else []
                c["logprobs"] = {"tokens": pieces, "token_logprobs": s.logprobs, "top_logprobs": None,
                                 "text_offset": offsets}
            if req.token_ids:
                c["prompt_token_ids"], c["token_ids"] = prompt, s.token_ids
            choices.append(c)
    return _streamed(req, {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                           "model": model, "choices": choices, "usage": _usage(req, outputs),
                           "policy_version": version})


def chat_response(req: Request, outputs: list[list[SampleOut]], decode: Callable[[list[int]], str], model: str,
                  version: int) -> dict:
    """The chat.completion object of `outputs` (one prompt, n samples)."""
    choices = []
    for s in outputs[0]:
        c = {"index": len(choices), "message": assistant_message(req, decode(s.token_ids)),
             "finish_reason": s.finish_reason, "logprobs": None}
        if c["message"].get("tool_calls") and s.finish_reason == "stop":
            c["finish_reason"] = "tool_calls"
        if req.logprobs:
            c["logprobs"] = {"content": [{"token": (piece := decode([t])), "logprob": lp,
                                          "bytes": list(piece.encode("utf-8")), "top_logprobs": []}
                                         for t, lp in zip(s.token_ids, s.logprobs)]}
        if req.token_ids:
            c["token_ids"] = s.token_ids
        choices.append(c)
    out = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
           "model": model, "choices": choices, "usage": _usage(req, outputs), "policy_version": version}
    if req.token_ids:
        out["prompt_token_ids"] = req.prompts[0]
    return _streamed(req, out)


def assistant_message(req: Request, text: str) -> dict:
    """The reply's message: its text, or with tools its tool calls and the text around them."""
    if not req.parse_tools:
        return {"role": "assistant", "content": text}
    content, calls = parse_tool_calls(text, req.tool_call_parser)
    return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}


def _streamed(req: Request, out: dict) -> dict:
    if not req.stream:
        return out
    streamed = Streamed(out)
    streamed.include_usage = req.include_usage
    return streamed


def encode(body: dict) -> tuple[bytes, str]:
    """An answer's bytes and content type: one JSON object, or a streamed completion's server-sent events."""
    if isinstance(body, Streamed):
        return sse(body), "text/event-stream"
    return json.dumps(body).encode(), "application/json"


def sse(response: Streamed) -> bytes:
    """A whole response as OpenAI's stream: per choice one chunk with its content (the role, text, log-probs and
    token ids), one with its finish reason; the usage chunk when asked for; then `data: [DONE]`."""
    chat = response["object"] == "chat.completion"
    head = {"id": response["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": response["created"], "model": response["model"], "policy_version": response["policy_version"]}
    if "prompt_token_ids" in response:
        head["prompt_token_ids"] = response["prompt_token_ids"]
    usage = {"usage": None} if response.include_usage else {}
    events = []
    for c in response["choices"]:
        if chat:
            delta = {"role": "assistant", "content": c["message"]["content"]}
            if c["message"].get("tool_calls"):
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(c["message"]["tool_calls"])]
            first = {"index": c["index"], "delta": delta, "logprobs": c["logprobs"], "finish_reason": None}
            last = {"index": c["index"], "delta": {}, "logprobs": None, "finish_reason": c["finish_reason"]}
        else:
            first = {"index": c["index"], "text": c["text"], "logprobs": c["logprobs"], "finish_reason": None}
            last = {"index": c["index"], "text": "", "logprobs": None, "finish_reason": c["finish_reason"]}
        for k in ("token_ids", "prompt_token_ids"):
            if k in c:
                first[k] = c[k]
        events += [{**head, "choices": [first], **usage}, {**head, "choices": [last], **usage}]
    if response.include_usage:
        events.append({**head, "choices": [], "usage": response["usage"]})
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


# OpenAI's error types by HTTP status; the SDK raises its exception by status and carries error.message.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
               503: "service_unavailable_error"}


def error_body(status: int, message: str, **extra) -> dict:
    """An error in OpenAI's shape: {"error": {"message", "type", "code"}}."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "code": status, **extra}}


def models_response(model: str, version: int, max_model_len: int, started: float) -> dict:
    """GET /v1/models: the one policy this server serves."""
    return {"object": "list", "data": [{"id": model, "object": "model", "created": int(started), "owned_by": "hpc-rl",
                                        "max_model_len": max_model_len, "policy_version": version}]}
