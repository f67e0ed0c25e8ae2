"""JobConfig: a whole job spec, its sections, what is derived from them, and the check of each section in turn
(each section's module holds the checks of its keys; those that tie sections together run where the later one
is checked)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..errors import ConfigError
from . import algorithm, evaluation, model, reward, rollout, runtime, services, trainer
from .algorithm import AlgorithmConfig
from .data import DataConfig
from .evaluation import EvalConfig
from .model import ModelConfig
from .reward import RewardConfig
from .rollout import RolloutConfig
from .runtime import CheckpointConfig, EnvConfig, LoggingConfig, SlurmConfig
from .services import ServicesConfig
from .trainer import TrainerConfig, node_range


@dataclass(frozen=True)
class NodeRole:
    """One node of a Slurm job and what it runs."""

    index: int          # node index inside the job (submitit JobEnvironment().node)
    role: str           # "trainer", "rollout", "reward" or a service's role ("teacher")
    role_index: int     # index among nodes of the same role
    procs: int          # trainer ranks or servers started on this node (a reward node: its one reward server)


@dataclass
class JobConfig:
    """A whole job spec."""

    # Name of the run (the run dir is OUTPUT_DIR/NAME-YYYYmmdd-HHMMSS, the Slurm job name).
    name: str = "job"
    # Seed of data order, sampling and initialization.
    seed: int = 1
    # Folder the run dirs go into (a relative one: under the directory hpc-rl runs in, where `hpc-rl status` looks).
    output_dir: str = "runs"
    # The policy model.
    model: ModelConfig = field(default_factory=ModelConfig)
    # The prompts.
    data: DataConfig = field(default_factory=DataConfig)
    # The reward function.
    reward: RewardConfig = field(default_factory=RewardConfig)
    # The RL algorithm and its loss.
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    # The trainer ranks and the optimization.
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # The rollout servers.
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    # Served models that help the policy (a teacher).
    services: ServicesConfig = field(default_factory=ServicesConfig)
    # Held-out evaluation (eval.jsonl, eval/step_N.jsonl).
    eval: EvalConfig = field(default_factory=EvalConfig)
    # Checkpoints.
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # The processes' environment.
    env: EnvConfig = field(default_factory=EnvConfig)
    # Slurm resources.
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    # Metrics and the step line.
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps of the whole run: RL steps x PPO epochs x mini-batches per step."""
        per_step = self.samples_per_step // max(self.trainer.mini_batch_size, 1)
        return self.trainer.steps * self.algorithm.ppo_epochs * per_step

    @property
    def samples_per_step(self) -> int:
        """Samples trained on per step: prompts x group size (SFT: the dataset's rows, prompts_per_step of them)."""
        if self.algorithm.supervised:
            return self.trainer.prompts_per_step
        return self.trainer.prompts_per_step * self.algorithm.group_size

    @property
    def world_size(self) -> int:
        """Trainer ranks; a node range (trainer.nodes "MIN-MAX") counts once the job knows its nodes
        (resolve_trainer_nodes)."""
        if not isinstance(self.trainer.nodes, int):
            raise ConfigError(f"trainer.nodes {self.trainer.nodes!r}: the number of trainer nodes is known once the "
                              "job runs")
        return self.trainer.nodes * self.trainer.procs_per_node

    @property
    def fewest_ranks(self) -> int:
        """Trainer ranks at the low end of a node range (each holds the largest share of the ZeRO state)."""
        return node_range(self.trainer.nodes)[0] * self.trainer.procs_per_node

    def resolve_trainer_nodes(self, nodes: int) -> None:
        """The trainer nodes this attempt of the job got (within trainer.nodes' range)."""
        lo, hi = node_range(self.trainer.nodes)
        if not lo <= nodes <= hi:
            raise ConfigError(f"trainer.nodes: this job has {nodes} trainer node(s), outside {self.trainer.nodes}; "
                              "submit with hpc-rl submit so the node count matches the spec")
        self.trainer.nodes = nodes

    def node_roles(self, trainer_nodes: int | None = None) -> list[NodeRole]:
        """Every node of the job in node-index order: trainer nodes, then rollout, reward and the services' nodes
        (`trainer_nodes`: for a node range, the count to lay out)."""
        t = self.trainer.nodes if trainer_nodes is None else trainer_nodes
        out = [NodeRole(i, "trainer", i, self.trainer.procs_per_node) for i in range(t)]
        out += [NodeRole(t + k, "rollout", k, self.rollout.servers_per_node) for k in range(self.rollout.nodes)]
        out += [NodeRole(t + self.rollout.nodes + k, "reward", k, 1) for k in range(self.reward.nodes)]
        for role, svc in self.services.roles().items():
            base = len(out)  # the role's first node: after every node laid out before it
            out += [NodeRole(base + k, role, k, svc.servers_per_node) for k in range(svc.nodes)]
        return out

    def server_layout(self, role: str) -> tuple[int, int, int]:
        """Where the servers of `role` ("rollout", "reward" or a service's) run in the job: (the index of its first
        node, its nodes, servers per node); with no nodes of its own they run beside trainer node 0."""
        nodes = [n for n in self.node_roles() if n.role == role]
        per_node = {"rollout": self.rollout.servers_per_node, "reward": 1}.get(role)
        if per_node is None:
            per_node = self.services.roles()[role].servers_per_node
        return (nodes[0].index if nodes else 0), len(nodes), per_node

    @property
    def server_nodes(self) -> int:
        """Nodes of the job that serve rather than train: rollout, reward and services' nodes, in that order."""
        return self.rollout.nodes + self.reward.nodes + sum(s.nodes for s in self.services.roles().values())

    @property
    def gpus_per_rollout_server(self) -> int:
        """GPUs of one rollout server: its tensor-parallel ones, and one more for a reward model it hosts."""
        return self.rollout.tensor_parallel + (1 if self.reward.on_rollout_servers else 0)

    @property
    def response_budget(self) -> int:
        """Response tokens a sample may have: rollout.max_new_tokens, or a multi-turn trajectory's total budget."""
        r = self.rollout
        return r.total_tokens(self.data.max_prompt_tokens) if r.env or r.agent else r.max_new_tokens

    @property
    def eval_data(self) -> DataConfig:
        """The held-out prompts as a data section: eval.source, eval.split and eval.prompt_key, data's prompt limit."""
        e = self.eval
        return dataclasses.replace(self.data, source=e.source, split=e.split,
                                   prompt_key=e.prompt_key or self.data.prompt_key, shuffle=False,
                                   kwargs=self.data.kwargs if e.kwargs is None else e.kwargs)

    @property
    def rollout_servers(self) -> int:
        """How many rollout servers the job runs (rollout.nodes=0, or a local run: one node's worth); rollout jobs'
        servers come on top."""
        if self.algorithm.supervised:
            return 0
        return max(1, self.rollout.nodes) * self.rollout.servers_per_node


def validate(cfg: JobConfig) -> JobConfig:
    """Cross-field checks that types alone cannot express, section by section; ConfigError naming the key."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(msg)

    need(bool(cfg.name) and "/" not in cfg.name and not cfg.name.startswith("."),
         f"name: {cfg.name!r} must be a non-empty name without '/'")
    # SFT starts no servers and scores nothing (its eval is a loss on eval.source's rows): those sections do not apply.
    rl_only = (reward, rollout, evaluation) if cfg.algorithm.supervised else ()
    for section in (model, algorithm, trainer, reward, rollout, services, evaluation, runtime):
        if section not in rl_only:
            section.check(cfg, need)
    return cfg
