"""OpenAI-SDK agents as episodes: `rollout.agent: pkg.mod:fn` is awaited once per episode as
`await fn(client, task, **rollout.agent_kwargs)`, with `client` an `openai.AsyncOpenAI` whose base URL is the episode's
own on the run's agent front (agent_front.py) and `task` the dataset row. It returns the reward (a number) or
{"reward": number, "metrics": {name: number}}.

An agent that raises, runs past rollout.agent_timeout_s or returns anything else loses its episode (one warning line
with the cause, counted in agent/failed_frac); past rollout.agent_max_failed_frac of a step's episodes the run stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import secrets
from dataclasses import dataclass, field

from ..errors import ConfigError, RewardError, first_line
from ..rewards.base import load_reward_fn
from .agent_clients import EpisodeClients, in_process_client, short_gil_turns
from .agent_front import AgentFront
from .agent_trace import Call, TraceSample, samples_of
from .batch import RolloutBatch

log = logging.getLogger("hpc_rl")


def load_agent(spec: str, key: str = "rollout.agent"):
    """The agent function of `spec` (pkg.module:function); ConfigError naming `key` unless it is `async def`."""
    fn = load_reward_fn(spec, key)
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"{key}: {spec} is not an async function; define it as `async def {spec.split(':')[-1]}"
                          "(client, task, **kwargs)` (hpc-rl awaits it once per episode)")
    return fn


def check_openai_installed(key: str = "rollout.agent") -> None:
    try:
        import openai  # noqa: F401
    except ImportError:
        raise ConfigError(f"{key}: agents get an openai.AsyncOpenAI client, and the openai package is not installed; "
                          "install it with `./install.sh --envs` (or `pip install openai`)") from None


@dataclass
class EpisodeResult:
    """One episode: its recorded calls and samples, its reward and metrics, or why it was lost."""

    calls: list[Call] = field(default_factory=list)
    samples: list[TraceSample] = field(default_factory=list)
    reward: float = 0.0
    metrics: dict = field(default_factory=dict)
    error: str | None = None  # set when the episode is lost


def parse_outcome(value) -> tuple[float, dict]:
    """An agent's return value as (reward, metrics); ValueError saying what is wrong with it."""
    metrics = {}
    if isinstance(value, dict):
        if "reward" not in value:
            raise ValueError(f"returned a dict without 'reward' (keys: {sorted(value)})")
        metrics = value.get("metrics") or {}
        if not isinstance(metrics, dict) or not all(isinstance(k, str) and _number(v) for k, v in metrics.items()):
            raise ValueError(f"returned metrics that are not {{name: number}}: {metrics!r:.200}")
        value = value["reward"]
    if not _number(value) or not math.isfinite(float(value)):
        raise ValueError(f"returned the reward {value!r:.200}; return a finite number or {{'reward': number}}")
    return float(value), {k: float(v) for k, v in metrics.items()}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class AgentRollout:
    """Runs a step's (or an evaluation's) episodes against the agent front; one per run, on rank 0."""

    def __init__(self, cfg, front: AgentFront, fn):
        r = cfg.rollout
        self.fn = fn  # load_agent(rollout.agent), or a verifiers environment (verifiers_env.VerifiersEnv)
        self.kwargs = dict(r.agent_kwargs)
        self.concurrency, self.timeout_s, self.max_failed = r.agent_concurrency, r.agent_timeout_s, \
            r.agent_max_failed_frac
        self.front = front

    def run(self, rows: list[dict], step: int, seed_of_call, defaults) -> list[EpisodeResult]:
        """One episode per row, in row order; `seed_of_call(episode, k)` seeds the episode's k-th call, `defaults`
        (openai_api.Defaults) are the generation's sampling settings."""
        self.front.server_error = None
        with short_gil_turns():
            results = asyncio.run(self._all(rows, seed_of_call, defaults, step))
        if self.front.server_error is not None:  # the servers are gone, not the agent: the run waits for them
            raise self.front.server_error
        lost = [(i, r.error) for i, r in enumerate(results) if r.error is not None]
        for i, why in lost[:3]:
            log.warning("step %d: agent episode %d (row %s) lost: %s", step + 1, i, rows[i].get("id"), why)
        if len(lost) > 3:
            log.warning("step %d: %d more agent episodes lost", step + 1, len(lost) - 3)
        if rows and len(lost) / len(rows) > self.max_failed:
            raise RewardError(f"step {step + 1}: {len(lost)} of {len(rows)} agent episodes failed, more than "
                               f"rollout.agent_max_failed_frac {self.max_failed:g} (first: {lost[0][1]}); fix the "
                               "agent or raise the limit")
        return results

    async def _all(self, rows: list[dict], seed_of_call, defaults, step: int) -> list[EpisodeResult]:
        gate = asyncio.Semaphore(self.concurrency)
        nonce = secrets.token_hex(4)  # the step's: a client kept from an earlier step names no running episode
        # A verifiers environment's serving resources (its interception server) live for the step's episodes.
        serving = self.fn.serving(self.front.token) if hasattr(self.fn, "serving") else contextlib.nullcontext()
        async with serving, in_process_client(self.front, self.timeout_s) as http:
            client_of = EpisodeClients(http, self.front.token)

            async def one(i: int, row: dict) -> EpisodeResult:
                async with gate:
                    name = f"{i}-{nonce}"
                    self.front.open(name, lambda k: seed_of_call(i, k), defaults, step)
                    client = client_of(self.front.url(name))
                    res = EpisodeResult()
                    try:
                        value = await _within(self.fn(client, dict(row), **self.kwargs), self.timeout_s)
                        res.reward, res.metrics = parse_outcome(value)
                    except asyncio.TimeoutError:
                        res.error = f"ran past rollout.agent_timeout_s ({self.timeout_s:g} s)"
                    except ValueError as e:
                        res.error = str(e)
                    except Exception as e:  # noqa: BLE001 - user code: the episode is lost, not the run
                        res.error = f"raised {type(e).__name__}: {first_line(e)}"
                    res.calls = self.front.close(name)
                    res.samples = samples_of(res.calls)
                    if res.error is None and not res.calls:
                        res.error = "made no call to the model (nothing to train on)"
                    return res

            return list(await asyncio.gather(*(one(i, row) for i, row in enumerate(rows))))


async def _within(coro, seconds: float):
    """`await coro`, TimeoutError past `seconds`. In the calling task where Python has asyncio.timeout (3.11): an
    episode reaches its first call before the next episode starts, so the first wave leaves at once, where wait_for's
    task of its own let all the step's episodes start first (~15 ms for 256)."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(seconds):
            return await coro
    return await asyncio.wait_for(coro, seconds)


def agent_batch(episodes: list[EpisodeResult], rows: list[dict], n: int, step: int, prompts: list[list[int]],
                tokenizer) -> tuple[RolloutBatch, list[str], dict]:
    """The step's batch from its episodes (episode i: group i // n, of prompt `prompts[i // n]`), the texts reward
    functions score (per episode: its last completion), and the agent/* statistics.

    An episode has a sample per conversation (agent_trace.samples_of), all of them with its reward and episode id.
    A lost episode keeps its slot (groups stay whole for the estimators) as a sample that trains nothing: one token,
    loss mask 0, and its group's mean reward of the episodes that finished (0 when none did), so it moves neither
    the group's mean nor any advantage's sign."""
    ok = [e.error is None for e in episodes]
    rewards = []
    for i, e in enumerate(episodes):
        group = [episodes[j] for j in range(i - i % n, i - i % n + n) if ok[j]]
        rewards.append(e.reward if ok[i] else (sum(g.reward for g in group) / len(group) if group else 0.0))
    versions = [s.version for e, good in zip(episodes, ok) if good for s in e.samples]
    filler_version = max(versions) if versions else 0
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.pad_token_id
    out = {k: [] for k in ("prompts", "responses", "loss_masks", "rollout_logprobs", "versions", "truncated",
                           "group_ids", "prompt_ids")}
    episode_ids, texts = [], []
    for i, (e, good) in enumerate(zip(episodes, ok)):
        if good:
            samples = [(s.prompt, s.response, s.loss_mask, s.logprobs, s.version, s.truncated) for s in e.samples]
            texts.append(tokenizer.decode(e.calls[-1].completion_ids, skip_special_tokens=True))
        else:
            samples = [(list(prompts[i // n]), [eos], [0], [0.0], filler_version, False)]
            texts.append("")
        for vals in samples:
            for k, v in zip(out, (*vals, i // n, int(rows[i]["id"]))):
                out[k].append(v)
            episode_ids.append(i)
    batch = RolloutBatch(step=step, **out, reward_parts={"environment": [rewards[e] for e in episode_ids]},
                         episode_ids=episode_ids)
    done = [e for e, good in zip(episodes, ok) if good]
    stats = {"agent/failed_frac": 1.0 - len(done) / max(1, len(episodes)),
             "agent/calls_per_episode": sum(len(e.calls) for e in episodes) / max(1, len(episodes)),
             "agent/samples_per_episode": sum(len(e.samples) for e in done) / max(1, len(episodes))}
    for name in sorted({k for e in done for k in e.metrics}):
        vals = [e.metrics[name] for e in done if name in e.metrics]
        stats[f"agent/{name}"] = sum(vals) / len(vals)
    return batch, texts, stats
