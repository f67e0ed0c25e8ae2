"""Partial rollouts' pool (orchestrator/partial.py) against a generator whose answers follow from the seeds alone:
which groups a step trains, what is carried over, the prompt order, the staleness bound, and the state a checkpoint
keeps (a pool loaded from it makes the same batches)."""

import dataclasses
import random
from types import SimpleNamespace

import pytest

from hpc_rl.config import load_dict
from hpc_rl.data.sampler import indices_for_step
from hpc_rl.errors import ConfigError
from hpc_rl.orchestrator import seeds
from hpc_rl.orchestrator.partial import PartialRollouts
from hpc_rl.rollout.client.rollout_client import GenerateResult
from hpc_rl.rollout.wire.sampling import SampleOut

STOP = 99
P, N = 4, 2  # prompts per step, samples per group


class SeededServers:
    """Row r of a request generates tokens from random.Random(seed): each token is STOP with probability 1/3
    (then the sample ends), up to max_new_tokens; every token is tagged with the version the servers hold."""

    def __init__(self):
        self.version = 0
        self.requests: list[tuple[int, list[int]]] = []  # (max_new_tokens, prompt lengths)

    def generate(self, prompts, params, step, images=None):
        self.requests.append((params.max_new_tokens, [len(p) for p in prompts]))
        outs = []
        for seed in params.seeds:
            rng = random.Random(seed)
            toks = []
            while len(toks) < params.max_new_tokens:
                toks.append(STOP if rng.random() < 1 / 3 else rng.randrange(10, 20))
                if toks[-1] == STOP:
                    break
            outs.append([SampleOut(toks, [-1.0] * len(toks), "stop" if toks[-1] == STOP else "length")])
        return GenerateResult(outs, [self.version] * len(prompts), 0.0, 0.0)


class Rows:
    """A dataset of 50 prompts: prompt i is [i, i]."""

    def __init__(self):
        self.rows = [{"id": 1000 + i} for i in range(50)]
        self.token_ids = [[i, i] for i in range(50)]
        self.images = [[] for _ in range(50)]

    def __len__(self):
        return len(self.rows)


def _cfg(**rollout):
    r = {"partial": True, "max_new_tokens": 8, "partial_tokens": 2, **rollout}
    return load_dict({"model": {"path": "/models/x"}, "seed": 5, "trainer": {"prompts_per_step": P, "mini_batch_size": P * N},
                      "algorithm": {"name": "grpo", "group_size": N}, "rollout": r})


def _pool(cfg, servers=None):
    return PartialRollouts(cfg, Rows(), servers or SeededServers(), [STOP])


def test_without_extra_prompts_and_a_whole_segment_each_step_trains_its_own_prompts_in_one_request():
    cfg = _cfg(partial_tokens=8, partial_extra_prompts=0)
    servers = SeededServers()
    pool = _pool(cfg, servers)
    for step in range(3):
        batch, stats, groups = pool.make(step, N)
        assert groups == indices_for_step(50, P, 5, step, cfg.data.shuffle)
        assert stats["partial_segments"] == 1 and stats["partial_carried_groups"] == 0
        assert pool.pool == []
        # Sample k of prompt j has the seed a run without partial rollouts gives it.
        first = seeds.training(5, step).prompts(P)
        want = [first[j] + k for j in range(P) for k in range(N)]
        one_go = SeededServers().generate([[0]] * len(want), SimpleNamespace(seeds=want, max_new_tokens=8), step)
        assert batch.responses == [o[0].token_ids for o in one_go.outputs]
    assert [m for m, _ in servers.requests] == [8, 8, 8]


def test_the_batch_is_full_when_enough_groups_are_done_and_the_rest_is_carried_over():
    cfg = _cfg()  # 2 extra prompts, 2 tokens a segment, at most 8
    servers = SeededServers()
    pool = _pool(cfg, servers)
    seen_prompt_order = []
    carried_running = 0
    for step in range(8):
        servers.version = step
        before = [(g.step, g.position) for g in pool.pool]
        batch, stats, groups = pool.make(step, N)
        assert len(groups) == P and len(batch) == P * N
        # Carried groups come first: every complete carried group is trained before a newer one.
        keys = [(g.step, g.position) for g in pool.pool]
        assert len(pool.pool) == stats["partial_carried_groups"] == 2
        assert all(k not in before or k in keys for k in keys)
        carried_running += sum(not g.done for g in pool.pool)
        seen_prompt_order += [(s, p) for s, p in keys if (s, p) not in before]
        for vs, r, lp in zip(batch.per_token_versions(), batch.responses, batch.rollout_logprobs):
            assert len(vs) == len(r) == len(lp) and vs == sorted(vs)  # a continued sample: newer versions later
        assert all(t[-1] == STOP or len(t) == 8 for t in batch.responses)
    assert carried_running > 0  # some responses were still running when their step's batch was full
    assert pool.cursor == 8 * P + 2


def test_a_continued_sample_spans_versions_and_its_segments_have_seeds_of_their_own():
    cfg = _cfg()
    servers = SeededServers()
    pool = _pool(cfg, servers)
    spanning = 0
    for step in range(8):
        servers.version = step
        batch, _, _ = pool.make(step, N)
        spanning += sum(len(set(v)) > 1 for v in batch.per_token_versions())
        assert (batch.token_versions is None) == all(len(set(v)) == 1 for v in batch.per_token_versions())
    assert spanning > 0
    assert seeds.partial_segment(5, 1, 2, 0, 1) != seeds.partial_segment(5, 1, 2, 0, 2) != seeds.training(5, 1).prompts(3)[2]


def test_the_state_after_a_step_makes_the_same_next_batches():
    cfg = _cfg()
    a = _pool(cfg)
    for step in range(3):
        a.make(step, N)
    state = a.state_after(2)
    b = _pool(cfg)
    b.load(state, 2)
    for step in range(3, 6):
        ba, _, ga = a.make(step, N)
        bb, _, gb = b.make(step, N)
        assert (ba.responses, ga, ba.versions) == (bb.responses, gb, bb.versions)


def test_rewind_returns_to_the_pool_after_a_step():
    cfg = _cfg()
    pool = _pool(cfg)
    for step in range(3):
        pool.make(step, N)
    after1 = pool.state_after(1)
    pool.rewind(1)
    assert pool.state_after(1) == after1 and pool.cursor == after1["cursor"]
    next_again = pool.make(2, N)[0].responses
    fresh = _pool(cfg)
    for step in range(3):
        last = fresh.make(step, N)[0].responses
    assert next_again == last


def test_a_failed_step_leaves_the_pool_as_it_was():
    cfg = _cfg()

    class Failing(SeededServers):
        def generate(self, *a, **k):
            if len(self.requests) == 3:
                raise RuntimeError("server gone")
            return super().generate(*a, **k)

    pool = _pool(cfg, Failing())
    pool.make(0, N)
    before = pool.state_after(0)
    with pytest.raises(RuntimeError):
        pool.make(1, N)
    assert [dataclasses.asdict(g) for g in pool.pool] == before["pool"] and pool.cursor == before["cursor"]


def test_max_token_staleness_drops_groups_past_it_and_counts_them():
    cfg = _cfg(async_steps=0, max_token_staleness=0)  # nothing older than the step that trains it
    servers = SeededServers()
    pool = _pool(cfg, servers)
    dropped = 0
    for step in range(6):
        servers.version = step  # the synchronous schedule: the servers hold version `step` at step `step`
        carried = len(pool.pool)
        batch, stats, _ = pool.make(step, N)
        assert stats["stale_dropped_groups"] == carried  # every carried group has tokens of an older version
        dropped += stats["stale_dropped_groups"]
        assert set(batch.versions) == {step} and len(batch) == P * N  # new prompts took the dropped ones' room
    assert dropped > 0


@pytest.mark.parametrize("rollout, match", [
    ({"partial_tokens": 4}, r"rollout.partial_tokens: set, but rollout.partial is false"),
    ({"max_token_staleness": 2}, r"rollout.max_token_staleness: set, but rollout.partial is false"),
    ({"partial": True, "partial_tokens": 0}, r"rollout.partial_tokens must be in \[1"),
    ({"partial": True, "partial_extra_prompts": -1}, r"rollout.partial_extra_prompts must be >= 0"),
    ({"partial": True, "async_steps": 2, "max_token_staleness": 1}, r"rollout.max_token_staleness \(1\) must be >= "),
    ({"partial": True, "env": "hpc_rl.rollout.environments.tool_env:ToolCallEnv"}, r"rollout.partial: carries single"),
])
def test_config_errors_name_the_key(rollout, match):
    with pytest.raises(ConfigError, match=match):
        load_dict({"model": {"path": "/models/x"}, "rollout": rollout})


def test_defaults_resolve_from_the_job():
    r = _cfg(partial_tokens=None).rollout
    assert r.segment_tokens == 2 and r.extra_prompts(P) == 2  # a quarter of 8 tokens; half of 4 prompts
