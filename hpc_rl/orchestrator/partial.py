"""Partial rollouts (rollout.partial): a step's batch is full once `prompts_per_step` groups are complete; the
responses still running then are carried over to the next step, not thrown away, and continue from their prompt
and tokens so far with the weights the servers hold then (Kimi k1.5's partial rollouts, verl's and AReaL's). The
longest responses no longer hold a step back: the step ends when enough groups are done.

The pool holds `prompts_per_step + partial_extra_prompts` groups: those carried over, oldest first, then new
prompts taken in the sampler's order (prompt j of step s, with the seeds a run without partial rollouts gives it).
Each segment generates at most rollout.partial_tokens more tokens of every unfinished sample; segments run until
`prompts_per_step` groups are complete, and the batch is the first complete groups in pool order, so a carried group
is trained before newer ones. Everything here follows from token counts and seeds, never from timing: with no extra
prompts and rollout.partial_tokens >= rollout.max_new_tokens a run makes exactly the samples it makes without partial
rollouts, and a checkpoint keeps the pool as it was after the last batch it holds, so a resumed run continues the
same responses with the same seeds. rollout.max_token_staleness drops a group whose oldest token would be more than
that many versions older than the step that trains it (counted in `stale_dropped_groups`).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from dataclasses import dataclass, field

from ..data.sampler import indices_for_step
from ..errors import RolloutError
from ..rollout.wire.sampling import SamplingParams
from . import seeds
from .batch import RolloutBatch


@dataclass
class Response:
    """One sample of a group, as far as it got."""

    seed: int | None  # its first segment's seed (the one a run without partial rollouts gives the sample)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the policy version of each token
    finish: str | None = None  # "stop" or "length" once it ended; None while it runs
    segments: int = 0


@dataclass
class Group:
    """One prompt's samples, from the step whose prompts brought it."""

    step: int
    position: int  # the prompt's place among that step's prompts (its seeds)
    index: int  # the dataset index of the prompt
    samples: list[Response]

    @property
    def done(self) -> bool:
        return all(s.finish is not None for s in self.samples)

    def oldest(self) -> int | None:
        """The oldest version of any of its tokens (None before its first token)."""
        return min((s.versions[0] for s in self.samples if s.versions), default=None)

    @staticmethod
    def from_json(d: dict) -> Group:
        return Group(step=int(d["step"]), position=int(d["position"]), index=int(d["index"]),
                     samples=[Response(**s) for s in d["samples"]])


class PartialRollouts:
    """The pool of groups of a run with partial rollouts, and the batches made from it (BatchMaker's, one step at a
    time in step order)."""

    def __init__(self, cfg, dataset, client, stop_ids: list[int]):
        self.cfg, self.dataset, self.client, self.stop_ids = cfg, dataset, client, list(stop_ids)
        r = cfg.rollout
        self.segment = r.segment_tokens
        self.max_new = r.max_new_tokens
        self.max_staleness = r.max_token_staleness
        self.per_step = cfg.trainer.prompts_per_step
        self.size = self.per_step + r.extra_prompts(self.per_step)
        self.pool: list[Group] = []
        self.cursor = 0  # prompts taken from the sampler's order so far
        self._after: dict[int, dict] = {}  # step -> the state after its batch (what checkpoints keep)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ checkpoints

    def state_after(self, step: int) -> dict:
        """The pool and the prompt cursor as they were after the batch of `step` was made (-1: before the first);
        JSON."""
        with self._lock:
            if step < 0:
                return {"pool": [], "cursor": 0}
            if step not in self._after:
                raise RolloutError(f"partial rollouts: the pool after step {step + 1} is no longer kept")
            return copy.deepcopy(self._after[step])

    def load(self, state: dict | None, step: int) -> None:
        """Resume with the pool a checkpoint kept, as it was after the batch of `step`."""
        state = state or {"pool": [], "cursor": 0}
        self.pool = [Group.from_json(g) for g in state["pool"]]
        self.cursor = int(state["cursor"])
        with self._lock:
            self._after = {step: copy.deepcopy(state)}

    def rewind(self, step: int) -> None:
        """Go back to the pool after the batch of `step` (a new pipeline drops the batches generated after it)."""
        self.load(self.state_after(step), step)

    # ------------------------------------------------------------------ one step

    def _take_prompts(self, pool: list[Group], cursor: int, group_size: int) -> int:
        """Top the pool up to its size with the next prompts of the sampler's order; the new cursor."""
        cache: dict[int, tuple[list[int], list[int]]] = {}
        while len(pool) < self.size:
            s, j = divmod(cursor, self.per_step)
            if s not in cache:
                cache[s] = (indices_for_step(len(self.dataset), self.per_step, self.cfg.seed, s,
                                             self.cfg.data.shuffle),
                            seeds.training(self.cfg.seed, s).prompts(self.per_step))
            idx, first = cache[s]
            pool.append(Group(s, j, idx[j], [Response(first[j] + k) for k in range(group_size)]))
            cursor += 1
        return cursor

    def make(self, step: int, group_size: int) -> tuple[RolloutBatch, dict, list[int]]:
        """The batch of `step` (samples, engine log-probs, versions; no reward yet), its statistics, and the dataset
        index of each of its groups. The pool changes only when the batch is made (a failed step leaves it as it was)."""
        t0 = time.time()
        pool = copy.deepcopy(self.pool)
        cursor = self._take_prompts(pool, self.cursor, group_size)
        want = self.per_step
        dropped = segments = 0
        while True:
            if self.max_staleness is not None:  # a group's tokens only get older: drop it as soon as it is past
                keep = [g for g in pool if g.oldest() is None or step - g.oldest() <= self.max_staleness]
                dropped += len(pool) - len(keep)
                pool = keep
                cursor = self._take_prompts(pool, cursor, group_size)  # dropped groups make room for new prompts
            if sum(g.done for g in pool) >= want or all(g.done for g in pool):
                break
            self._segment(pool, step)
            segments += 1
        take = [g for g in pool if g.done][:want]
        if not take:
            raise RolloutError(f"step {step + 1}: partial rollouts: every group was older than "
                               f"rollout.max_token_staleness {self.max_staleness} allows; raise it")
        taken = {id(g) for g in take}
        rest = [g for g in pool if id(g) not in taken]
        batch = self._batch(step, take)
        stats = {"partial_segments": segments, "partial_carried_groups": len(rest),
                 "partial_continued_frac": sum(s.segments > 1 for g in take for s in g.samples) / len(batch),
                 "stale_dropped_groups": dropped, "gen_seconds": time.time() - t0}  # gen_seconds: the caller's
        self.pool, self.cursor = rest, cursor
        with self._lock:
            self._after[step] = {"pool": [dataclasses.asdict(g) for g in rest], "cursor": cursor}
            for old in [s for s in self._after if s < step - self.cfg.rollout.async_steps - 2]:
                del self._after[old]
        return batch, stats, [g.index for g in take]

    def _segment(self, pool: list[Group], step: int) -> None:
        """Up to `segment` more tokens of every unfinished sample; one request per remaining budget."""
        rows = [(g, k, s) for g in pool for k, s in enumerate(g.samples) if s.finish is None]
        by_budget: dict[int, list] = {}
        for g, k, s in rows:
            by_budget.setdefault(min(self.segment, self.max_new - len(s.tokens)), []).append((g, k, s))
        r = self.cfg.rollout
        images = self.dataset.images
        for budget, part in sorted(by_budget.items()):
            row_seeds = [s.seed if s.segments == 0 else seeds.partial_segment(self.cfg.seed, g.step, g.position, k,
                                                                             s.segments)
                         for g, k, s in part]
            params = SamplingParams(n=1, max_new_tokens=budget, temperature=r.temperature, top_p=r.top_p,
                                    top_k=r.top_k, stop_token_ids=self.stop_ids,
                                    seeds=row_seeds)
            res = self.client.generate([self.dataset.token_ids[g.index] + s.tokens for g, _, s in part], params,
                                       step=step, images=[images[g.index] for g, _, _ in part] if any(images) else None)
            for (_, _, s), outs, version in zip(part, res.outputs, res.policy_versions):
                out = outs[0]
                s.tokens += out.token_ids
                s.logprobs += out.logprobs
                s.versions += out.token_versions(version)
                s.segments += 1
                if out.finish_reason == "stop":
                    s.finish = "stop"
                elif len(s.tokens) >= self.max_new:
                    s.finish = "length"

    def _batch(self, step: int, groups: list[Group]) -> RolloutBatch:
        ds = self.dataset
        samples = [(j, g, s) for j, g in enumerate(groups) for s in g.samples]
        images = None if not any(ds.images) else [ds.images[g.index] for _, g, _ in samples]
        mixed = any(len(set(s.versions)) > 1 for _, _, s in samples)
        return RolloutBatch(
            step=step, prompts=[ds.token_ids[g.index] for _, g, _ in samples],
            responses=[list(s.tokens) for _, _, s in samples], loss_masks=[[1] * len(s.tokens) for _, _, s in samples],
            rollout_logprobs=[list(s.logprobs) for _, _, s in samples], versions=[s.versions[0] for _, _, s in samples],
            truncated=[s.finish == "length" for _, _, s in samples], group_ids=[j for j, _, _ in samples],
            prompt_ids=[int(ds.rows[g.index]["id"]) for _, g, _ in samples], images=images,
            token_versions=[list(s.versions) for _, _, s in samples] if mixed else None)
