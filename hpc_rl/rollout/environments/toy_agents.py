"""The toy lookup task (hpc_rl.data.toy lookup, as LookupEnv plays it) written as an OpenAI-SDK agent: what a user's
agent looks like, and the agent toy of jobs/toy-agent-cpu.yaml.

The prompt `find K` names a key whose digit only the lookup tool knows. The agent asks the model; a reply that says
`look` gets the digit back as a tool message and the model is asked again, in the same conversation (so the episode
is one sequence: the model's tokens trained, the tool's answer masked). The reward is the fraction of the answer's
first 4 non-space characters equal to the digit; an answer without the lookup scores 0.
"""

from __future__ import annotations

from ...rewards.toy import repeat_digit

CALL = "look"


async def lookup_agent(client, task: dict, model: str = "policy") -> dict:
    """`await lookup_agent(openai.AsyncOpenAI(...), {"prompt": "find a", "ground_truth": "7", ...})`."""
    messages = [{"role": "user", "content": task["prompt"]}]
    first = await client.chat.completions.create(model=model, messages=messages)
    reply = first.choices[0].message.content
    if CALL not in reply:
        return {"reward": 0.0, "metrics": {"looked": 0.0}}
    messages += [{"role": "assistant", "content": reply}, {"role": "tool", "content": str(task["ground_truth"])}]
    second = await client.chat.completions.create(model=model, messages=messages)
    answer = second.choices[0].message.content
    return {"reward": repeat_digit("", answer, str(task["ground_truth"])), "metrics": {"looked": 1.0}}


async def fresh_context_agent(client, task: dict, model: str = "policy") -> dict:
    """The lookup task played as agents that summarize or hand work to a sub-agent play it: the second call starts
    from fresh messages (the prompt and the looked-up digit, without the first reply), so an episode is two
    conversations, trained as two samples that share its reward."""
    first = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": task["prompt"]}])
    if CALL not in first.choices[0].message.content:
        return {"reward": 0.0, "metrics": {"looked": 0.0}}
    messages = [{"role": "user", "content": task["prompt"]}, {"role": "tool", "content": str(task["ground_truth"])}]
    second = await client.chat.completions.create(model=model, messages=messages)
    answer = second.choices[0].message.content
    return {"reward": repeat_digit("", answer, str(task["ground_truth"])), "metrics": {"looked": 1.0}}


async def copy_agent(client, task: dict, model: str = "policy") -> float:
    """The copy toy (hpc_rl.data.toy repeat_digit) as a one-call agent: the prompt text to /v1/completions, the
    reward of the completion. The same samples as the native path's (bench/agent_overhead.py compares them)."""
    out = await client.completions.create(model=model, prompt=task["prompt"])
    return repeat_digit("", out.choices[0].text, str(task["ground_truth"]))
