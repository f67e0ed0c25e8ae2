"""Tool calls on the OpenAI-compatible routes (rollout/wire/tool_calls.py): `tools` checked and given to the chat
template, Hermes/Qwen2.5 `<tool_call>` blocks in a completion returned as `message.tool_calls` (read back by the real
openai SDK's types, streamed or not), and the agent front's continuation key that matches a reply with tool calls as
an agent sends it back. The routes with a real server and the SDK: tests/test_agents.py."""

from __future__ import annotations

import json

import pytest

from hpc_rl.orchestrator.agent_front import _plain
from hpc_rl.rollout.wire import openai_api
from hpc_rl.rollout.wire.protocol import BadRequest, RequestLimits
from hpc_rl.rollout.wire.sampling import SampleOut
from hpc_rl.rollout.wire.tool_calls import check_tools, parse_tool_calls, template_messages

TOOLS = [{"type": "function", "function": {"name": "add", "description": "adds two numbers",
                                            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]
REPLY = 'Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def _chat(body: dict, seen: list) -> openai_api.Request:
    def render(messages, tools):
        seen.append((messages, tools))
        return [1, 2, 3]

    return openai_api.parse_chat(body, render, 100, RequestLimits(64), openai_api.Defaults())


def test_tools_reach_the_template_and_arguments_go_as_objects():
    seen = []
    history = [{"role": "user", "content": "1 + 2"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    req = _chat({"messages": history, "tools": TOOLS}, seen)
    (messages, tools), = seen
    assert tools == TOOLS and req.tools == TOOLS and req.parse_tools
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2} and messages[1]["content"] == ""
    assert messages[2]["tool_call_id"] == "c1"
    assert not _chat({"messages": history, "tools": TOOLS, "tool_choice": "none"}, []).parse_tools
    assert template_messages([{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "not json"}}]}])[0]["tool_calls"][0]["function"]["arguments"] == \
        "not json"


@pytest.mark.parametrize("body, expect", [
    ({"tools": TOOLS, "tool_choice": "required"}, r'tool_choice: "required" is not served'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice: .* not served"),
    ({"tools": []}, "tools: expected a non-empty list"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, r"tools\[0\]: expected"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, r"tools\[0\].function.parameters"),
    ({"tool_choice": "required"}, "tool_choice: set without tools"),
])
def test_bad_tools_are_refused_in_one_line_naming_the_field(body, expect):
    with pytest.raises(BadRequest, match=expect) as e:
        check_tools(body)
    assert "\n" not in str(e.value)


def test_hermes_blocks_become_tool_calls():
    content, calls = parse_tool_calls(REPLY + '<tool_call>{"name": "add", "arguments": "{\\"a\\": 5}"}</tool_call>')
    assert content == "Let me add."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "add", {"a": 1, "b": 2}), ("function", "add", {"a": 5})]
    assert len({c["id"] for c in calls}) == 2
    assert parse_tool_calls('<tool_call>{"name": "add"}</tool_call>')[0] is None  # nothing around the call
    for text in ("no call", "<tool_call>{not json}</tool_call>", '<tool_call>["add"]</tool_call>'):
        assert parse_tool_calls(text) == (text, [])  # returned as the model wrote it


LLAMA = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "neg", "parameters": {"a": 3}}'
MISTRAL = ' [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "neg", "arguments": {"a": 3}}]'
WANT = [("add", {"a": 1, "b": 2}), ("neg", {"a": 3})]


def _named(calls: list[dict]) -> list[tuple]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("parser, text, content", [
    ("llama3_json", LLAMA, None),
    ("llama3_json", LLAMA.removeprefix("<|python_tag|>"), None),  # decoding dropped the special token
    ("mistral", MISTRAL, None),  # decoding dropped [TOOL_CALLS]
    ("mistral", "Adding. [TOOL_CALLS]" + MISTRAL, "Adding."),
])
def test_llama_and_mistral_calls_become_tool_calls(parser, text, content):
    assert (lambda r: (r[0], _named(r[1])))(parse_tool_calls(text, parser)) == (content, WANT)
    assert (lambda r: (r[0], _named(r[1])))(parse_tool_calls(text, "auto")) == (content, WANT)
    assert parse_tool_calls(text, "hermes") == (text, [])  # another family's format is text to the others


@pytest.mark.parametrize("parser", ["llama3_json", "mistral", "auto"])
def test_text_that_only_looks_like_a_call_stays_text(parser):
    for text in ('{"a": 1}', '{"name": "add"} and then some words', '[{"name": "add"}] trailing', "[1, 2]",
                 '{"name": "add", ', "The answer is 3.", '[{"name": ""}]'):
        assert parse_tool_calls(text, parser) == (text, []), text


def test_the_run_reads_the_tool_calls_of_its_models_family():
    """rollout.tool_call_parser reaches the chat route's reply through the run's defaults (servers and agents)."""
    from hpc_rl import config

    for parser, reply, want in [("llama3_json", LLAMA, WANT), ("hermes", LLAMA, []), ("auto", REPLY, WANT[:1]),
                                ("auto", MISTRAL, WANT)]:
        cfg = config.load_dict({"name": "t", "model": {"path": "m"}, "rollout": {"tool_call_parser": parser}})
        req = openai_api.parse_chat({"messages": [{"role": "user", "content": "1 + 2"}], "tools": TOOLS},
                                    lambda m, t: [1, 2], 100, RequestLimits(64), openai_api.Defaults.of(cfg.rollout))
        out = openai_api.chat_response(req, [[SampleOut([7], [-0.1], "stop")]], lambda ids, reply=reply: reply, "m", 0)
        got = _named(out["choices"][0]["message"].get("tool_calls", []))
        assert got == want, (parser, reply)
    with pytest.raises(config.ConfigError, match="rollout.tool_call_parser") as e:
        config.load_dict({"name": "t", "model": {"path": "m"}, "rollout": {"tool_call_parser": "qwen"}})
    assert "llama3_json" in str(e.value) and "\n" not in str(e.value)


def test_the_sdk_reads_the_tool_calls_streamed_or_not():
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    req = _chat({"messages": [{"role": "user", "content": "1 + 2"}], "tools": TOOLS, "return_token_ids": True}, [])
    out = openai_api.chat_response(req, [[SampleOut([7, 8], [-0.1, -0.2], "stop")]], lambda ids: REPLY, "m", 3)
    msg = ChatCompletion.model_validate(out).choices[0]
    assert msg.finish_reason == "tool_calls" and msg.message.content == "Let me add."
    (call,) = msg.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}
    # the reply as an agent sends it back is the recorded reply for the front's continuation check
    echo = msg.message.model_dump(exclude_none=True)
    assert _plain(echo) == _plain(openai_api.assistant_message(req, REPLY))
    assert _plain(echo) != _plain({"role": "assistant", "content": "Let me add.", "tool_calls": [
        {"function": {"name": "add", "arguments": '{"a": 2}'}}]})

    req.stream = True
    events = openai_api.encode(openai_api.chat_response(req, [[SampleOut([7], [-0.1], "stop")]],
                                                        lambda ids: REPLY, "m", 3))[0].decode().split("\n\n")
    chunks = [ChatCompletionChunk.model_validate(json.loads(e[6:])) for e in events if e and e != "data: [DONE]"]
    (delta_call,) = chunks[0].choices[0].delta.tool_calls
    assert delta_call.index == 0 and delta_call.function.name == "add"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # without tools (or tool_choice none) the text is the content, as the model wrote it
    plain = _chat({"messages": [{"role": "user", "content": "1 + 2"}]}, [])
    out = openai_api.chat_response(plain, [[SampleOut([7], [-0.1], "stop")]], lambda ids: REPLY, "m", 3)
    assert out["choices"][0]["message"] == {"role": "assistant", "content": REPLY}
    assert out["choices"][0]["finish_reason"] == "stop"
