"""The rollout section: the servers (engine, sampling, placement, limits, weight sync, timeouts) and multi-turn
environments."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ..data.verifiers_tasks import check_id, is_verifiers

if TYPE_CHECKING:
    from .job import JobConfig


@dataclass
class SandboxConfig:
    """Limits of the sandbox that runs model-written code (the python tool); see
    hpc_rl.rollout.environments.sandbox for what each layer guarantees."""

    # Wall-clock seconds of one run (at most rollout.tool_timeout_s).
    wall_s: float = 10.0
    # CPU seconds of one run.
    cpu_s: int = 10
    # Address space of each sandboxed process in MiB.
    memory_mb: int = 1024
    # Processes the sandbox may run at once (a fork bomb stops there).
    processes: int = 16
    # Bytes of stdout+stderr returned to the model (the run is killed past it).
    output_bytes: int = 8192
    # Refuse to run model code where kernel namespaces are unavailable (rlimits alone do not stop reads of the
    # user's files or network access); false: run it with rlimits only.
    require_isolation: bool = True


@dataclass
class RolloutConfig:
    """The rollout servers: engine, sampling, placement, weight sync and timeouts."""

    # Generation engine; auto: vllm when it imports, else the HF engine.
    engine: Literal["auto", "vllm", "hf"] = "auto"
    # Rollout nodes of a Slurm job (0: the servers share the first trainer node).
    nodes: int = 1
    # Rollout servers per rollout node (e.g. one per GPU group of tensor_parallel GPUs). 0 (with nodes 0): none of
    # the job's own; the trainer waits for rollout jobs (`hpc-rl rollout add RUN`).
    servers_per_node: int = 1
    # GPUs of this machine the rollout servers use in `hpc-rl run` (tensor_parallel per server).
    local_devices: list = field(default_factory=list)
    # CPU cores the rollout servers of `hpc-rl run` are pinned to (empty: not pinned), e.g. [1] beside
    # trainer.local_cpus [0] to model a trainer node and a rollout node on one machine.
    local_cpus: list = field(default_factory=list)
    # Address the servers bind; 0.0.0.0 (all interfaces) so that other nodes reach them.
    host: str = "0.0.0.0"
    # Port the servers bind; 0: a free one, published in the run dir.
    port: int = 0
    # Sampling temperature (also applied to the trainer's log-probs).
    temperature: float = 1.0
    # Nucleus sampling mass (1: off).
    top_p: float = 1.0
    # Top-k sampling (-1: off).
    top_k: int = -1
    # Longest response in tokens.
    max_new_tokens: int = 16
    # Strings that end a response (each must be one token).
    stop: list = field(default_factory=list)
    # GPUs per vLLM server (tensor parallelism).
    tensor_parallel: int = 1
    # vLLM: fraction of GPU memory for weights + KV cache (on CPU: of one NUMA node's RAM, used only when
    # kv_cache_bytes is 0).
    gpu_memory_utilization: float = 0.2
    # vLLM's KV cache in bytes (its kv_cache_memory_bytes), on CPU and GPU. null: on CPU derived from the job
    # (concurrent sequences x max_model_len x the model's K/V bytes per token), on GPU sized by vLLM from
    # gpu_memory_utilization; 0: always from gpu_memory_utilization (on CPU a fraction of a NUMA node's RAM).
    kv_cache_bytes: int | None = None
    # Longest prompt + response the engine accepts.
    max_model_len: int = 256
    # vLLM: no CUDA graphs (faster start, slower decode).
    enforce_eager: bool = True
    # Engine precision; auto: bfloat16 for vLLM, the model's for HF.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # How new weights reach the servers: a collective broadcast, a file on the shared filesystem, or HTTP;
    # auto: collective where possible.
    weight_sync: Literal["auto", "collective", "file", "http"] = "auto"
    # Seconds one request (a generation chunk, a weight push) may take before it is retried elsewhere.
    request_timeout_s: float = 300.0
    # Retries of a failed request on other servers.
    retries: int = 2
    # Samples one request may ask a server for (prompts x n); a larger request is refused with 400 (the trainer's
    # client splits its work to fit). Bounds what one request can make a server hold.
    max_samples_per_request: int = 1024
    # Tokens one request may ask for: its prompt tokens plus n x max_new_tokens per prompt; past it, 400. null:
    # max_samples_per_request x max_model_len (no bound beyond the sample count).
    max_tokens_per_request: int | None = None
    # Requests a server holds at once (running or queued); one more is answered 429 with Retry-After, which the
    # client treats as "try another server, or again shortly".
    max_requests_in_flight: int = 256
    # HF engine: samples generated together in one batch; a larger request is generated in chunks of this many,
    # taking turns with other requests, so that one large request cannot starve small ones.
    hf_batch_samples: int = 256
    # Seconds to wait for every rollout server to come up.
    startup_timeout_s: float = 900.0
    # Seconds the trainer waits, with no rollout server left (or none yet: servers_per_node 0), for one to come
    # back or join (a requeued rollout job, `hpc-rl rollout add`) before it stops with a checkpoint; null:
    # startup_timeout_s; 0: stop at once.
    wait_for_servers_s: float | None = None
    # Generation runs this many steps ahead of training (0: generate, then train, in turn). Batch s is
    # generated by policy version max(0, s - async_steps) while the trainer trains the earlier batches,
    # so no sample is more than async_steps versions old (checked every step); README "How a step runs".
    async_steps: int = 0
    # In-flight weight updates (with async_steps >= 1): a weight push no longer waits for the generation in
    # progress; the servers pause it (HF: between decoding steps; vLLM: abort), swap the weights in place and
    # continue the same samples with the new policy (re-reading their prefix once with the new weights), so each
    # token is sampled by the newest weights there are and carries that version (RolloutBatch.token_versions).
    # Samples then depend on when the pushes land: a seeded run is not reproducible token for token; README
    # "In-flight weight updates".
    inflight_updates: bool = False
    # Partial rollouts (single-turn prompts): a step generates at most partial_tokens more tokens of each response,
    # trains on the groups that are complete (those carried over from earlier steps first) and carries the others
    # over to the next step, where they continue with the weights of then; a checkpoint keeps them, a resume is exact.
    # README "Partial rollouts".
    partial: bool = False
    # Tokens each response may generate per step with rollout.partial; null: a quarter of max_new_tokens (at least 1).
    partial_tokens: int | None = None
    # Prompts generated beyond a step's prompts_per_step with rollout.partial: the batch is full once prompts_per_step
    # groups are complete, and the rest (the longest) are carried over; null: half of prompts_per_step (at least 1).
    # 0: a step waits for all its groups (with partial_tokens >= max_new_tokens: a run without partial rollouts).
    partial_extra_prompts: int | None = None
    # With rollout.partial: the most policy versions a trained token may lag the step that trains it; a group with an
    # older token is dropped (stale_dropped_groups). At least async_steps (fresh samples lag that much); null: no
    # bound beyond the one partial_tokens sets (a response is carried at most max_new_tokens / partial_tokens steps).
    max_token_staleness: int | None = None
    # Multi-turn rollouts: the environment class as pkg.module:Class (hpc_rl.rollout.environments.base has the
    # interface; built in: hpc_rl.rollout.environments.tool_env:ToolCallEnv), or verifiers:ID, an installed verifiers
    # environment (its episodes run as agents; data.source names it too); null: one completion per prompt.
    env: str | None = None
    # Keyword arguments of the environment's constructor (one instance per trajectory); for verifiers:ID the
    # environment config's fields (its agent seats, e.g. {agent: {harness: {id: "null"}, max_turns: 4}}).
    env_kwargs: dict = field(default_factory=dict)
    # Assistant turns per trajectory; each samples at most max_new_tokens.
    max_turns: int = 4
    # Response tokens per trajectory, assistant and observation turns together; 0: max_model_len minus
    # data.max_prompt_tokens.
    max_total_tokens: int = 0
    # Seconds one environment step (a tool call) may take; past it the trajectory ends, counted as a tool error.
    tool_timeout_s: float = 30.0
    # The sandbox of the built-in python tool.
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    # An OpenAI-SDK agent as pkg.module:function: `async def fn(client, task, **agent_kwargs)` is awaited once per
    # episode with an openai.AsyncOpenAI pointed at the run and the dataset row, and returns the reward (or
    # {reward, metrics}); its calls are recorded on the engine's tokens and trained (README "Bring your own
    # environment"). null: no agent.
    agent: str | None = None
    # Keyword arguments of the agent function.
    agent_kwargs: dict = field(default_factory=dict)
    # Episodes running at once.
    agent_concurrency: int = 64
    # How a chat reply's tool calls are read into message.tool_calls (a request with tools, on the servers' and the
    # agents' OpenAI routes): hermes (<tool_call> blocks: Hermes, Qwen2.5, Qwen3), llama3_json (Llama 3.1-3.3's JSON
    # calls), mistral ([TOOL_CALLS] and a JSON list), or auto: whichever of them the reply is written in.
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = "auto"
    # Seconds one episode may take; past it the episode is lost (agent/failed_frac).
    agent_timeout_s: float = 600.0
    # The fraction of a step's episodes that may be lost; more stops the run (its finished steps checkpointed).
    agent_max_failed_frac: float = 0.5

    def extra_prompts(self, prompts_per_step: int) -> int:
        """partial_extra_prompts, its null resolved (half of prompts_per_step, at least 1)."""
        if self.partial_extra_prompts is not None:
            return self.partial_extra_prompts
        return max(1, prompts_per_step // 2)

    @property
    def segment_tokens(self) -> int:
        """partial_tokens, its null resolved (a quarter of max_new_tokens, at least 1)."""
        return self.partial_tokens if self.partial_tokens is not None else max(1, self.max_new_tokens // 4)

    @property
    def server_wait_s(self) -> float:
        """wait_for_servers_s, its null resolved to startup_timeout_s."""
        return self.startup_timeout_s if self.wait_for_servers_s is None else float(self.wait_for_servers_s)

    def total_tokens(self, max_prompt_tokens: int) -> int:
        """The response budget of one trajectory (max_total_tokens, or what max_model_len leaves)."""
        return self.max_total_tokens or self.max_model_len - max_prompt_tokens


def check(cfg: JobConfig, need) -> None:
    r = cfg.rollout
    need(r.nodes >= 0 and r.servers_per_node >= 0, "rollout.nodes and rollout.servers_per_node must be >= 0")
    need(r.servers_per_node >= 1 or r.nodes == 0,
         f"rollout.servers_per_node 0 (no servers of the job's own) goes with rollout.nodes 0; got rollout.nodes "
         f"{r.nodes}: set rollout.servers_per_node >= 1 or rollout.nodes: 0")
    need(r.wait_for_servers_s is None or r.wait_for_servers_s >= 0,
         f"rollout.wait_for_servers_s must be >= 0 (0: stop at once) or null; got {r.wait_for_servers_s}")
    need(r.temperature > 0, f"rollout.temperature must be > 0; got {r.temperature}")
    need(0 < r.top_p <= 1, f"rollout.top_p must be in (0, 1]; got {r.top_p}")
    need(r.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1")
    need(r.max_samples_per_request >= 1, f"rollout.max_samples_per_request must be >= 1; got {r.max_samples_per_request}")
    need(r.max_tokens_per_request is None or r.max_tokens_per_request >= r.max_model_len,
         f"rollout.max_tokens_per_request must be >= rollout.max_model_len ({r.max_model_len}) or null; got "
         f"{r.max_tokens_per_request}")
    need(r.max_requests_in_flight >= 1, f"rollout.max_requests_in_flight must be >= 1; got {r.max_requests_in_flight}")
    need(r.hf_batch_samples >= 1, f"rollout.hf_batch_samples must be >= 1; got {r.hf_batch_samples}")
    need(0 < r.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization must be in (0, 1]")
    need(r.kv_cache_bytes is None or r.kv_cache_bytes >= 0,
         f"rollout.kv_cache_bytes must be >= 0 bytes (null derives it from the job); got {r.kv_cache_bytes}")
    need(r.tensor_parallel >= 1, "rollout.tensor_parallel must be >= 1")
    need(r.max_model_len > cfg.data.max_prompt_tokens,
         f"rollout.max_model_len ({r.max_model_len}) must exceed data.max_prompt_tokens "
         f"({cfg.data.max_prompt_tokens})")
    need(0 <= r.port < 65536, f"rollout.port must be in [0, 65535]; got {r.port}")
    need(0 <= r.async_steps <= 16, f"rollout.async_steps must be in [0, 16] (0: synchronous); got {r.async_steps}")
    if r.inflight_updates:
        need(r.async_steps >= 1, "rollout.inflight_updates: weights change under running generations only while "
             "generation runs ahead of training; set rollout.async_steps >= 1, or rollout.inflight_updates: false")
    _check_partial(cfg, need)
    verifiers = is_verifiers(r.env)
    if verifiers:
        _check_verifiers(cfg, need)
    elif r.env is not None:
        _check_env(cfg, need)
    if r.agent is not None or verifiers:
        need(r.agent_concurrency >= 1, f"rollout.agent_concurrency must be >= 1; got {r.agent_concurrency}")
        need(r.agent_timeout_s > 0, f"rollout.agent_timeout_s must be > 0; got {r.agent_timeout_s}")
        need(0 <= r.agent_max_failed_frac <= 1,
             f"rollout.agent_max_failed_frac must be in [0, 1]; got {r.agent_max_failed_frac}")
    if r.agent is not None:
        need(isinstance(r.agent, str) and ":" in r.agent and all(r.agent.split(":", 1)),
             f"rollout.agent: {r.agent!r} is not pkg.module:function; e.g. "
             "hpc_rl.rollout.environments.toy_agents:lookup_agent")
        need(r.env is None, "rollout.agent and rollout.env are both set; an episode is either an agent's or an "
             "environment's: remove one")


def _check_partial(cfg: JobConfig, need) -> None:
    r = cfg.rollout
    if not r.partial:
        for key in ("partial_tokens", "partial_extra_prompts", "max_token_staleness"):
            need(getattr(r, key) is None, f"rollout.{key}: set, but rollout.partial is false; it applies to partial "
                 "rollouts: set rollout.partial: true or remove it")
        return
    need(r.env is None and r.agent is None, "rollout.partial: carries single-turn responses over; multi-turn "
         "environments and agents (rollout.env / rollout.agent) keep their episodes whole: remove one")
    need(not cfg.algorithm.dynamic_sampling.enabled, "rollout.partial: and algorithm.dynamic_sampling both decide "
         "which groups a step trains on; use one")
    need(1 <= r.segment_tokens <= r.max_new_tokens, f"rollout.partial_tokens must be in [1, rollout.max_new_tokens = "
         f"{r.max_new_tokens}]; got {r.partial_tokens}")
    need(r.partial_extra_prompts is None or r.partial_extra_prompts >= 0,
         f"rollout.partial_extra_prompts must be >= 0; got {r.partial_extra_prompts}")
    need(r.max_token_staleness is None or r.max_token_staleness >= r.async_steps,
         f"rollout.max_token_staleness ({r.max_token_staleness}) must be >= rollout.async_steps ({r.async_steps}): "
         "a fresh sample already lags that much, so every group would be dropped")


def _check_verifiers(cfg: JobConfig, need) -> None:
    """A verifiers environment plays the tasks of its own taskset: data.source (and eval.source) name it."""
    r = cfg.rollout
    check_id(r.env, "rollout.env")
    need(not r.agent_kwargs, "rollout.agent_kwargs: set, but there is no rollout.agent; a verifiers environment's "
         "settings are rollout.env_kwargs")
    need(cfg.data.source == r.env, f"data.source: {cfg.data.source!r}; a verifiers environment plays its own "
         f"taskset's tasks: set data.source: {r.env} (data.kwargs: the taskset's config)")
    if cfg.eval.enabled:
        need(cfg.eval_data.source == r.env, f"eval.source: {cfg.eval_data.source!r}; a verifiers environment plays "
             f"its own taskset's tasks: set eval.source: {r.env} (eval.kwargs: the taskset's config)")
    _check_budget(cfg, need)


def _check_budget(cfg: JobConfig, need) -> None:
    """An episode's response tokens (all its turns) fit beside the prompt."""
    r = cfg.rollout
    budget = r.total_tokens(cfg.data.max_prompt_tokens)
    need(r.max_total_tokens >= 0 and budget >= 1 and
         budget <= r.max_model_len - cfg.data.max_prompt_tokens,
         f"rollout.max_total_tokens ({r.max_total_tokens}) must be in [1, rollout.max_model_len - "
         f"data.max_prompt_tokens = {r.max_model_len - cfg.data.max_prompt_tokens}] (0: all of it)")


def _check_env(cfg: JobConfig, need) -> None:
    r, sb = cfg.rollout, cfg.rollout.sandbox
    need(isinstance(r.env, str) and ":" in r.env and all(r.env.split(":", 1)),
         f"rollout.env: {r.env!r} is not pkg.module:Class; e.g. hpc_rl.rollout.environments.tool_env:ToolCallEnv")
    need(r.max_turns >= 1, f"rollout.max_turns must be >= 1; got {r.max_turns}")
    _check_budget(cfg, need)
    need(r.tool_timeout_s > 0, f"rollout.tool_timeout_s must be > 0; got {r.tool_timeout_s}")
    need(0 < sb.wall_s <= r.tool_timeout_s, f"rollout.sandbox.wall_s must be in (0, rollout.tool_timeout_s = "
         f"{r.tool_timeout_s}]; got {sb.wall_s}")
    for key in ("cpu_s", "memory_mb", "processes", "output_bytes"):
        need(getattr(sb, key) >= 1, f"rollout.sandbox.{key} must be >= 1; got {getattr(sb, key)}")
