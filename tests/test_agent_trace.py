"""An agent episode's calls become samples (appended calls one sequence: the engine's tokens trained, the rest
masked; others samples of their own), hand-built calls with hand-computed samples; an agent's return value."""

import pytest

from hpc_rl.orchestrator.agent_trace import Call, samples_of


def test_a_chat_that_appends_is_one_sample_with_the_feedback_masked():
    calls = [Call([1, 2], [3, 4], [-0.1, -0.2], 5, "stop"),
             Call([1, 2, 3, 4, 9, 9], [6], [-0.3], 6, "length")]
    (s,) = samples_of(calls)
    assert s.prompt == [1, 2] and s.response == [3, 4, 9, 9, 6]
    assert s.loss_mask == [1, 1, 0, 0, 1] and s.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert s.versions == [5, 6] and s.version == 5 and s.truncated and s.calls == 2


def test_calls_that_do_not_extend_start_samples_and_a_resumed_chat_continues_its_own():
    calls = [Call([1, 2], [3], [-1.0], 0, "stop"),
             Call([7, 8], [9], [-2.0], 0, "stop"),          # a sub-task: its own sample
             Call([1, 2, 3, 5], [4], [-3.0], 1, "stop"),    # the first chat goes on
             Call([1, 2, 4], [4], [-4.0], 1, "stop")]       # a rewritten history: a new sample
    a, b, c = samples_of(calls)
    assert (a.prompt, a.response, a.loss_mask, a.calls) == ([1, 2], [3, 5, 4], [1, 0, 1], 2)
    assert (b.prompt, b.response, b.calls, b.truncated) == ([7, 8], [9], 1, False)
    assert (c.prompt, c.response, c.logprobs) == ([1, 2, 4], [4], [-4.0])
    assert samples_of([]) == []


def test_a_call_must_have_a_log_prob_per_token():
    with pytest.raises(ValueError, match="1 log-probs for 2 completion tokens"):
        Call([1], [2, 3], [-1.0], 0, "stop")


def test_an_agents_return_value_is_a_reward_or_a_reward_with_metrics():
    from hpc_rl.orchestrator.agents import parse_outcome

    assert parse_outcome(1) == (1.0, {}) and parse_outcome(0.25) == (0.25, {})
    assert parse_outcome({"reward": 0.5, "metrics": {"turns": 3}}) == (0.5, {"turns": 3.0})
    for bad, why in ((True, "returned the reward True"), (float("inf"), "returned the reward inf"),
                     ({"score": 1}, "returned a dict without 'reward'"),
                     ({"reward": 1, "metrics": {"turns": "3"}}, "returned metrics that are not {name: number}"),
                     (None, "returned the reward None")):
        with pytest.raises(ValueError, match=why):
            parse_outcome(bad)
