"""RolloutBatch: the samples of one RL step, the only thing the orchestrator hands to the learner.

Every per-sample field is a list with one entry per sample, in group order: the samples of a group (one prompt's)
share a group id and are contiguous. An episode is what earns one reward: one sample, except for an agent whose calls
do not all extend one conversation, whose episode has a sample per conversation (`episode_ids`; contiguous too). The
estimators compare episodes, and every sample of an episode gets its episode's advantage. Token ids are the engine's
own (never re-tokenized text); `loss_masks` marks the response tokens that are trained on (1) and those that are not
(0: a multi-turn sample's environment observations). `reward_parts` holds each reward part unshaped; the learner's step combines and shapes
them in step order into `scores`.

Checkpoints store the batches generated ahead of the trainer (async rollouts) with `to_json`; `from_json` reads every
format written since batches were stored (format 1: the plain dict of earlier versions).
"""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass, field

FORMAT = 2
FILLER = -1  # the episode id of a row that trains nothing (RolloutBatch.with_fillers)
# The per-sample fields, in the order a batch is built.
PER_SAMPLE = ("prompts", "responses", "loss_masks", "rollout_logprobs", "versions", "truncated", "group_ids",
              "prompt_ids")
# The per-sample fields a teacher fills (on-policy distillation), None without one.
TEACHER = ("teacher_logprobs", "teacher_top_ids", "teacher_top_logprobs")
# The per-sample fields that may be None for the whole batch.
OPTIONAL = ("episode_ids", *TEACHER, "images", "token_versions")


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
    # The episode of each sample (agent runs); None: each sample is an episode of its own. FILLER marks a row that
    # trains nothing and belongs to no episode (the learner's padding).
    episode_ids: list[int] | None = None
    # The teacher's log-prob of each response token (on-policy distillation, services.teacher); None: no teacher.
    teacher_logprobs: list[list[float]] | None = None
    # The teacher's k likeliest tokens at each response position and their log-probs (algorithm.distill.top_k);
    # None: not asked for.
    teacher_top_ids: list[list[list[int]]] | None = None
    teacher_top_logprobs: list[list[list[float]]] | None = None
    # Each sample's prompt images, encoded (a vision-language policy; the prompt's ids hold their tokens); None: no
    # sample has one. The samples of a group share the list.
    images: list[list[bytes]] | None = None
    # The policy version that sampled each response token (observations: the version of the turn before them);
    # None: every token of a sample comes from its `versions` entry. Differs from it only with in-flight updates
    # (rollout.inflight_updates), where weights change while a sample is generated.
    token_versions: list[list[int]] | None = None

    def __post_init__(self):
        n = len(self.prompts)
        for name in PER_SAMPLE:
            if len(getattr(self, name)) != n:
                raise ValueError(f"RolloutBatch.{name} has {len(getattr(self, name))} entries for {n} samples")
        for name in OPTIONAL:
            vals = getattr(self, name)
            if vals is not None and len(vals) != n:
                raise ValueError(f"RolloutBatch.{name} has {len(vals)} entries for {n} samples")
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
            scores=None if self.scores is None else pick(self.scores), stats=dict(self.stats),
            episode_ids=None if self.episode_ids is None else pick(self.episode_ids),
            images=None if self.images is None else pick(self.images),
            token_versions=None if self.token_versions is None else pick(self.token_versions),
            **{name: None if getattr(self, name) is None else pick(getattr(self, name)) for name in TEACHER})

    def per_token_versions(self) -> list[list[int]]:
        """The version of every response token of each sample (token_versions, or the sample's version)."""
        if self.token_versions is not None:
            return self.token_versions
        return [[v] * len(r) for v, r in zip(self.versions, self.responses)]

    # ------------------------------------------------------------------ episodes

    def episode_index(self) -> list[int]:
        """Each sample's episode numbered 0, 1, ... in order of appearance (FILLER stays FILLER)."""
        if self.episode_ids is None:
            return list(range(len(self)))
        number: dict[int, int] = {}
        return [FILLER if e == FILLER else number.setdefault(e, len(number)) for e in self.episode_ids]

    def episode_ends(self) -> list[int]:
        """The last sample of each episode, in episode order: the conversation an episode ended with."""
        last: dict[int, int] = {}
        for i, e in enumerate(self.episode_index()):
            if e != FILLER:
                last[e] = i
        return [last[e] for e in sorted(last)]

    def episodes(self) -> RolloutBatch:
        """One sample per episode (its last): what rewards and evaluation see of the batch."""
        return self if self.episode_ids is None else self.select(self.episode_ends())

    def per_sample(self, per_episode: list) -> list:
        """Values of the episodes (in episode order) given to each of their samples."""
        return [per_episode[e] for e in self.episode_index()]

    def with_fillers(self, k: int, token: int) -> RolloutBatch:
        """The batch and `k` rows that train nothing (one `token` of response, loss mask 0, score 0, no episode,
        no group of their own): the learner pads a batch to a whole number of rows per rank and mini-batch."""
        if k == 0:
            return self
        n, version = len(self), max(self.versions)
        out = RolloutBatch(
            step=self.step, prompts=self.prompts + [self.prompts[0]] * k, responses=self.responses + [[token]] * k,
            loss_masks=self.loss_masks + [[0]] * k, rollout_logprobs=self.rollout_logprobs + [[0.0]] * k,
            versions=self.versions + [version] * k, truncated=self.truncated + [False] * k,
            group_ids=self.group_ids + [self.group_ids[-1]] * k, prompt_ids=self.prompt_ids + [self.prompt_ids[0]] * k,
            reward_parts={name: v + [0.0] * k for name, v in self.reward_parts.items()},
            reward_model_ids=None if self.reward_model_ids is None else self.reward_model_ids + [[token]] * k,
            scores=None if self.scores is None else self.scores + [0.0] * k, stats=self.stats,
            episode_ids=(self.episode_ids or list(range(n))) + [FILLER] * k,
            images=None if self.images is None else self.images + [self.images[0]] * k,
            token_versions=None if self.token_versions is None else self.token_versions + [[version]] * k,
            **{name: None if getattr(self, name) is None else getattr(self, name) + [[filler]] * k
               for name, filler in zip(TEACHER, (0.0, [], []))})
        return out

    @staticmethod
    def concat(batches: list[RolloutBatch], stats: dict | None = None) -> RolloutBatch:
        """The samples of `batches` one after the other, their groups numbered 0, 1, ... in order of appearance (so
        that groups of different batches stay apart); the first batch's step and, unless given, its stats."""
        first = batches[0]
        out = {name: [] for name in PER_SAMPLE}
        parts = {k: [] for k in first.reward_parts}
        rm_ids = [] if first.reward_model_ids is not None else None
        episodes = [] if any(b.episode_ids is not None for b in batches) else None
        teacher = {name: [] for name in TEACHER if getattr(first, name) is not None}
        images = [] if any(b.images is not None for b in batches) else None
        token_versions = [] if any(b.token_versions is not None for b in batches) else None
        for b in batches:
            if images is not None:
                images += b.images if b.images is not None else [[] for _ in range(len(b))]
            if token_versions is not None:
                token_versions += b.per_token_versions()
            if {name for name in TEACHER if getattr(b, name) is not None} != set(teacher):
                raise ValueError("RolloutBatch.concat: some batches have the teacher's log-probs and some do not")
            for name, vals in teacher.items():
                vals += getattr(b, name)
            if episodes is not None:  # renumbered as the groups are, so that episodes of different batches stay apart
                base = len(set(episodes))
                renumber_e: dict[int, int] = {}
                episodes += [renumber_e.setdefault(e, base + len(renumber_e)) for e in b.episode_index()]
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
                            stats=dict(first.stats if stats is None else stats), episode_ids=episodes,
                            images=images, token_versions=token_versions, **teacher)

    # ------------------------------------------------------------------ checkpoints

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["format"] = FORMAT
        if self.images is not None:  # JSON has no bytes
            d["images"] = [[base64.b64encode(b).decode("ascii") for b in imgs] for imgs in self.images]
        return d

    @staticmethod
    def from_json(d: dict) -> RolloutBatch:
        """A stored batch of any format: 2 (this one) or 1 (the dict of earlier versions: `response_masks` only for
        multi-turn samples, no group or prompt ids, and either reward parts or already shaped `scores`)."""
        fmt = d.get("format", 1)
        if fmt == FORMAT:
            fields = {f.name for f in dataclasses.fields(RolloutBatch)}
            out = {k: v for k, v in d.items() if k in fields}
            if out.get("images") is not None:
                out["images"] = [[base64.b64decode(b) for b in imgs] for imgs in out["images"]]
            return RolloutBatch(**out)
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
