"""RolloutBatch: the samples of one RL step, the only thing the orchestrator hands to the learner.

Every per-sample field is a list with one entry per sample, in group order: the samples of a group (one prompt's, or
one agent episode's) share a group id and are contiguous. Token ids are the engine's own (never re-tokenized text);
`loss_masks` marks the response tokens that are trained on (1) and those that are not (0: a multi-turn sample's
environment observations). `reward_parts` holds each reward part unshaped; the learner's step combines and shapes
them in step order into `scores`.

Checkpoints store the batches generated ahead of the trainer (async rollouts) with `to_json`; `from_json` reads every
format written since batches were stored (format 1: the plain dict of earlier versions).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

FORMAT = 2
# The per-sample fields, in the order a batch is built.
PER_SAMPLE = ("prompts", "responses", "loss_masks", "rollout_logprobs", "versions", "truncated", "group_ids",
              "prompt_ids")


@dataclass
class RolloutBatch:
    step: int  # the RL step (0-based) it is trained at
    prompts: list[list[int]]  # prompt token ids
    responses: list[list[int]]  # response token ids: assistant turns (and observations between them, multi-turn)
    loss_masks: list[list[int]]  # per response token: 1 trained, 0 not (an observation)
    rollout_logprobs: list[list[float]]  # the engine's raw log-prob of each response token (0 for observations)
    versions: list[int]  # the policy version that generated the sample (the oldest of its turns)
    truncated: list[bool]  # cut by the token budget rather than ended by the policy
    group_ids: list[int]  # samples of one group share it (advantages compare them); contiguous
    prompt_ids: list[int]  # the dataset row id of the sample's prompt
    reward_parts: dict[str, list[float]] = field(default_factory=dict)  # unshaped parts, e.g. function, environment
    # The reward model's token ids of prompt + response, when the trainer ranks score them (placement: trainer).
    reward_model_ids: list[list[int]] | None = None
    scores: list[float] | None = None  # the parts combined and shaped (set by the learner's step, not stored ahead)
    stats: dict = field(default_factory=dict)  # the step's generation and scoring statistics (metrics.jsonl)

    def __post_init__(self):
        n = len(self.prompts)
        for name in PER_SAMPLE:
            if len(getattr(self, name)) != n:
                raise ValueError(f"RolloutBatch.{name} has {len(getattr(self, name))} entries for {n} samples")
        for name, vals in self.reward_parts.items():
            if len(vals) != n:
                raise ValueError(f"RolloutBatch.reward_parts[{name!r}] has {len(vals)} entries for {n} samples")

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def group_size(self) -> int:
        """Samples per group, when every group has as many (the GRPO-style case); 0 for ragged groups."""
        sizes = {}
        for g in self.group_ids:
            sizes[g] = sizes.get(g, 0) + 1
        return next(iter(sizes.values())) if len(set(sizes.values())) == 1 else 0

    def select(self, rows: list[int]) -> RolloutBatch:
        """The samples `rows`, in that order (stats and step kept)."""

        def pick(vals):
            return [vals[i] for i in rows]

        return dataclasses.replace(
            self, **{name: pick(getattr(self, name)) for name in PER_SAMPLE},
            reward_parts={k: pick(v) for k, v in self.reward_parts.items()},
            reward_model_ids=None if self.reward_model_ids is None else pick(self.reward_model_ids),
            scores=None if self.scores is None else pick(self.scores), stats=dict(self.stats))

    @staticmethod
    def concat(batches: list[RolloutBatch], stats: dict | None = None) -> RolloutBatch:
        """The samples of `batches` one after the other, their groups numbered 0, 1, ... in order of appearance (so
        that groups of different batches stay apart); the first batch's step and, unless given, its stats."""
        first = batches[0]
        out = {name: [] for name in PER_SAMPLE}
        parts = {k: [] for k in first.reward_parts}
        rm_ids = [] if first.reward_model_ids is not None else None
        for b in batches:
            if set(b.reward_parts) != set(parts) or (b.reward_model_ids is None) != (rm_ids is None):
                raise ValueError("RolloutBatch.concat: the batches hold different reward parts")
            renumber: dict[int, int] = {}
            for name in PER_SAMPLE:
                vals = getattr(b, name)
                if name == "group_ids":
                    base = len(set(out["group_ids"]))
                    vals = [renumber.setdefault(g, base + len(renumber)) for g in vals]
                out[name] += vals
            for k in parts:
                parts[k] += b.reward_parts[k]
            if rm_ids is not None:
                rm_ids += b.reward_model_ids
        return RolloutBatch(step=first.step, **out, reward_parts=parts, reward_model_ids=rm_ids,
                            stats=dict(first.stats if stats is None else stats))

    def shard(self, rank: int, world: int) -> RolloutBatch:
        """This rank's contiguous 1/world of the samples (the sample count is a multiple of world)."""
        per = len(self) // world
        return self.select(list(range(rank * per, (rank + 1) * per)))

    # ------------------------------------------------------------------ checkpoints

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["format"] = FORMAT
        return d

    @staticmethod
    def from_json(d: dict) -> RolloutBatch:
        """A stored batch of any format: 2 (this one) or 1 (the dict of earlier versions: `response_masks` only for
        multi-turn samples, no group or prompt ids, and either reward parts or already shaped `scores`)."""
        fmt = d.get("format", 1)
        if fmt == FORMAT:
            fields = {f.name for f in dataclasses.fields(RolloutBatch)}
            return RolloutBatch(**{k: v for k, v in d.items() if k in fields})
        if fmt != 1:
            raise ValueError(f"a stored rollout batch of format {fmt}; this version reads formats 1 and {FORMAT}")
        n = len(d["prompts"])
        masks = d.get("response_masks") or [[1] * len(r) for r in d["responses"]]
        # Format 1 held prompts_per_step groups of equal size in order; its stats name the prompts' row ids.
        rows = d.get("stats", {}).get("prompt_ids") or list(range(n))
        g = n // len(rows) if rows and n % len(rows) == 0 else 1
        return RolloutBatch(
            step=int(d["step"]), prompts=d["prompts"], responses=d["responses"], loss_masks=masks,
            rollout_logprobs=d["rollout_logprobs"], versions=[int(v) for v in d["versions"]],
            truncated=d.get("truncated") or [False] * n, group_ids=[i // g for i in range(n)],
            prompt_ids=[int(rows[i // g]) if g > 1 or len(rows) == n else i for i in range(n)],
            reward_parts=d.get("reward_parts") or {}, reward_model_ids=d.get("reward_model_ids"),
            scores=d.get("scores") if "reward_parts" not in d else None, stats=d.get("stats", {}))
