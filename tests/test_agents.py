"""OpenAI-SDK agents on the orchestrator side (orchestrator/agents.py, agent_front.py) against a real HF rollout
server of their own, through the real openai SDK: calls recorded on the engine's tokens, failures that lose only
their episode, the front over HTTP. The agent toy learns in tests/test_toy_learning.py."""

import time
from pathlib import Path

import pytest
import requests

from hpc_rl.config import TinyModelConfig
from hpc_rl.data.toy import LOOKUP_CHAT_TEMPLATE
from hpc_rl.models import load_tokenizer
from hpc_rl.models.tiny import build_tiny_model
from hpc_rl.rollout.client.rollout_client import RolloutClient
from hpc_rl.rollout.testing import make_run, start_server, stop_server
from hpc_rl.rollout.wire.sampling import SamplingParams

CORPUS = [f"{i} + {i} = {2 * i}" for i in range(100)]
REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """A rollout server of this module's own (the server tests' module pushes weights and stops its server)."""
    base = tmp_path_factory.mktemp("agent-server")
    model_dir = build_tiny_model(TinyModelConfig(), CORPUS, base / "tiny", chat_template=LOOKUP_CHAT_TEMPLATE)
    run = make_run(base / "runs", model_dir, max_model_len=32, max_samples_per_request=512)
    proc, info = start_server(run, 0, timeout_s=120)
    s = requests.Session()
    s.headers["Authorization"] = "Bearer " + run.read_token()
    ns = type("Srv", (), {})()
    ns.run, ns.proc, ns.url, ns.s, ns.model_dir, ns.started = run, proc, info["url"], s, model_dir, time.time()
    yield ns
    stop_server(proc)



async def two_call_agent(client, task, model="policy"):
    """Asks, appends the reply and a tool message, asks again: one conversation of two calls."""
    messages = [{"role": "user", "content": task["prompt"]}]
    first = await client.chat.completions.create(model=model, messages=messages, max_tokens=3)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "tool", "content": task["answer"]}]
    second = await client.chat.completions.create(model=model, messages=messages, max_tokens=3)
    return {"reward": float(len(second.choices[0].message.content)), "metrics": {"calls": 2.0}}


async def two_conversation_agent(client, task, model="policy"):
    """Two calls whose messages do not extend each other (the second starts afresh, as a sub-agent would)."""
    first = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": task["prompt"]}],
                                                 max_tokens=3)
    again = [{"role": "user", "content": task["answer"]}, {"role": "tool", "content": first.choices[0].message.content}]
    await client.chat.completions.create(model=model, messages=again, max_tokens=3)
    return float(task["id"])


async def failing_agent(client, task):
    """Row 0 raises, row 1 hangs past the timeout, row 2 returns NaN, row 3 a string; the others finish."""
    import asyncio

    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["prompt"]}])
    how = task["id"]
    if how == 0:
        raise KeyError("no such tool")
    if how == 1:
        await asyncio.sleep(60)
    return {2: float("nan"), 3: "great"}.get(how, 1.0)


# A chat template that renders tools (their descriptions, in the tiny vocabulary) before the conversation.
TOOL_TEMPLATE = "{% for t in tools or [] %}{{ t.function.description }} {% endfor %}" + LOOKUP_CHAT_TEMPLATE
TOOLS = [{"type": "function", "function": {"name": "add", "description": "1 + 1 = 2",
                                           "parameters": {"type": "object", "properties": {}}}}]


async def tool_agent(client, task):
    """Two calls with tools, the reply sent back as the SDK returned it, then a call forcing a tool (refused)."""
    import openai

    messages = [{"role": "user", "content": task["prompt"]}]
    first = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=3)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": "c0", "content": task["answer"]}]
    await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=3)
    try:
        await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="required")
    except openai.BadRequestError as e:
        return {"reward": 1.0, "metrics": {"refused": float("tool_choice: \"required\" is not served" in str(e))}}
    return 0.0


def _agents(srv, agent: str, template: str | None = None, **rollout):
    from hpc_rl import config
    from hpc_rl.orchestrator.agent_front import AgentFront
    from hpc_rl.orchestrator.agents import AgentRollout, load_agent
    from hpc_rl.rollout.wire.protocol import RequestLimits

    overrides = [f"rollout.agent={agent}", "rollout.agent_kwargs={}", "rollout.max_model_len=32",
                 *(f"rollout.{k}={v}" for k, v in rollout.items())]
    cfg = config.load(str(REPO / "jobs" / "toy-agent-cpu.yaml"), overrides)
    tok = load_tokenizer(str(srv.model_dir))
    if template is not None:
        tok.chat_template = template
    client = RolloutClient(srv.run, srv.run.read_token(), timeout_s=60, retries=0)
    front = AgentFront(tok, client, [tok.eos_token_id], RequestLimits(32), len(tok), srv.run.read_token(), "m")
    return AgentRollout(cfg, front, load_agent(cfg.rollout.agent)), tok, client


def _play(srv, agent: str, template: str | None = None):
    """4 episodes of `agent` (rows `i + i` with answer 2i; call k of episode i seeded 1000 i + k): (rows, results,
    tokenizer, client)."""
    from hpc_rl.rollout.wire.openai_api import Defaults

    agents, tok, client = _agents(srv, agent, template)
    rows = [{"id": i, "prompt": f"{i} + {i}", "answer": str(2 * i)} for i in range(4)]
    try:
        return rows, agents.run(rows, 0, lambda ep, k: 1000 * ep + k, Defaults(3, 1.0, 1.0, -1)), tok, client
    finally:
        agents.front.shutdown()


def test_an_agents_calls_are_one_sequence_on_the_engines_tokens(srv):
    """Two appended chat calls per episode, through the real openai SDK and the agent front: each episode is one
    sample whose prompt is the first call's, whose response is both completions (trained) around the tool message's
    tokens (masked); every completion is what /generate samples for the same prompt ids and seed, and the second
    call's prompt holds the first completion's ids as the engine made them (not its text tokenized again)."""
    from hpc_rl.orchestrator.agents import agent_batch

    rows, results, tok, client = _play(srv, "tests.test_agents:two_call_agent")
    for i, r in enumerate(results):
        assert r.error is None and len(r.calls) == 2 and len(r.samples) == 1, r
        first, second = r.calls
        text = tok.apply_chat_template([{"role": "user", "content": rows[i]["prompt"]}], tokenize=False,
                                       add_generation_prompt=True)
        assert first.prompt_ids == tok(text, add_special_tokens=False)["input_ids"]
        assert second.prompt_ids[:len(first.prompt_ids) + len(first.completion_ids)] == \
            first.prompt_ids + first.completion_ids
        obs = second.prompt_ids[len(first.prompt_ids) + len(first.completion_ids):]
        assert tok.decode(obs, skip_special_tokens=True).replace(" ", "") == f"={rows[i]['answer']}"
        s = r.samples[0]
        assert s.prompt == first.prompt_ids
        assert s.response == first.completion_ids + obs + second.completion_ids
        assert s.loss_mask == [1] * len(first.completion_ids) + [0] * len(obs) + [1] * len(second.completion_ids)
        for k, call in enumerate(r.calls):  # the engine's own tokens and log-probs for that prompt and seed
            again = client.generate([call.prompt_ids], SamplingParams(max_new_tokens=3, seeds=[1000 * i + k],
                                                                      stop_token_ids=[tok.eos_token_id]), step=0)
            assert again.outputs[0][0].token_ids == call.completion_ids
            assert again.outputs[0][0].logprobs == pytest.approx(call.logprobs, abs=1e-5)
        assert r.reward == float(len(tok.decode(second.completion_ids, skip_special_tokens=True)))
        assert r.metrics == {"calls": 2.0}
    batch, texts, stats = agent_batch(results, rows, 2, 0, [[1, 2], [3, 4]], tok)
    assert len(batch) == 4 and batch.group_ids == [0, 0, 1, 1] and batch.reward_parts["environment"] == [
        r.reward for r in results]
    assert stats == {"agent/failed_frac": 0.0, "agent/calls_per_episode": 2.0, "agent/samples_per_episode": 1.0,
                     "agent/calls": 2.0}


def test_an_episode_of_two_conversations_is_two_samples_with_its_reward(srv):
    """Calls that do not extend each other are samples of their own, each on its call's engine tokens (the whole
    completion trained); both carry the episode's reward, group and episode id."""
    from hpc_rl.orchestrator.agents import agent_batch

    rows, results, tok, _ = _play(srv, "tests.test_agents:two_conversation_agent")
    for r in results:
        assert r.error is None and len(r.calls) == 2 and len(r.samples) == 2, r
        for call, sample in zip(r.calls, r.samples):
            assert sample.prompt == call.prompt_ids and sample.response == call.completion_ids
            assert sample.loss_mask == [1] * len(call.completion_ids) and sample.logprobs == call.logprobs
    batch, texts, stats = agent_batch(results, rows, 2, 0, [[1, 2], [3, 4]], tok)
    assert len(batch) == 8 and batch.episode_ids == [0, 0, 1, 1, 2, 2, 3, 3]
    assert batch.group_ids == [0, 0, 0, 0, 1, 1, 1, 1] and batch.prompt_ids == batch.episode_ids
    assert batch.reward_parts["environment"] == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    assert batch.responses[1::2] == [r.calls[1].completion_ids for r in results] and len(texts) == 4
    assert stats["agent/samples_per_episode"] == 2.0 and stats["agent/calls_per_episode"] == 2.0


def test_agents_that_raise_hang_or_return_no_number_lose_only_their_episode(srv, caplog):
    """Each failure is one warning line and a lost episode (kept as an untrained slot with its group's mean reward);
    past rollout.agent_max_failed_frac the step is a one-line error naming the key."""
    from hpc_rl.errors import RewardError
    from hpc_rl.orchestrator.agents import agent_batch
    from hpc_rl.rollout.wire.openai_api import Defaults

    rows = [{"id": i, "prompt": f"{i} + {i}"} for i in range(6)]
    agents, tok, _ = _agents(srv, "tests.test_agents:failing_agent", agent_timeout_s=3,
                             agent_max_failed_frac=0.7)
    try:
        results = agents.run(rows, 4, lambda ep, k: ep, Defaults(3))
    finally:
        agents.front.shutdown()
    errors = [r.error for r in results]
    assert errors[0] == "raised KeyError: 'no such tool'"
    assert errors[1] == "ran past rollout.agent_timeout_s (3 s)"
    assert errors[2].startswith("returned the reward nan") and errors[3].startswith("returned the reward 'great'")
    assert errors[4:] == [None, None]
    assert "step 5: agent episode 0 (row 0) lost: raised KeyError" in caplog.text
    batch, texts, stats = agent_batch(results, rows, 3, 4, [[5], [6]], tok)
    # group 0 (rows 0-2) lost all three: reward 0; group 1: row 3 lost -> the mean of rows 4 and 5 (1.0)
    assert batch.reward_parts["environment"] == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert batch.loss_masks[:4] == [[0], [0], [0], [0]] and batch.prompts[:4] == [[5], [5], [5], [6]]
    assert stats["agent/failed_frac"] == pytest.approx(4 / 6) and texts[:4] == ["", "", "", ""]

    agents, _, _ = _agents(srv, "tests.test_agents:failing_agent", agent_timeout_s=3,
                           agent_max_failed_frac=0.5)
    try:
        with pytest.raises(RewardError, match=r"step 2: 4 of 6 agent episodes failed, more than "
                                              r"rollout.agent_max_failed_frac 0.5 \(first: raised KeyError"):
            agents.run(rows, 1, lambda ep, k: ep, Defaults(3))
    finally:
        agents.front.shutdown()


def test_the_agent_front_over_http_with_the_openai_sdk(srv):
    """The front's URL answers the SDK as a server does: the run token as the key (401 otherwise), the models list,
    a recorded chat call, 400 with a one-line message for an episode that is not running."""
    import openai

    from hpc_rl.rollout.wire.openai_api import Defaults

    agents, tok, _ = _agents(srv, "tests.test_agents:two_call_agent")
    front = agents.front
    try:
        front.open("e1", lambda k: 7 + k, Defaults(3), 0)
        sdk = openai.OpenAI(base_url=front.url("e1"), api_key=srv.run.read_token(), max_retries=0)
        assert [m.id for m in sdk.models.list().data] == ["m"]
        out = sdk.chat.completions.create(model="any", messages=[{"role": "user", "content": "1 + 1"}])
        (call,) = front.close("e1")
        assert out.choices[0].message.content == tok.decode(call.completion_ids, skip_special_tokens=True)
        with pytest.raises(openai.BadRequestError, match="episode e1: not running"):
            sdk.chat.completions.create(model="any", messages=[{"role": "user", "content": "1 + 1"}])
        bad = openai.OpenAI(base_url=front.url("e1"), api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="run token"):
            bad.models.list()
    finally:
        front.shutdown()


def test_the_in_process_clients_answer_as_the_front_does_over_http(srv):
    """What AgentRollout hands an agent: each episode's client its own base URL and resources (copies of one
    template), the models list, a streamed chat call recorded for its episode, the raw response, a finished
    episode's client refused with one line, and a wrong API key refused, all without a socket."""
    import asyncio

    import openai

    from hpc_rl.orchestrator.agent_clients import EpisodeClients, in_process_client
    from hpc_rl.rollout.wire.openai_api import Defaults

    agents, tok, _ = _agents(srv, "tests.test_agents:two_call_agent")
    front = agents.front
    messages = [{"role": "user", "content": "1 + 1"}]

    async def play():
        async with in_process_client(front, 30) as http:
            clients = EpisodeClients(http, srv.run.read_token())
            a, b = clients(front.url("a")), clients(front.url("b"))
            assert str(a.base_url) == front.url("a") + "/" and str(b.base_url) == front.url("b") + "/"
            assert a.chat is not b.chat and a.chat._client is a and clients.template.base_url != a.base_url
            assert [m.id for m in (await a.models.list()).data] == ["m"]
            front.open("a", lambda k: 5 + k, Defaults(3), 0)
            stream = await a.chat.completions.create(model="m", messages=messages, stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            raw = await a.completions.with_raw_response.create(model="m", prompt="1 + 1")
            assert raw.headers["content-type"].startswith("application/json") and raw.parse().choices[0].text
            calls = front.close("a")
            with pytest.raises(openai.BadRequestError, match="episode a: not running"):
                await a.chat.completions.create(model="m", messages=messages)
            wrong = openai.AsyncOpenAI(base_url=front.url("a"), api_key="wrong", http_client=http, max_retries=0)
            with pytest.raises(openai.AuthenticationError, match="run token"):
                await wrong.models.list()
            return text, calls

    try:
        text, calls = asyncio.run(play())
    finally:
        front.shutdown()
    assert len(calls) == 2 and text == tok.decode(calls[0].completion_ids, skip_special_tokens=True)


def test_short_gil_turns_restore_the_interval_once_the_last_user_ends():
    """Training's and an evaluation's episodes may overlap: the interval is short while either runs and Python's
    own again after both."""
    import sys

    from hpc_rl.orchestrator.agent_clients import GIL_TURN_S, short_gil_turns

    before = sys.getswitchinterval()
    first, second = short_gil_turns(), short_gil_turns()
    first.__enter__()
    second.__enter__()
    assert sys.getswitchinterval() == min(GIL_TURN_S, before)
    first.__exit__(None, None, None)
    assert sys.getswitchinterval() == min(GIL_TURN_S, before)
    second.__exit__(None, None, None)
    assert sys.getswitchinterval() == before


def test_an_agent_with_tools_stays_one_sequence_and_a_forced_call_is_refused(srv):
    """Chat calls with `tools`: the template renders them into the prompt (the recorded prompt ids hold the tool's
    description), a call that sends the reply back as the SDK returned it continues the same sample, and
    tool_choice "required" is a 400 with one line that the agent reads as openai.BadRequestError."""
    rows, results, tok, _ = _play(srv, "tests.test_agents:tool_agent", TOOL_TEMPLATE)
    for i, r in enumerate(results):
        assert r.error is None and len(r.calls) == 2 and len(r.samples) == 1, r
        first, second = r.calls
        assert tok.decode(first.prompt_ids, skip_special_tokens=True).startswith("1 + 1 = 2 " + rows[i]["prompt"])
        assert second.prompt_ids[:len(first.prompt_ids) + len(first.completion_ids)] == \
            first.prompt_ids + first.completion_ids
        assert r.metrics == {"refused": 1.0}


def test_a_server_whose_template_ignores_tools_refuses_them(srv):
    """The server's own route: a model whose chat template never reads `tools` answers 400 naming the field (the
    model would not see them), not a completion that silently ignores them."""
    import openai

    sdk = openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.run.read_token(), max_retries=0)
    with pytest.raises(openai.BadRequestError, match="tools: the chat template of .* does not render tools"):
        sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "1 + 1"}], tools=TOOLS)
    out = sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "1 + 1"}], max_tokens=2)
    assert out.choices[0].message.tool_calls is None
