"""`hpc-rl rollout add|list|remove RUN`: rollout servers as Slurm jobs of their own that join a running run.

A rollout job is a submitit job beside the run's own (its files in RUN/rollout_jobs/submitit/): each of its nodes
starts rollout servers for the run, with the run's job.yaml and token, under indexes of the job's own range (listed
in RUN/rollout_jobs.json). They register in RUN/rendezvous/ like the run's servers; the trainer's client takes them
in at its next weight push (which brings them to the current policy) and sends them work by their measured
throughput. They leave by draining (SIGTERM: 503 to new work, deregister, finish what runs), when the job is
removed, preempted (then requeued, if slurm.requeue) or ends with the run (done.json).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import submitit

from .. import config
from ..config import JobConfig
from ..errors import ClusterError, ConfigError
from ..logs import setup_logging
from ..netutil import auth_session
from ..rollout.client.pool import registration_problem
from ..rollout.wire.protocol import DRAIN_S
from ..rundir import RunDir, file_lock, find, read_json, write_json_atomic
from . import slurmq
from .env import prepare_node_env
from .render import executor_params, submitit_command
from .submit import SLURM_JSON

log = logging.getLogger("hpc_rl")

ROLLOUT_JOBS_JSON = "rollout_jobs.json"
ROLLOUT_SUBMITIT_DIR = "rollout_jobs/submitit"
# What a rollout job may set differently from the run (its engine on its own GPUs). Sampling and lengths come
# from the trainer with every request, the model from the run.
ENGINE_KEYS = ("engine", "tensor_parallel", "gpu_memory_utilization", "kv_cache_bytes", "enforce_eager", "dtype",
               "host", "port")
REMOVE_WAIT_S = DRAIN_S + 60
PROBE_TIMEOUT_S = 3.0


# --------------------------------------------------------------------------- what runs on a rollout job's nodes


class RolloutJobTask:
    """The callable submitit runs on every node of a rollout job (picklable): this node's servers for the run."""

    def __init__(self, run_dir: str | Path, first_index: int, servers_per_node: int, overrides: list[str],
                 role: str = "rollout"):
        self.run_dir, self.first_index = str(run_dir), int(first_index)
        self.servers_per_node, self.overrides = int(servers_per_node), list(overrides)
        self.role = role  # rollout, or a service's role (teacher, judge)

    def __call__(self) -> int:
        from ..launch import serve_servers

        env = submitit.JobEnvironment()
        setup_logging(rank=0)
        run = RunDir(Path(self.run_dir))
        cfg = config.load(run.job_yaml, self.overrides)
        if run.done_file.exists():
            log.info("run %s has finished; this rollout job has nothing to serve", run.name)
            return 0
        prepare_node_env(cfg)
        first = self.first_index + env.node * self.servers_per_node
        entries = [(self.role, k) for k in range(first, first + self.servers_per_node)]
        rc = serve_servers(run, cfg, env.node, entries, self.overrides)
        if rc != 0:
            raise ClusterError(f"rollout job node {env.node} of run {run.name}: a server failed (exit code {rc}); "
                               f"see RUN/logs/{self.role}-{first}.log")
        return rc

    def checkpoint(self, *args, **kwargs):
        """Preemption or time limit: drain this node's servers, then requeue (slurm.requeue) to join again."""
        from ..launch import drain_servers

        drain_servers(DRAIN_S + 5)
        run = RunDir(Path(self.run_dir))
        if run.done_file.exists() or not config.load(run.job_yaml, self.overrides).slurm.requeue:
            return None  # submitit then ends the job without requeueing it
        return submitit.helpers.DelayedSubmission(
            RolloutJobTask(self.run_dir, self.first_index, self.servers_per_node, self.overrides, self.role))

    def __repr__(self) -> str:
        return f"RolloutJobTask({self.run_dir!r}, first_index={self.first_index}, role={self.role!r})"


# --------------------------------------------------------------------------- the run's record of its rollout jobs


def read_jobs(run: RunDir) -> list[dict]:
    """RUN/rollout_jobs.json: every rollout job submitted for the run, oldest first."""
    data = read_json(run.root / ROLLOUT_JOBS_JSON) or {}
    jobs = data.get("jobs")
    return [j for j in jobs if isinstance(j, dict)] if isinstance(jobs, list) else []


def _jobs_locked(run: RunDir):
    """Two `rollout add` at once must not take the same indexes."""
    return file_lock(run.root / (ROLLOUT_JOBS_JSON + ".lock"))


def own_servers(cfg: JobConfig, role: str) -> int:
    """How many servers of `role` the run's own job has."""
    if role == "rollout":
        return cfg.rollout_servers if cfg.rollout.servers_per_node else 0
    return cfg.services.roles()[role].servers


def next_first_index(run: RunDir, cfg: JobConfig, role: str = "rollout") -> int:
    """The first index of a new rollout job of `role`: after the run's own servers of that role and every earlier
    rollout job's."""
    ends = [int(j["first_index"]) + int(j["servers"]) for j in read_jobs(run) if j.get("role", "rollout") == role]
    return max([own_servers(cfg, role), *ends])


def split_overrides(overrides: list[str]) -> list[str]:
    """Check `rollout add` overrides: rollout.<engine key> and slurm.*; ConfigError naming anything else."""
    for o in overrides:
        key = o.split("=", 1)[0].strip()
        if "=" not in o:
            raise ConfigError(f"{o!r}: an override is KEY=VALUE, e.g. slurm.partition=preempt")
        section, _, name = key.partition(".")
        if section == "slurm" or (section == "rollout" and name in ENGINE_KEYS):
            continue
        raise ConfigError(f"{key}: a rollout job sets only its engine (rollout.{', rollout.'.join(ENGINE_KEYS)}) "
                          "and its Slurm options (slurm.*); the rest comes from the run's job.yaml")
    return [o for o in overrides if o.startswith("rollout.")]


def rollout_job_params(cfg: JobConfig, run_dir: str | Path, nodes: int, overrides: list[str]) -> dict:
    """submitit parameters of a rollout job: `nodes` nodes with a rollout node's GPUs, on slurm.rollout_partition
    (else slurm.partition) unless the overrides name slurm.partition or slurm.gpus_per_node themselves."""
    s = cfg.slurm
    named = {o.split("=", 1)[0].strip() for o in overrides}
    partition = s.partition if "slurm.partition" in named else (s.rollout_partition or s.partition)
    gpus = s.gpus_per_node if "slurm.gpus_per_node" in named or s.rollout_gpus_per_node is None \
        else s.rollout_gpus_per_node
    job = dataclasses.replace(cfg, name=f"{cfg.name}-rollout",
                              trainer=dataclasses.replace(cfg.trainer, nodes=nodes),
                              rollout=dataclasses.replace(cfg.rollout, nodes=0),
                              reward=dataclasses.replace(cfg.reward, nodes=0),
                              slurm=dataclasses.replace(s, partition=partition, gpus_per_node=gpus,
                                                        array_parallelism=None))
    return executor_params(job, run_dir, clear_rendezvous=False)  # the run's servers keep their addresses


def render_rollout_job(cfg: JobConfig, run_dir: str | Path, nodes: int, overrides: list[str]) -> str:
    """The sbatch script of a rollout job (what --dry-run prints; submitit writes the same one)."""
    from submitit.slurm.slurm import _make_sbatch_string

    folder = Path(run_dir) / ROLLOUT_SUBMITIT_DIR
    return _make_sbatch_string(command=submitit_command(folder), folder=folder,
                               **rollout_job_params(cfg, run_dir, nodes, overrides))


# --------------------------------------------------------------------------- add


def add_rollout_job(target: str, nodes: int = 1, servers_per_node: int | None = None,
                    overrides: list[str] | None = None, dry_run: bool = False, runs_dir: str = "runs",
                    role: str = "rollout") -> int:
    """`hpc-rl rollout add RUN [--role teacher|judge]`: submit a rollout job for the run (or print its sbatch
    script); prints its id. A service's job (--role) serves services.ROLE's model, as the run's own servers do."""
    overrides = list(overrides or [])
    engine = split_overrides(overrides)
    run = find(target, runs_dir)
    cfg = config.load(run.job_yaml, overrides)
    if nodes < 1:
        raise ConfigError(f"--nodes: {nodes}; a rollout job has at least 1 node")
    if role != "rollout":
        svc = cfg.services.roles().get(role)
        if svc is None or not svc.path:
            raise ConfigError(f"--role {role}: run {run.name} has no services.{role} served by the run"
                              f"{' (its judge is an endpoint: services.judge.url)' if svc is not None else ''}; "
                              "a service's servers serve the job's services section")
        if engine:
            raise ConfigError(f"{engine[0].split('=', 1)[0]}: a {role} job serves services.{role} as the job sets "
                              "it; give only slurm.* overrides")
    default_spn = cfg.rollout.servers_per_node if role == "rollout" else cfg.services.roles()[role].servers_per_node
    spn = servers_per_node if servers_per_node is not None else max(1, default_spn)
    if spn < 1:
        raise ConfigError(f"--servers-per-node: {spn}; give 1 or more")
    if run.done_file.exists() and not dry_run:
        raise ClusterError(f"run {run.name} has finished (RUN/rendezvous/done.json); a rollout job would have "
                           "nothing to serve")
    what = "rollout" if role == "rollout" else role
    if dry_run:
        first = next_first_index(run, cfg, role)
        print(render_rollout_job(cfg, run.root, nodes, overrides), end="")
        print(f"# dry run: nothing submitted; {nodes} node(s) x {spn} {what} server(s), indexes {first}.."
              f"{first + nodes * spn - 1} of run {run.name}")
        if run.done_file.exists():
            print(f"# note: run {run.name} has finished (RUN/rendezvous/done.json): submitting this would be refused, "
                  "a rollout job would have nothing to serve")
        return 0
    slurmq.need_sbatch("add rollout jobs", "--dry-run prints the script")
    with _jobs_locked(run):
        first = next_first_index(run, cfg, role)
        job = slurmq.submit(run.root / ROLLOUT_SUBMITIT_DIR, rollout_job_params(cfg, run.root, nodes, overrides),
                            lambda ex: ex.submit(RolloutJobTask(run.root, first, spn, engine, role)), "the rollout job",
                            "slurm.partition/account/qos/time/gpus_per_node against `sinfo`")
        jobs = read_jobs(run)
        jobs.append({"job_id": str(job.job_id), "role": role, "first_index": first, "servers": nodes * spn,
                     "nodes": nodes, "servers_per_node": spn, "overrides": overrides, "submitted_at": time.time()})
        write_json_atomic(run.root / ROLLOUT_JOBS_JSON, {"jobs": jobs})
    print(f"submitted rollout job {job.job_id} for run {run.name}: {nodes} node(s) x {spn} {what} server(s), indexes "
          f"{first}..{first + nodes * spn - 1}")
    print(f"they join at the trainer's next {'weight push' if role == 'rollout' else 'request to the ' + role}; see "
          f"them with: hpc-rl rollout list {run.name}")
    return 0


# --------------------------------------------------------------------------- list


def _probe(session: requests.Session, url: str) -> tuple[dict | None, dict | None, str]:
    """(/health, /metrics, error) of one server, with the run's token."""
    try:
        h = session.get(url + "/health", timeout=PROBE_TIMEOUT_S)
        if h.status_code != 200:
            return None, None, f"HTTP {h.status_code}"
        m = session.get(url + "/metrics", timeout=PROBE_TIMEOUT_S)
        return h.json(), (m.json() if m.status_code == 200 else None), ""
    except (requests.RequestException, ValueError) as e:
        return None, None, type(e).__name__


def _job_state(job_id: str, cache: dict) -> str | None:
    if job_id not in cache:
        cache[job_id] = slurmq.job_state(job_id)
    return cache[job_id]


def rollout_servers(run: RunDir) -> list[dict]:
    """Every server of the run, registered or still to come: role, index, job, node, url, state, version, tokens."""
    cfg = config.load(run.job_yaml)
    roles = ["rollout"] + [r for r, svc in cfg.services.roles().items() if svc.path]
    return [dict(row, role=role) for role in roles for row in _servers_of(run, cfg, role)]


def _servers_of(run: RunDir, cfg: JobConfig, role: str) -> list[dict]:
    own_job = str((read_json(run.root / SLURM_JSON) or {}).get("job_id") or "local")
    jobs = [j for j in read_jobs(run) if j.get("role", "rollout") == role]
    job_of = {k: j for j in jobs for k in range(int(j["first_index"]), int(j["first_index"]) + int(j["servers"]))}
    own_count = own_servers(cfg, role)
    regs = {}
    for f in sorted(run.rendezvous.glob(f"{role}-*.json")) if run.rendezvous.is_dir() else []:
        info = read_json(f)
        if registration_problem(info, f) is None:
            regs[int(info.get("index", f.stem.split("-")[-1]))] = info
    session = auth_session(run.read_token())
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(regs)))) as pool:
        probes = dict(zip(regs, pool.map(lambda i: _probe(session, regs[i]["url"]), regs)))
    states: dict = {}
    rows = []
    for idx, info in regs.items():
        health, metrics, err = probes[idx]
        own = idx < own_count
        # A registration of neither the run's job nor one of its rollout jobs: not written by hpc-rl for this run.
        job = info.get("slurm_job_id") or (job_of[idx]["job_id"] if idx in job_of else own_job if own else "?")
        rows.append({"index": idx, "job_id": str(job), "rollout_job": idx in job_of, "node": info.get("hostname"),
                     "url": info["url"], "state": health.get("state", "serving") if health else f"not answering ({err})",
                     "policy_version": (health or {}).get("policy_version"),
                     "tokens": (metrics or {}).get("generated_tokens"),
                     "tokens_per_s": (metrics or {}).get("last_batch_tokens_per_s")})
    for j in jobs:  # servers of rollout jobs that have not registered (yet, or any more)
        st = _job_state(str(j["job_id"]), states)
        for idx in range(int(j["first_index"]), int(j["first_index"]) + int(j["servers"])):
            if idx in regs:
                continue
            if st == "PENDING":
                what = "pending (queued)"
            elif st is not None and st not in slurmq.TERMINAL:
                what = "starting" if not j.get("removed") else "draining"
            else:
                what = f"gone ({st or 'ended'})"
            rows.append({"index": idx, "job_id": str(j["job_id"]), "rollout_job": True,
                         "node": slurmq.job_nodes(str(j["job_id"])) if what == "starting" else None, "url": None,
                         "state": what, "policy_version": None, "tokens": None, "tokens_per_s": None})
    if own_count:
        missing = "gone (the run finished)" if run.done_file.exists() else "not registered"
        for idx in range(own_count):
            if idx not in regs:
                rows.append({"index": idx, "job_id": own_job, "rollout_job": False, "node": None, "url": None,
                             "state": missing, "policy_version": None, "tokens": None, "tokens_per_s": None})
    return sorted(rows, key=lambda r: r["index"])


def list_rollout_servers(target: str, as_json: bool = False, runs_dir: str = "runs") -> int:
    """`hpc-rl rollout list RUN [--json]`."""
    run = find(target, runs_dir)
    rows = rollout_servers(run)
    if as_json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"run {run.name} has no rollout servers (add some: hpc-rl rollout add {run.name})")
        return 0
    table = [["ROLE", "INDEX", "JOB", "NODE", "ADDRESS", "STATE", "VERSION", "TOKENS", "TOK/S"]]
    for r in rows:
        job = r["job_id"] + ("" if r["rollout_job"] or r["job_id"] == "?" else " (run)")
        table.append([r["role"], str(r["index"]), job, r["node"] or "-",
                      r["url"] or "-", r["state"], "-" if r["policy_version"] is None else str(r["policy_version"]),
                      "-" if r["tokens"] is None else str(r["tokens"]),
                      "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.1f}"])
    widths = [max(len(t[c]) for t in table) for c in range(len(table[0]))]
    for t in table:
        print("  ".join(v.ljust(w) for v, w in zip(t, widths)).rstrip())
    return 0


def active_jobs(run: RunDir) -> list[dict]:
    """The run's rollout jobs Slurm still runs or queues."""
    out = []
    for j in read_jobs(run):
        st = slurmq.job_state(str(j["job_id"]))
        if st is not None and st not in slurmq.TERMINAL:
            out.append({**j, "state": st})
    return out


# --------------------------------------------------------------------------- remove


def remove_rollout_job(target: str, job_id: str, runs_dir: str = "runs") -> int:
    """`hpc-rl rollout remove RUN JOBID`: drain the job's servers (SIGTERM), then wait for the job to end
    (scancel if it does not within REMOVE_WAIT_S)."""
    run = find(target, runs_dir)
    jobs = read_jobs(run)
    job = next((j for j in jobs if str(j["job_id"]) == str(job_id)), None)
    if job is None:
        known = ", ".join(str(j["job_id"]) for j in jobs) or "none"
        raise ConfigError(f"JOBID: {job_id} is not a rollout job of run {run.name} (its rollout jobs: {known}); "
                          f"the run's own job ends with `hpc-rl cancel {run.name}`")
    state = slurmq.job_state(str(job_id))
    if state is None or state in slurmq.TERMINAL:
        print(f"rollout job {job_id} of run {run.name} already ended ({state or 'unknown to Slurm'})")
        return 0
    with _jobs_locked(run):
        jobs = read_jobs(run)
        for j in jobs:
            if str(j["job_id"]) == str(job_id):
                j["removed"] = time.time()
        write_json_atomic(run.root / ROLLOUT_JOBS_JSON, {"jobs": jobs})
    if state == "PENDING":
        ok, msg = slurmq.scancel(str(job_id))
    else:
        # SIGTERM to the job's steps only: each server drains and exits, then its node's task ends the job cleanly.
        p = subprocess.run(["scancel", "--signal=TERM", str(job_id)], capture_output=True, text=True, timeout=60)
        ok, msg = p.returncode == 0, (p.stderr or p.stdout).strip()
    if not ok:
        raise ClusterError(f"scancel {job_id} failed ({msg}); check that the job is yours (`squeue -j {job_id}`)")
    print(f"rollout job {job_id}: draining its servers (the trainer sends their work elsewhere)")
    deadline = time.monotonic() + REMOVE_WAIT_S
    while time.monotonic() < deadline:
        state = slurmq.job_state(str(job_id))
        if state is None or state in slurmq.TERMINAL:
            print(f"removed rollout job {job_id} from run {run.name} ({state or 'gone from the queue'})")
            return 0
        time.sleep(1.0)
    slurmq.scancel(str(job_id))
    print(f"rollout job {job_id} did not end within {REMOVE_WAIT_S:.0f}s of draining; cancelled it")
    return 0


def rollout_cli(args: list[str], nodes: int = 1, servers_per_node: int | None = None, dry_run: bool = False,
                as_json: bool = False, runs_dir: str = "runs", role: str = "rollout") -> int:
    """Dispatch `hpc-rl rollout add|list|remove ...`."""
    action, rest = (args[0], args[1:]) if args else ("", [])
    if action == "add" and rest:
        return add_rollout_job(rest[0], nodes, servers_per_node, rest[1:], dry_run, runs_dir, role)
    if action == "list" and len(rest) == 1:
        return list_rollout_servers(rest[0], as_json, runs_dir)
    if action == "remove" and len(rest) == 2:
        return remove_rollout_job(rest[0], rest[1], runs_dir)
    raise ConfigError("hpc-rl rollout: use `rollout add RUN [--role teacher|judge] [--nodes N] [--servers-per-node S] [rollout.*=V "
                      "slurm.*=V]`, `rollout list RUN [--json]` or `rollout remove RUN JOBID`")
