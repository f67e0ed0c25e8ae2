"""Which node of a job does what: trainer nodes first, then rollout nodes, then reward nodes, then the services'
nodes (services.ROLE.nodes, e.g. teacher; one submitit task per node)."""

from __future__ import annotations

from ..config import JobConfig
from ..config.job import NodeRole
from ..config.trainer import node_range
from ..errors import ConfigError


def total_nodes(cfg: JobConfig) -> int:
    """Nodes of the whole job: trainer.nodes + the serving nodes (a node range: its MAX trainer nodes)."""
    return node_range(cfg.trainer.nodes)[1] + cfg.server_nodes


def nodes_request(cfg: JobConfig) -> str:
    """sbatch's --nodes: the job's node count, or for a trainer node range MIN-MAX with the rollout and reward
    nodes added to both ends (Slurm starts the job once MIN are free and gives it up to MAX)."""
    lo, hi = node_range(cfg.trainer.nodes)
    others = cfg.server_nodes
    return str(lo + others) if lo == hi else f"{lo + others}-{hi + others}"


def role_of(cfg: JobConfig, node_index: int) -> str:
    """'trainer' for node_index < trainer.nodes, then 'rollout', 'reward' and the services' roles (a node range:
    resolved to this attempt's count first, JobConfig.resolve_trainer_nodes)."""
    if not 0 <= node_index < total_nodes(cfg):
        raise ValueError(f"node index {node_index} outside a job of {total_nodes(cfg)} nodes")
    return next(n.role for n in node_roles(cfg) if n.index == node_index)


def node_roles(cfg: JobConfig) -> list[NodeRole]:
    """Every node of the job with its role, in node-index order (a node range: its MAX trainer nodes)."""
    return cfg.node_roles(node_range(cfg.trainer.nodes)[1])


def check_layout(cfg: JobConfig) -> None:
    """Checks that only matter for Slurm submission; ConfigError naming the key."""
    s = cfg.slurm
    if s.layout == "hetjob" and cfg.algorithm.supervised:
        raise ConfigError("slurm.layout: hetjob puts rollout nodes in a second component; SFT has trainer nodes only: "
                          "use slurm.layout=single")
    if s.layout == "hetjob" and cfg.rollout.nodes < 1:
        raise ConfigError("slurm.layout: hetjob needs rollout.nodes >= 1 (the second component); "
                          "set rollout.nodes or use slurm.layout=single")
    if s.layout == "hetjob" and isinstance(cfg.trainer.nodes, str):
        raise ConfigError(f"trainer.nodes: a node range ({cfg.trainer.nodes}) needs slurm.layout=single (a "
                          "heterogeneous job's components have fixed sizes); set slurm.layout=single or a node count")
    if s.layout == "single" and (s.rollout_partition or s.rollout_gpus_per_node is not None):
        raise ConfigError("slurm.rollout_partition/rollout_gpus_per_node only apply to slurm.layout=hetjob; "
                          "set slurm.layout=hetjob or remove them")


def describe(cfg: JobConfig) -> list[str]:
    """One line per node for `submit --dry-run`."""
    lines = []
    lo, hi = node_range(cfg.trainer.nodes)
    if lo != hi:
        lines.append(f"trainer nodes {lo} to {hi}: as many as Slurm gives ({nodes_request(cfg)} nodes in all); the "
                     f"roles below are those of {hi}")
    for n in node_roles(cfg):
        what = {"trainer": f"{n.procs} trainer rank(s)",
                "rollout": f"{n.procs} rollout server(s), tensor parallel {cfg.rollout.tensor_parallel}",
                "reward": "1 reward server (the reward model only)"}.get(n.role, f"{n.procs} {n.role} server(s)")
        if n.role == "trainer" and cfg.algorithm.supervised:
            what += ", SFT: no rollout server"
        elif n.role == "trainer" and n.role_index == 0 and cfg.rollout.nodes == 0:
            shared = (f"{cfg.rollout.servers_per_node} rollout server(s) beside them, rollout.nodes 0"
                      if cfg.rollout.servers_per_node else "no rollout server of its own: `hpc-rl rollout add` brings them")
            what += f" + {shared}"
        lines.append(f"node {n.index}: {n.role} {n.role_index} ({what})")
    return lines
