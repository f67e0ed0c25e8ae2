"""RolloutBatch, the one thing the orchestrator hands to the learner: its invariants, select/concat, episodes, and
its serialization for checkpoints (format 2, and format 1: the plain dict earlier versions stored)."""

import json

import pytest

from hpc_rl.orchestrator.batch import RolloutBatch


def batch(step=3, groups=2, g=2, offset=0, parts=("function",)) -> RolloutBatch:
    n = groups * g
    return RolloutBatch(
        step=step, prompts=[[1, 2 + offset + i // g] for i in range(n)], responses=[[5, 6 + i] for i in range(n)],
        loss_masks=[[1, 1]] * n, rollout_logprobs=[[-0.5, -1.0]] * n, versions=[step] * n, truncated=[False] * n,
        group_ids=[i // g for i in range(n)], prompt_ids=[100 + offset + i // g for i in range(n)],
        reward_parts={p: [float(i + offset) for i in range(n)] for p in parts}, stats={"gen_seconds": 1.0})


def test_every_per_sample_field_has_one_entry_per_sample():
    b = batch()
    assert len(b) == 4 and b.group_size == 2
    with pytest.raises(ValueError, match="versions has 3 entries for 4 samples"):
        RolloutBatch(**{**b.__dict__, "versions": [0, 0, 0]})
    with pytest.raises(ValueError, match=r"reward_parts\['function'\] has 1 entries"):
        RolloutBatch(**{**b.__dict__, "reward_parts": {"function": [1.0]}})


def test_select_and_concat_keep_samples_and_groups_together():
    a, b = batch(), batch(offset=10)
    both = RolloutBatch.concat([a.select([2, 3]), b.select([0, 1, 2, 3])])
    assert both.step == 3 and len(both) == 6 and both.stats == a.stats
    assert both.group_ids == [0, 0, 1, 1, 2, 2]  # renumbered: the pieces' groups stay apart
    assert both.prompt_ids == [101, 101, 110, 110, 111, 111]
    assert both.reward_parts["function"] == [2.0, 3.0, 10.0, 11.0, 12.0, 13.0]
    with pytest.raises(ValueError, match="different reward parts"):
        RolloutBatch.concat([a, batch(parts=("function", "overlong"))])


def test_serialization_round_trips_through_json():
    b = batch()
    b.reward_model_ids = [[9, 9]] * 4
    back = RolloutBatch.from_json(json.loads(json.dumps(b.to_json())))
    assert back == b and json.loads(json.dumps(b.to_json()))["format"] == 2


def test_a_format_1_batch_of_an_earlier_version_reads():
    """What pending_batches.json held before the typed batch (tests/fixtures/checkpoint-format1 has a whole run)."""
    old = {"step": 7, "prompts": [[1], [1], [2], [2]], "responses": [[3], [4, 5], [6], [7]],
           "rollout_logprobs": [[-1.0], [-1.0, -2.0], [-1.0], [-3.0]], "versions": [6, 6, 6, 6],
           "truncated": [False, True, False, False], "reward_parts": {"function": [1.0, 0.0, 0.5, 0.5]},
           "stats": {"prompt_ids": [40, 41]}}
    b = RolloutBatch.from_json(old)
    assert b.loss_masks == [[1], [1, 1], [1], [1]] and b.group_ids == [0, 0, 1, 1] and b.prompt_ids == [40, 40, 41, 41]
    assert b.scores is None and b.reward_parts == {"function": [1.0, 0.0, 0.5, 0.5]}
    multi = RolloutBatch.from_json({**old, "response_masks": [[1], [1, 0], [1], [0]]})
    assert multi.loss_masks == [[1], [1, 0], [1], [0]]
    shaped = {k: v for k, v in old.items() if k != "reward_parts"} | {"scores": [0.1, 0.2, 0.3, 0.4]}
    assert RolloutBatch.from_json(shaped).scores == [0.1, 0.2, 0.3, 0.4]  # shaped when it was made
    with pytest.raises(ValueError, match="format 9"):
        RolloutBatch.from_json({**old, "format": 9})


def agent_batch_of(episodes=(2, 1, 1, 3), g=2) -> RolloutBatch:
    """Episodes of several samples (an agent's conversations), `g` episodes per group."""
    ids = [e for e, k in enumerate(episodes) for _ in range(k)]
    n = len(ids)
    return RolloutBatch(
        step=0, prompts=[[1, e] for e in ids], responses=[[5, i] for i in range(n)], loss_masks=[[1, 1]] * n,
        rollout_logprobs=[[-0.5, -1.0]] * n, versions=[0] * n, truncated=[False] * n,
        group_ids=[e // g for e in ids], prompt_ids=[e // g for e in ids],
        reward_parts={"environment": [float(e) for e in ids]}, episode_ids=[10 + e for e in ids])


def test_an_agents_episodes_of_several_samples_are_scored_once_and_padded_with_rows_that_train_nothing():
    b = agent_batch_of()
    assert b.episode_index() == [0, 0, 1, 2, 3, 3, 3]
    assert b.episode_ends() == [1, 2, 3, 6]  # each episode's last conversation
    view = b.episodes()
    assert view.responses == [[5, 1], [5, 2], [5, 3], [5, 6]] and view.reward_parts["environment"] == [0, 1, 2, 3]
    assert b.per_sample([0.5, 1.5, 2.5, 3.5]) == [0.5, 0.5, 1.5, 2.5, 3.5, 3.5, 3.5]
    assert batch().episodes() is not None and batch().episode_index() == [0, 1, 2, 3]  # one sample, one episode
    padded = b.with_fillers(3, token=0)
    assert len(padded) == 10 and padded.episode_index()[7:] == [-1, -1, -1]
    assert padded.loss_masks[7:] == [[0]] * 3 and padded.reward_parts["environment"][7:] == [0.0] * 3
    assert b.with_fillers(0, token=0) is b
    assert batch().with_fillers(1, token=0).episode_index() == [0, 1, 2, 3, -1]
    both = RolloutBatch.concat([b, agent_batch_of((1, 1, 2, 1))])
    assert both.episode_index() == [0, 0, 1, 2, 3, 3, 3, 4, 5, 6, 6, 7]  # the second batch's episodes stay apart
    back = RolloutBatch.from_json(json.loads(json.dumps(b.to_json())))
    assert back == b
    with pytest.raises(ValueError, match="episode_ids has 2 entries for 7 samples"):
        RolloutBatch(**{**b.__dict__, "episode_ids": [0, 1]})
