"""The sections around the run itself: checkpoints, the processes' environment, Slurm resources, metrics and
experiment tracking."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from .evaluation import eval_metric_names

if TYPE_CHECKING:
    from .job import JobConfig


@dataclass
class CheckpointConfig:
    """Checkpoints: checkpoints/step_N/{hf,deepspeed}/, written atomically."""

    # Save every N steps (and at the end); 0: only when preempted or stopped.
    every: int = 0
    # Keep the newest K checkpoints.
    keep_last: int = 2
    # Also write the actor as an HF model folder (what `hpc-rl export` and from_pretrained read).
    save_hf: bool = True
    # Keep the checkpoint with the best value of this evaluation metric (e.g. eval/pass@1) besides the newest
    # keep_last, linked as checkpoints/best; a checkpoint is then also written at every evaluated step. null: off.
    keep_best: str | None = None
    # Whether a larger (max) or a smaller (min) keep_best value is better.
    best_mode: Literal["max", "min"] = "max"


@dataclass
class NCCLConfig:
    """NCCL settings exported to every process of the job."""

    # NCCL_SOCKET_IFNAME: the network interface NCCL uses (e.g. ib0); null: NCCL's choice.
    socket_ifname: str | None = None
    # NCCL_IB_DISABLE: true turns InfiniBand off (a broken fabric); null: NCCL's choice.
    ib_disable: bool | None = None
    # NCCL_DEBUG level (e.g. INFO to see the chosen transports); null: WARN.
    debug: str | None = None
    # Seconds a collective may hang before NCCL aborts it (instead of a silent hang).
    timeout_s: int = 1800


@dataclass
class EnvConfig:
    """The environment of every process of the job."""

    # Variables exported to every process (they win over everything else).
    vars: dict = field(default_factory=dict)
    # NCCL settings.
    nccl: NCCLConfig = field(default_factory=NCCLConfig)


@dataclass
class SlurmConfig:
    """What `hpc-rl submit` asks Slurm for."""

    # Partition (#SBATCH --partition); null: the cluster's default.
    partition: str | None = None
    # Account to charge (--account).
    account: str | None = None
    # Quality of service (--qos).
    qos: str | None = None
    # Time limit, Slurm's spelling (HH:MM:SS, D-HH:MM:SS, minutes).
    time: str = "01:00:00"
    # GPUs per node (--gpus-per-node); 0: none.
    gpus_per_node: int = 0
    # CPUs of the one task per node (--cpus-per-task).
    cpus_per_task: int | None = None
    # Memory per node, Slurm's spelling (64G; 0 = the whole node).
    mem: str | None = None
    # Node features (--constraint).
    constraint: str | None = None
    # Whole nodes only (--exclusive).
    exclusive: bool = False
    # Seconds before the time limit (or preemption) Slurm warns the job: checkpoint, then requeue.
    signal_delay_s: int = 120
    # Let Slurm requeue the job (preemption, time limit).
    requeue: bool = True
    # After a crash of the trainer (a rank died, a node was lost), requeue the job up to this many
    # times; it resumes from the latest checkpoint (0 = fail the job).
    requeue_on_failure: int = 0
    # E-mail address for Slurm's notifications.
    mail_user: str | None = None
    # Which notifications (BEGIN, END, FAIL, ALL).
    mail_type: str | None = None
    # Sweeps: at most this many array elements run at once (the %N throttle).
    array_parallelism: int | None = None
    # single: one job of all nodes; hetjob: trainer and rollout nodes as components (own partitions/GPUs).
    layout: Literal["single", "hetjob"] = "single"
    # hetjob: partition of the rollout component; null: `partition`.
    rollout_partition: str | None = None
    # hetjob: GPUs per rollout node; null: gpus_per_node.
    rollout_gpus_per_node: int | None = None
    # Any other #SBATCH option as {name: value} (true: a bare flag).
    additional: dict = field(default_factory=dict)
    # Shell lines run on every node before the job (module load ..., source ...).
    setup: list = field(default_factory=list)


@dataclass
class WandbConfig:
    """Weights & Biases: rank 0 logs metrics.jsonl's metrics (extra `tracking`); offline on nodes without internet."""

    # online: upload while training (needs internet and a login); offline: files in RUN/wandb/, uploaded later
    # with `hpc-rl sync RUN` from a login node; disabled: no W&B.
    mode: Literal["online", "offline", "disabled"] = "disabled"
    # The W&B project.
    project: str = "hpc-rl"
    # The W&B entity (team or user); null: your default entity.
    entity: str | None = None
    # Runs of one group are compared together; null: the sweep's name for a sweep's points, else none.
    group: str | None = None
    # Tags of the run.
    tags: list = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return self.mode != "disabled"


@dataclass
class MlflowConfig:
    """MLflow: rank 0 logs metrics.jsonl's metrics (extra `tracking`); on when experiment or tracking_uri is set."""

    # Tracking URI (http://host:5000, sqlite:///path.db, a folder); null: a file store in RUN/mlruns.
    tracking_uri: str | None = None
    # The experiment; null: the sweep's name for a sweep's points, else the job's name.
    experiment: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.tracking_uri or self.experiment)


@dataclass
class LoggingConfig:
    """Per-step metrics: metrics.jsonl always, TensorBoard when enabled, a step line on the console; W&B, MLflow."""

    # Also write TensorBoard events (RUN/tensorboard/).
    tensorboard: bool = True
    # Print the step line every N steps (metrics.jsonl gets every step).
    every: int = 1
    # Weights & Biases (logging.wandb.mode=offline on compute nodes, then `hpc-rl sync`).
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # MLflow (logging.mlflow.experiment=NAME logs into a file store in the run dir).
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)


def check(cfg: JobConfig, need) -> None:
    t, r = cfg.trainer, cfg.rollout
    need(cfg.checkpoint.every >= 0 and cfg.checkpoint.keep_last >= 1,
         "checkpoint.every must be >= 0 and checkpoint.keep_last >= 1")
    if cfg.checkpoint.keep_best is not None:
        need(cfg.eval.enabled, f"checkpoint.keep_best: {cfg.checkpoint.keep_best!r} is an evaluation metric but the "
             "job has no evaluation; set eval.source (held-out prompts) or remove checkpoint.keep_best")
        names = eval_metric_names(cfg.eval.samples_per_prompt)
        need(cfg.checkpoint.keep_best in names, f"checkpoint.keep_best: {cfg.checkpoint.keep_best!r} is not an "
             f"evaluation metric of this job; use one of {', '.join(names)}")
    need(cfg.logging.every >= 1, f"logging.every must be >= 1; got {cfg.logging.every}")
    need(bool(cfg.logging.wandb.project) and "/" not in cfg.logging.wandb.project,
         f"logging.wandb.project: {cfg.logging.wandb.project!r} must be a non-empty name without '/'")
    need(all(isinstance(t, str) and t and len(t) <= 64 for t in cfg.logging.wandb.tags),
         f"logging.wandb.tags must be a list of names of 1-64 characters; got {cfg.logging.wandb.tags}")
    need(cfg.logging.mlflow.experiment is None or bool(str(cfg.logging.mlflow.experiment).strip()),
         "logging.mlflow.experiment must be a non-empty name or null")
    need(cfg.slurm.signal_delay_s >= 0, "slurm.signal_delay_s must be >= 0")
    need(cfg.slurm.requeue_on_failure >= 0, "slurm.requeue_on_failure must be >= 0 (0 disables it)")
    need(cfg.slurm.gpus_per_node >= 0, "slurm.gpus_per_node must be >= 0")
    if cfg.slurm.gpus_per_node and cfg.trainer.device != "cpu":
        need(t.procs_per_node <= cfg.slurm.gpus_per_node,
             f"trainer.procs_per_node ({t.procs_per_node}) exceeds slurm.gpus_per_node "
             f"({cfg.slurm.gpus_per_node}): one trainer rank per GPU")
        need(r.tensor_parallel * r.servers_per_node <= (cfg.slurm.rollout_gpus_per_node or cfg.slurm.gpus_per_node),
             f"rollout.tensor_parallel x rollout.servers_per_node ({r.tensor_parallel * r.servers_per_node}) "
             "exceeds the GPUs of a rollout node")
