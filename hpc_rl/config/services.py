"""The services section: served models that are not the policy (a teacher for on-policy distillation). They run the
rollout server's machinery with a role of their own, register in the run's rendezvous/ like rollout servers, and never
receive weights."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from .job import JobConfig


@dataclass
class ServiceConfig:
    """One served model with a role: its HF folder, its engine and how many servers of it run."""

    # HF folder of the served model (config.json, weights, tokenizer files), or sft:JOB.yaml[@STEPS] (built by an SFT
    # job at run start).
    path: str | None = None
    # judge only: an OpenAI-compatible endpoint (its base URL, e.g. https://api.example.com/v1) instead of servers of
    # the run's own.
    url: str | None = None
    # url: the environment variable holding the endpoint's API key (read at run time, never written to the run dir).
    api_key_env: str | None = None
    # url: the model name the endpoint serves.
    model: str | None = None
    # The engine that serves it; null: rollout.engine.
    engine: Literal["hf", "vllm"] | None = None
    # Precision of the served model; null: rollout.dtype.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    # Nodes of their own in the run's Slurm job (after the rollout and reward nodes), servers_per_node on each; 0:
    # its servers run beside the trainer's node (and on `hpc-rl run`, on this machine).
    nodes: int = 0
    # Servers per node (each tensor_parallel GPUs).
    servers_per_node: int = 1
    # GPUs per server (vLLM tensor parallelism).
    tensor_parallel: int = 1
    # Share of each GPU the engine may use (vLLM); null: rollout.gpu_memory_utilization.
    gpu_memory_utilization: float | None = None
    # GPUs of this machine its servers use in `hpc-rl run` (tensor_parallel each, in order); empty: none (CPU, or
    # the GPUs the process sees).
    local_devices: list = field(default_factory=list)

    @property
    def servers(self) -> int:
        """Servers of the job's own: servers_per_node on each of its nodes (one node's worth when it has none); none
        for an external endpoint (url)."""
        return 0 if self.url else max(1, self.nodes) * self.servers_per_node


@dataclass
class ServicesConfig:
    """Served models that help the policy learn."""

    # The teacher of on-policy distillation (algorithm.distill): it scores the policy's sampled tokens; null: none.
    teacher: ServiceConfig | None = None
    # The LLM judge of reward.judge: it answers the judge template's prompts; null: none.
    judge: ServiceConfig | None = None

    def roles(self) -> dict[str, ServiceConfig]:
        """The services the job uses, by role."""
        return {name: svc for name, svc in (("teacher", self.teacher), ("judge", self.judge)) if svc is not None}


def check(cfg: JobConfig, need) -> None:
    for role, svc in cfg.services.roles().items():
        key = f"services.{role}"
        need(not svc.url or role == "judge", f"{key}.url: only a judge may be an external endpoint (a {role} scores "
             "the policy's own token ids); give services.{role}.path")
        need(bool(svc.path) != bool(svc.url), f"{key}: set path (an HF folder served by the run) or url (an "
             "OpenAI-compatible endpoint), one of them")
        need(not svc.url or svc.nodes == 0, f"{key}.nodes: an endpoint at url runs no servers of the job's own; "
             "remove nodes")
        need(not svc.url or bool(svc.model), f"{key}.model: name the model the endpoint at url serves")
        need(svc.nodes >= 0 and svc.servers_per_node >= 1 and svc.tensor_parallel >= 1,
             f"{key}: nodes must be >= 0, servers_per_node and tensor_parallel >= 1")
        need(not svc.local_devices or len(svc.local_devices) == svc.servers * svc.tensor_parallel,
             f"{key}.local_devices: {svc.servers} server(s) x tensor_parallel {svc.tensor_parallel} GPUs; got "
             f"{svc.local_devices}")
        need(svc.gpu_memory_utilization is None or 0 < svc.gpu_memory_utilization <= 1,
             f"{key}.gpu_memory_utilization must be in (0, 1]; got {svc.gpu_memory_utilization}")
    d = cfg.algorithm.distill
    if d.coef:
        need(cfg.services.teacher is not None, "algorithm.distill: on-policy distillation needs a teacher; set "
             "services.teacher.path (an HF folder with the policy's tokenizer)")
    need(not (d.only and cfg.algorithm.uses_critic), "algorithm.distill.only: the teacher's signal alone leaves the "
         "critic nothing to learn; use algorithm.name: grpo (or rloo), or distill.only: false")
    need(cfg.services.judge is None or cfg.reward.judge is not None, "services.judge: a judge serves reward.judge; "
         "set reward.judge (its template and parser), or remove services.judge")
    need(cfg.services.teacher is None or d.coef, "services.teacher: a teacher serves on-policy distillation; set "
         "algorithm.distill.coef > 0, or remove services.teacher")
