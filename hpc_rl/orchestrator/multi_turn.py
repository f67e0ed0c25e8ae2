"""The multi-turn rollout loop, on the orchestrator (trainer rank 0): many trajectories in flight, turns batched.

Every trajectory alternates an assistant turn (sampled by the rollout servers) and an environment step (run in a
worker thread: tools, sandboxed code). Whenever trajectories are ready to generate, they go to the servers together
as one request (a "wave"; at most MAX_WAVES in flight, so one wave is generated while the next gathers), while
others wait for their tools; so the engines idle only when every unfinished trajectory waits for a tool.
Why here and not beside the engine: one loop serves every engine and server count (the client load-balances
waves), environments and tools run where the reward functions and the data are, and the cost is one HTTP round
trip per wave, not per trajectory (bench/multi_turn.py measures engine idle time and step time).

A trajectory is one token sequence: prompt, then assistant turns (mask 1, the engine's log-probs) and observation
turns (mask 0, log-prob 0), the sampled ids kept as they came (never re-tokenized from text).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from ..errors import DataError, RewardError, first_line
from ..metrics import idle_seconds
from ..rewards.base import as_reward
from ..rollout.environments.chat import ChatFormat
from ..rollout.environments.tools import ToolContext, is_error
from ..rollout.wire.sampling import SamplingParams

log = logging.getLogger("hpc_rl")

MAX_WAVES = 2
MAX_TOOL_WORKERS = 32


@dataclass
class Limits:
    """rollout.max_turns, max_total_tokens (response side: assistant + observation tokens), tool_timeout_s,
    max_new_tokens (per turn) and max_model_len."""

    max_turns: int
    max_total_tokens: int
    tool_timeout_s: float
    max_new_tokens: int
    max_model_len: int


@dataclass
class Trajectory:
    """One multi-turn sample, as the trainer takes it (response_ids/mask/logprobs) plus what metrics need."""

    prompt_ids: list[int]
    env: object = field(repr=False)
    fmt: ChatFormat = field(default=None, repr=False)  # the chat format of the environment's tools
    messages: list[dict] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    env_reward: float = 0.0
    final_text: str = ""
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0
    truncated: bool = False
    version: int | None = None
    token_versions: list[int] = field(default_factory=list)  # per response token (observations: the turn's before)

    @property
    def mixed(self) -> bool:
        """Whether its tokens come from more than one policy version."""
        return len(set(self.token_versions)) > 1
    done: bool = False
    last_turn: object = field(default=None, repr=False)  # the SampleOut of the turn just sampled
    step_started: float | None = None  # monotonic start of the environment step running now


class MultiTurnRollout:
    """Runs trajectories of `env_cls` against a RolloutClient; one instance per run (formats are cached)."""

    def __init__(self, env_cls, env_kwargs: dict, tokenizer, client, limits: Limits, context: ToolContext):
        self.env_cls, self.env_kwargs = env_cls, env_kwargs
        self.tokenizer, self.client, self.limits, self.context = tokenizer, client, limits, context
        self._formats: dict[str, ChatFormat] = {}
        self._warned: set[str] = set()

    def _format(self, env) -> ChatFormat:
        tools = list(getattr(env, "tools", None) or [])
        key = json.dumps(tools, sort_keys=True)
        if key not in self._formats:
            self._formats[key] = ChatFormat(self.tokenizer, tools)
        return self._formats[key]

    def start(self, row: dict) -> Trajectory:
        """A new environment for `row`, reset; its prompt as token ids."""
        env = self.env_cls(**self.env_kwargs)
        env.context = self.context
        messages = env.reset(row)
        fmt = self._format(env)
        ids = fmt.prompt_ids(messages)
        lim = self.limits
        if len(ids) + lim.max_new_tokens > lim.max_model_len:
            raise DataError(f"row {row.get('id')}: the environment's first messages are {len(ids)} tokens; with "
                            f"rollout.max_new_tokens {lim.max_new_tokens} that exceeds rollout.max_model_len "
                            f"{lim.max_model_len}; raise max_model_len or shorten the prompt")
        return Trajectory(prompt_ids=ids, env=env, fmt=fmt, messages=list(messages))

    def run(self, rows: list[dict], params: SamplingParams, step: int,
            turn_seed: Callable[[int, int], int] | None = None) -> tuple[list[Trajectory], dict]:
        """One trajectory per row (rows repeat for a group), in row order; with the loop's statistics.

        `turn_seed(row, turn)` is the seed of each turn (None: nondeterministic): a sample then does not depend on
        which trajectories share a wave, which depends on when their tools finish."""
        trajs = [self.start(r) for r in rows]
        t0 = time.time()
        ready = list(range(len(trajs)))
        gens: dict[Future, list[int]] = {}
        tools: dict[Future, int] = {}  # an environment step -> its trajectory
        busy, wave = [], 0
        pool_gen = ThreadPoolExecutor(MAX_WAVES, thread_name_prefix="multi-turn-gen")
        pool_tool = ThreadPoolExecutor(min(MAX_TOOL_WORKERS, max(1, len(trajs))), thread_name_prefix="env-step")
        try:
            while ready or gens or tools:
                while ready and len(gens) < MAX_WAVES:
                    for group in self._groups(trajs, ready, params.max_new_tokens):
                        turn_seeds = None if turn_seed is None else [turn_seed(i, trajs[i].turns) for i in group[1]]
                        p = SamplingParams(n=1, max_new_tokens=group[0], temperature=params.temperature,
                                           top_p=params.top_p, top_k=params.top_k,
                                           stop_token_ids=params.stop_token_ids, seeds=turn_seeds)
                        wave += 1
                        span = [time.time(), None]
                        busy.append(span)
                        fut = pool_gen.submit(self._generate, [trajs[i] for i in group[1]], p, step, span)
                        gens[fut] = group[1]
                    ready = []
                timeout = self._next_tool_deadline(trajs, tools)
                done, _ = wait([*gens, *tools], timeout=timeout, return_when=FIRST_COMPLETED)
                for fut in done:
                    if fut in gens:
                        group = gens.pop(fut)
                        fut.result()  # a RolloutError (every server gone) ends the batch
                        for i in group:  # every turn goes to the environment, which says what follows
                            self._record_turn(trajs[i])
                            trajs[i].step_started = None
                            tools[pool_tool.submit(self._step, trajs[i])] = i
                    else:
                        i = tools.pop(fut)
                        if self._after_step(i, trajs[i], fut.result()):
                            ready.append(i)
                self._expire_tools(trajs, tools)
        finally:
            pool_gen.shutdown(wait=False, cancel_futures=True)
            pool_tool.shutdown(wait=False, cancel_futures=True)
        wall = time.time() - t0
        return trajs, self._stats(trajs, busy, t0, wall)

    # ------------------------------------------------------------------ generation

    def _groups(self, trajs: list[Trajectory], ready: list[int], per_turn: int) -> list[tuple[int, list[int]]]:
        """Ready trajectories grouped by how many tokens each may still generate (one request per group); a turn
        generates at most `per_turn` (the request's max_new_tokens: rollout's, or an evaluation's)."""
        lim = self.limits
        groups: dict[int, list[int]] = {}
        for i in ready:
            t = trajs[i]
            room = min(per_turn, lim.max_total_tokens - len(t.response_ids),
                       lim.max_model_len - len(t.prompt_ids) - len(t.response_ids))
            groups.setdefault(room, []).append(i)
        return sorted(groups.items())

    def _generate(self, batch: list[Trajectory], p: SamplingParams, step: int, span: list) -> None:
        try:
            res = self.client.generate([t.prompt_ids + t.response_ids for t in batch], p, step=step)
        finally:
            span[1] = time.time()
        for t, samples, version in zip(batch, res.outputs, res.policy_versions):
            s = samples[0]
            t.response_ids += s.token_ids
            t.mask += [1] * len(s.token_ids)
            t.logprobs += s.logprobs
            turn_versions = s.token_versions(version)
            t.token_versions += turn_versions
            t.turns += 1
            first = turn_versions[0] if turn_versions else version  # this sample's own oldest token, not the request's
            t.version = first if t.version is None else min(t.version, first)
            t.last_turn = s

    def _record_turn(self, t: Trajectory) -> None:
        """The sampled turn as the assistant message the environment steps on."""
        s = t.last_turn
        text = self.tokenizer.decode(s.token_ids, skip_special_tokens=True)
        t.final_text = text
        t.messages.append({"role": "assistant", "content": text})

    # ------------------------------------------------------------------ environment steps

    def _step(self, t: Trajectory):
        t0 = t.step_started = time.monotonic()  # the timeout counts from here, not from the queue
        try:
            out = t.env.step(t.messages[-1])
        except Exception as e:  # noqa: BLE001 (a user environment's failure ends this trajectory, not the run)
            return ("error", f"{type(e).__name__}: {first_line(e)}", time.monotonic() - t0)
        return ("ok", out, time.monotonic() - t0)

    def _after_step(self, i: int, t: Trajectory, result) -> bool:
        """Apply trajectory i's environment step; True when it generates again."""
        kind, out, seconds = result
        t.tool_seconds += seconds
        if kind == "error":
            self._warn_once(f"rollout.env {self.env_cls.__name__}.step raised {out}; the trajectory ends there "
                            "(counted in tool_errors)")
            t.tool_errors += 1
            t.done = True
            return False
        obs, reward, done = self._check_step(out, i)
        if reward is not None:
            t.env_reward += reward
        if done or not obs:
            t.done = True
            return False
        t.tool_calls += 1
        t.tool_errors += sum(1 for m in obs if is_error(str(m.get("content", ""))))
        lim = self.limits
        if t.turns >= lim.max_turns:
            t.truncated = t.done = True
            return False
        s = t.last_turn
        ids = t.fmt.observation_ids(obs, s.token_ids[-1] if s.token_ids else None,
                                                   s.finish_reason == "stop")
        # The next turn needs room for its observation and at least one generated token.
        if (len(t.response_ids) + len(ids) + 1 > lim.max_total_tokens
                or len(t.prompt_ids) + len(t.response_ids) + len(ids) + 1 > lim.max_model_len):
            t.truncated = t.done = True
            return False
        t.messages.extend(obs)
        t.response_ids += ids
        t.mask += [0] * len(ids)
        t.logprobs += [0.0] * len(ids)
        t.token_versions += [t.token_versions[-1] if t.token_versions else (t.version or 0)] * len(ids)
        return True

    def _check_step(self, out, index: int) -> tuple[list[dict] | None, float | None, bool]:
        spec = f"{self.env_cls.__module__}:{self.env_cls.__name__}"
        if not isinstance(out, tuple) or len(out) != 3:
            raise RewardError(f"rollout.env {spec}: step returned {type(out).__name__}; return (observations | None, "
                              "reward | None, done)")
        obs, reward, done = out
        if obs is not None and (not isinstance(obs, list) or not all(isinstance(m, dict) and "role" in m
                                                                     and "content" in m for m in obs)):
            raise RewardError(f"rollout.env {spec}: step's observations must be a list of chat messages "
                              "{'role': ..., 'content': ...} or None")
        return obs, None if reward is None else as_reward(reward, spec, index, "rollout.env"), bool(done)

    def _next_tool_deadline(self, trajs: list[Trajectory], tools: dict) -> float | None:
        running = [trajs[i].step_started for i in tools.values() if trajs[i].step_started is not None]
        if len(running) < len(tools):
            return 0.5  # queued steps start later: look again soon
        if not running:
            return None
        return max(0.0, min(running) + self.limits.tool_timeout_s - time.monotonic()) + 0.01

    def _expire_tools(self, trajs: list[Trajectory], tools: dict) -> None:
        """Steps running longer than rollout.tool_timeout_s end their trajectory (the thread is left to finish)."""
        now = time.monotonic()
        for fut, i in list(tools.items()):
            t = trajs[i]
            started = t.step_started
            if started is not None and now - started > self.limits.tool_timeout_s:
                del tools[fut]
                t.tool_errors += 1
                t.tool_seconds += now - started
                t.truncated = t.done = True
                self._warn_once(f"rollout.env {self.env_cls.__name__}.step took more than rollout.tool_timeout_s "
                                f"{self.limits.tool_timeout_s:g}s; the trajectory ends there")

    def _warn_once(self, msg: str) -> None:
        if msg not in self._warned:
            self._warned.add(msg)
            log.warning("%s", msg)

    # ------------------------------------------------------------------ statistics

    @staticmethod
    def _stats(trajs: list[Trajectory], busy: list[list], t0: float, wall: float) -> dict:
        n = max(1, len(trajs))
        return {"turns_per_sample": sum(t.turns for t in trajs) / n,
                "tool_calls_per_sample": sum(t.tool_calls for t in trajs) / n,
                "tool_call_rate": sum(1 for t in trajs if t.tool_calls) / n,
                "tool_errors": sum(t.tool_errors for t in trajs),
                "tool_seconds": sum(t.tool_seconds for t in trajs),
                "truncated_fraction": sum(1 for t in trajs if t.truncated) / n,
                "rollout_waves": len(busy),
                "engine_idle_seconds": idle_seconds(busy, t0, t0 + wall),
                "rollout_seconds": wall}
