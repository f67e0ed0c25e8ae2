"""Starting a job's processes: the whole job on this machine (`hpc-rl run`), or one node's role inside a
Slurm job (`run_node`). Both use the same trainer-rank and rollout-server processes."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from . import config, rundir, tracking
from .config import JobConfig
from .config.resume import load_for_resume
from .data.datasets import PromptDataset, load_rows, tokenizer_corpus
from .data.sft import SFTDataset
from .data.toy import toy_chat_template
from .data.verifiers_tasks import is_verifiers
from .errors import ConfigError, HpcRlError, RolloutError
from .logs import last_error_line, setup_logging, tail_lines
from .models.loading import check_model_dir, check_same_tokenizer, load_tokenizer
from .models.lora import check_targets as check_lora_targets
from .models.sft_built import built_sft_model, is_sft_spec
from .models.sft_built import parse as parse_sft_spec
from .models.tiny import cached_tiny_model
from .models.tiny_reward import cached_tiny_reward_model
from .models.vision import VisionSpec, check_vision_job
from .nccl import nccl_env
from .netutil import advertise_host, free_port
from .orchestrator.agents import check_openai_installed, load_agent
from .orchestrator.evaluation import check_held_out
from .orchestrator.verifiers_env import VerifiersEnv
from .rewards.base import load_reward_fn
from .rewards.model import check_reward_model
from .rundir import RunDir, read_json, write_json_atomic
from .startup_clock import mark_command_start

log = logging.getLogger("hpc_rl")


# --------------------------------------------------------------------------- preparing a run dir


def prepare_run(job_path: str, overrides: list[str]) -> tuple[RunDir, JobConfig]:
    """Validate the job, create its run dir, build a tiny model if asked, write the resolved job.yaml.

    Everything a user can get wrong is checked before the run dir exists or, failing after, the dir
    is removed again: a run that never started leaves nothing behind.
    """
    cfg = config.load(job_path, overrides)
    tracking.check_installed(cfg)
    if cfg.reward.function:
        load_reward_fn(cfg.reward.function)
    if cfg.reward.monitor:
        load_reward_fn(cfg.reward.monitor, "reward.monitor")
    if is_verifiers(cfg.rollout.env):  # its harnesses and runtimes are checked before anything starts
        check_openai_installed("rollout.env")
        VerifiersEnv(cfg.rollout.env, cfg.rollout.env_kwargs, cfg.data.kwargs)
    elif cfg.rollout.env:
        load_reward_fn(cfg.rollout.env, "rollout.env")
    if cfg.rollout.agent:
        check_openai_installed()
        load_agent(cfg.rollout.agent)
    if cfg.eval.reward:
        load_reward_fn(cfg.eval.reward, "eval.reward")
    rm = cfg.reward.model
    if rm is not None and rm.path is not None:
        check_reward_model(rm)
    rows = load_rows(cfg.data, cfg.seed)
    if cfg.eval.enabled:
        load_rows(cfg.eval_data, cfg.seed, "eval")
    for key, path in [("model.path", cfg.model.path)] + [(f"services.{r}.path", s.path)
                                                         for r, s in cfg.services.roles().items()]:
        if is_sft_spec(path):
            parse_sft_spec(path, key)  # the SFT job exists: checked before the run dir is made
    if cfg.reward.judge is not None:
        check_judge(cfg, rows[0])
    run = rundir.create(cfg.output_dir, cfg.name)
    try:
        if is_sft_spec(cfg.model.path):  # the student (or policy) an SFT job makes
            cfg.model.path = str(built_sft_model(cfg.model.path, run.model_init, "model.path"))
        for role, svc in cfg.services.roles().items():
            if is_sft_spec(svc.path):
                svc.path = str(built_sft_model(svc.path, run.root / f"{role}-model", f"services.{role}.path"))
        if cfg.model.tiny is not None:
            with tracking.deepspeed_without_mlflow():  # transformers imports DeepSpeed while it builds the model
                cached_tiny_model(cfg.model.tiny, tokenizer_corpus(cfg.data, cfg.seed), run.model_init,
                                  chat_template=toy_chat_template(cfg.data.source))
            cfg.model.path = str(run.model_init)
            cfg.model.tiny = None
        else:
            cfg.model.path = str(Path(cfg.model.path).resolve()) if Path(cfg.model.path).exists() else cfg.model.path
        if rm is not None and rm.tiny is not None:
            log.info("tiny reward model of %s: Bradley-Terry on synthetic preference pairs, trained once per cache "
                     "(HPC_RL_CACHE)", rm.tiny)
            cached_tiny_reward_model(rm.tiny, tokenizer_corpus(cfg.data, cfg.seed), run.reward_model_init)
            rm.path, rm.tiny = str(run.reward_model_init), None
        elif rm is not None:
            rm.path = str(Path(rm.path).resolve())
        tokenizer = load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)
        for role, svc in cfg.services.roles().items():
            if svc.path:
                svc.path = str(check_model_dir(svc.path, f"services.{role}.path").resolve())
        if cfg.services.teacher is not None:  # it scores the policy's token ids
            check_same_tokenizer(tokenizer, cfg.model.path, cfg.services.teacher.path, "services.teacher.path")
            if cfg.algorithm.distill.top_k > len(tokenizer):
                raise ConfigError(f"algorithm.distill.top_k: {cfg.algorithm.distill.top_k} exceeds the "
                                  f"{len(tokenizer)} tokens of the teacher's tokenizer; lower it")
        if cfg.algorithm.supervised:  # every row's target and length, before anything starts
            SFTDataset(cfg.data, tokenizer, cfg.seed)
            if cfg.eval.enabled:
                SFTDataset(cfg.eval_data, tokenizer, cfg.seed, "eval")
        else:
            vision = VisionSpec.for_job(cfg, tokenizer)
            if vision is not None:
                check_vision_job(cfg)
            train = PromptDataset(cfg.data, tokenizer, cfg.seed, vision=vision)
            if cfg.eval.enabled:
                check_held_out(cfg, train, PromptDataset(cfg.eval_data, tokenizer, cfg.seed, "eval", vision=vision))
        check_lora_targets(cfg)
        for section in (cfg.data, cfg.eval):
            if section.source and section.source.endswith((".jsonl", ".json", ".parquet")):
                section.source = str(Path(section.source).resolve())
        run.job_yaml.write_text(config.dump(cfg))
    except BaseException:
        shutil.rmtree(run.root, ignore_errors=True)
        raise
    return run, cfg


def check_judge(cfg: JobConfig, row: dict) -> None:
    """reward.judge before anything starts: the template's variables against the data's first row `row`, the parser
    on a plain answer, and an endpoint's URL and key with one request."""
    from .orchestrator.judge import Endpoint
    from .rewards.judge import check_template_variables, make_parser

    check_template_variables(cfg.reward.judge.template, row)
    make_parser(cfg.reward.judge)("yes", row)
    svc = cfg.services.judge
    if svc.url:
        try:
            Endpoint(svc.url, svc.api_key_env, svc.model, cfg.rollout.request_timeout_s).check()
        except RolloutError as e:
            raise ConfigError(str(e)) from None


def clear_rendezvous(run: RunDir) -> None:
    """Forget the addresses of a previous attempt (resume, requeue): new servers publish new ones."""
    run.rendezvous.mkdir(parents=True, exist_ok=True)
    for p in run.rendezvous.glob("*.json"):
        p.unlink(missing_ok=True)


# --------------------------------------------------------------------------- processes

_PR_SET_PDEATHSIG = 1
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl  # bound here: the forked child only calls it
except (OSError, AttributeError):  # not Linux
    _prctl = None


def _die_with_parent(cpus: list[int] | None = None):
    """A preexec_fn: the child gets SIGKILL when this launcher dies (even by SIGKILL), so no rank or
    server outlives it. Children run in their own session, so killing the launcher's group alone
    would otherwise leave them behind.

    It also ignores SIGUSR1/SIGUSR2 (inherited through exec): Slurm sends its preemption warning to
    every process of a step, and its default action would kill a rollout server mid-step; trainer
    ranks install their own handler (train/main.py). With `cpus`, the child is pinned to those cores."""
    parent = os.getpid()

    def preexec() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died between fork and prctl
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec



def _base_env(cfg: JobConfig) -> dict:
    env = dict(os.environ)
    env.update({k: str(v) for k, v in cfg.env.vars.items()})
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(nccl_env(cfg))  # safe NCCL defaults for shared clusters, the same as in Slurm jobs
    return env


def cpu_threads(cfg: JobConfig, processes: int, kind: str, cpus: list[int] | None = None) -> int:
    """CPU threads for each of `processes` processes of one kind ("trainer" ranks, a "rollout" server).

    Pinned processes (`cpus`) share the cores they were given. Unpinned: synchronous steps alternate generation
    and training, so each phase may use every core this launcher has; with rollout.async_steps they run at once:
    the ranks keep every core and the server gets half (on 2 cores, 25M parameters: 4.8 s/step, against 6.6 s
    with one pinned core each and 7.4 s with two threads each; README "Fastest layout on one machine").
    """
    if cpus:
        return max(1, len(cpus) // processes)
    cores = len(os.sched_getaffinity(0))
    if kind == "rollout" and cfg.rollout.async_steps:
        cores = max(1, cores // 2)
    return max(1, cores // processes)


def start_rollout_server(run: RunDir, cfg: JobConfig, index: int, devices: list | None = None,
                         cpus: list[int] | None = None, kind: str = "rollout",
                         overrides: list[str] | None = None) -> subprocess.Popen:
    """One rollout server process (kind "reward": a reward node's reward server), pinned to `cpus` when given;
    its output goes to logs/KIND-K.log. `overrides`: a rollout job's rollout.* settings (cfg already has them)."""
    env = _base_env(cfg)
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
    env.setdefault("HPC_RL_ROLLOUT_THREADS", str(cpu_threads(cfg, 1, "rollout", cpus)))
    svc = cfg.services.roles().get(kind)  # a service's server runs its own engine (or rollout.engine)
    if ((svc.engine if svc is not None else None) or cfg.rollout.engine) == "hf":
        # OpenMP's threads otherwise spin after every parallel region, taking the cores the trainer ranks (or other
        # jobs on a shared node) need: two toy runs on 2 cores generate 4x faster (0.9 -> 0.2 s a step) and step
        # 17% faster with idle threads asleep; alone the same. vLLM's CPU worker pins its threads and is left as is.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if cpus:  # vLLM's CPU worker binds its threads to the cores it was given
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus)))
    run.logs.mkdir(parents=True, exist_ok=True)
    logf = open(run.logs / f"{kind}-{index}.log", "ab")
    cmd = [sys.executable, "-m", "hpc_rl.rollout.server", "--run-dir", str(run.root), "--index", str(index)]
    if kind != "rollout":
        cmd += ["--role", kind]
    for o in overrides or []:
        cmd += ["--set", o]
    return subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            preexec_fn=_die_with_parent(cpus))


MAX_SERVER_RESTARTS = 3


@dataclass
class ServerFailure:
    """A rollout (or reward) server this launcher gave up on."""

    index: int
    code: int | None
    node: str
    served: bool
    error: str
    kind: str = "rollout"

    def line(self) -> str:
        how = (f"was killed by {signal.Signals(-self.code).name}" if self.code is not None and self.code < 0
               and -self.code in signal.valid_signals() else f"exited with code {self.code}")
        if not self.served:
            when = "before it served (a startup failure is not retried)"
        elif self.code == 2:
            when = "with a user error (not retried)"
        else:
            when = f"after it served, out of its {MAX_SERVER_RESTARTS} restarts"
        return (f"{self.kind} server {self.index} on node {self.node} {how} {when}: {self.error} "
                f"(full log: logs/{self.kind}-{self.index}.log)")


class ServerKeeper:
    """This launcher's servers, each (kind, index): rollout servers and reward nodes' reward servers. One that
    crashes after it served is restarted on this node (at most MAX_SERVER_RESTARTS times); one that dies before
    it ever served, or exits with a user error (code 2), is given up at once: startup failures repeat, and a run
    must not wait for a server that cannot come. `procs` is updated in place, so stop_processes always sees the
    live ones."""

    def __init__(self, run: RunDir, cfg: JobConfig, indices: list[tuple[str, int]], devices: dict | None = None,
                 cpus: list[int] | None = None, overrides: list[str] | None = None):
        self.run, self.cfg = run, cfg
        self.overrides = list(overrides or [])
        self.devices = devices or {}
        self.cpus = cpus
        self.indices = list(indices)
        self.procs = [self._start(e) for e in self.indices]
        self.restarts = {e: 0 for e in self.indices}
        self.served = {e: False for e in self.indices}
        self.stopped: set = set()  # exited cleanly (asked to stop)

    def _start(self, entry: tuple) -> subprocess.Popen:
        kind, k = entry
        return start_rollout_server(self.run, self.cfg, k, self.devices.get(entry), self.cpus, kind, self.overrides)

    def _serving(self, entry: tuple, p: subprocess.Popen) -> bool:
        info = read_json(self.run.rollout_file(entry[1], entry[0]))
        return bool(info and info.get("pid") == p.pid)

    def check(self) -> ServerFailure | None:
        """Restart dead servers (from the launcher's main thread: PR_SET_PDEATHSIG follows the forking
        thread); returns the failure of one given up on."""
        if self.run.done_file.exists():
            return None
        for j, (e, p) in enumerate(zip(self.indices, self.procs)):
            kind, k = e
            code = p.poll()
            if code is None or not self.served[e]:
                self.served[e] = self.served[e] or self._serving(e, p)
            if code is None:
                continue
            node = os.uname().nodename
            # A clean exit (0, SIGTERM) was asked for (Slurm ending the job, scancel): not restarted, and
            # not a failure of the run (the others go on); a node with none left ends.
            if code in (0, -signal.SIGTERM):
                if e not in self.stopped:
                    self.stopped.add(e)
                    log.warning("%s server %d on %s stopped (%s); not restarted", kind, k, node,
                                "exit 0" if code == 0 else "SIGTERM")
                continue
            logf = self.run.logs / f"{kind}-{k}.log"
            if code == 2 or not self.served[e] or self.restarts[e] >= MAX_SERVER_RESTARTS:
                return ServerFailure(k, code, node, self.served[e], last_error_line(logf), kind)
            self.restarts[e] += 1
            log.warning("%s server %d exited with code %s on %s; restarting it (%d/%d). Last lines of "
                        "logs/%s-%d.log:\n%s", kind, k, code, node, self.restarts[e],
                        MAX_SERVER_RESTARTS, kind, k, "\n".join(tail_lines(logf, 5)))
            self.run.rollout_file(k, kind).unlink(missing_ok=True)  # the old address is gone; the new one is published
            self.procs[j] = self._start(e)
        return None


def _tee(src, path: Path, echo: bool) -> None:
    with open(path, "ab") as f:
        for line in iter(src.readline, b""):
            f.write(line)
            f.flush()
            if echo:
                sys.stdout.buffer.write(line)
                sys.stdout.flush()


def start_trainer_ranks(run: RunDir, cfg: JobConfig, node_rank: int, master_addr: str, master_port: int,
                        echo_rank0: bool = True, cpus: list[int] | None = None) -> list[subprocess.Popen]:
    """cfg.trainer.procs_per_node rank processes of this node (pinned to `cpus` when given); rank 0 is echoed
    to the console."""
    ppn = cfg.trainer.procs_per_node
    world = cfg.trainer.nodes * ppn
    procs = []
    for local in range(ppn):
        rank = node_rank * ppn + local
        env = _base_env(cfg)
        env.update({"RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(world),
                    "LOCAL_WORLD_SIZE": str(ppn), "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)})
        env.setdefault("OMP_NUM_THREADS", "1")
        if cfg.trainer.device == "cpu":  # DeepSpeed would probe for an accelerator and warn on every rank
            env.setdefault("DS_ACCELERATOR", "cpu")
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see start_rollout_server
        env.setdefault("HPC_RL_TRAINER_THREADS", str(cpu_threads(cfg, ppn, "trainer", cpus)))
        cmd = [sys.executable, "-m", "hpc_rl.loop", "--run-dir", str(run.root)]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                             preexec_fn=_die_with_parent(cpus))
        tee = threading.Thread(target=_tee, args=(p.stdout, run.logs / f"trainer-{rank}.log",
                                                  echo_rank0 and rank == 0), daemon=True)
        tee.start()
        p.hpc_rl_rank = rank  # type: ignore[attr-defined]
        p.hpc_rl_tee = tee  # type: ignore[attr-defined]
        procs.append(p)
    return procs


# This node's trainer ranks while run_node waits for them (for preempt_trainers, called by submitit's
# signal handler in the same process).
_node_trainers: list[subprocess.Popen] = []


def preempt_trainers(timeout_s: float) -> bool:
    """Ask this node's trainer ranks to checkpoint at the next step boundary and exit; True when they did.

    The signal is repeated: a rank still importing (signals ignored until its handler is set) gets a later one.
    """
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        live = [p for p in _node_trainers if p.poll() is None]
        if not live:
            return True
        for p in live:
            try:
                p.send_signal(signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(2.0)
    log.warning("trainer ranks did not stop within %.0fs of the preemption signal; the requeued job resumes "
                "from the last periodic checkpoint", timeout_s)
    return False


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM each process group, then SIGKILL what is left after `grace_s`."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                # A stopped process (SIGSTOP, a debugger) acts on SIGTERM only once continued, as a shell's kill does
                # for a stopped job; otherwise it would hold the run for the whole grace period.
                os.killpg(p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    deadline = time.time() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def _drain(trainers: list[subprocess.Popen]) -> None:
    """Let the tee threads copy the ranks' last lines (rank 0's error line is what the user sees)."""
    for p in trainers:
        tee = getattr(p, "hpc_rl_tee", None)
        if tee is not None:
            tee.join(timeout=5)


def wait_trainers(run: RunDir, trainers: list[subprocess.Popen], others: list[subprocess.Popen],
                  keeper: ServerKeeper | None = None) -> int:
    """Wait for every rank; the first one that fails stops all others at once (no hang until a timeout).
    With a keeper, dead rollout servers are restarted meanwhile."""
    try:
        return _wait_trainers(run, trainers, others, keeper)
    finally:
        _drain(trainers)


def _wait_trainers(run: RunDir, trainers: list[subprocess.Popen], others: list[subprocess.Popen],
                   keeper: ServerKeeper | None) -> int:
    while True:
        failure = keeper.check() if keeper is not None else None
        if failure is not None:
            log.error("%s; stopping the run", failure.line())
            stop_processes(trainers + others)
            return 2 if failure.code == 2 else 1
        codes = [p.poll() for p in trainers]
        failed = [(p, c) for p, c in zip(trainers, codes) if c not in (None, 0)]
        if failed:
            # A rank killed by a signal is the cause; the others then fail in their collectives.
            p, code = sorted(failed, key=lambda pc: pc[1] > 0)[0]
            rank = p.hpc_rl_rank  # type: ignore[attr-defined]
            if not (code == 2 and rank == 0):  # (a user error: rank 0 already printed it)
                how = f"exited with code {code}"
                if code < 0:
                    how = f"was killed by {signal.Signals(-code).name if -code in signal.valid_signals() else -code}"
                log.error("trainer rank %d %s on %s; stopping the job. Last lines of logs/trainer-%d.log:\n%s",
                          rank, how, os.uname().nodename, rank, "\n".join(tail_lines(run.logs / f"trainer-{rank}.log", 15)))
            stop_processes([q for q in trainers if q is not p] + others)
            return code if code > 0 else 1
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.3)


# --------------------------------------------------------------------------- hpc-rl run


def _local_cpus(cfg: JobConfig) -> tuple[list[int] | None, list[int] | None]:
    """trainer.local_cpus and rollout.local_cpus, checked against the cores this process may use."""
    usable = os.sched_getaffinity(0)
    out = []
    for key, cpus in (("trainer.local_cpus", cfg.trainer.local_cpus), ("rollout.local_cpus", cfg.rollout.local_cpus)):
        missing = sorted(set(cpus) - usable)
        if missing:
            raise ConfigError(f"{key}: core(s) {missing} are not available here (this process may use "
                              f"{sorted(usable)}); name cores from that list or leave the key empty")
        out.append(list(cpus) or None)
    if out[0] and out[1]:
        log.info("CPU pinning: trainer ranks on cores %s, rollout servers on cores %s", out[0], out[1])
    return out[0], out[1]


def run_local(run: RunDir, cfg: JobConfig) -> int:
    """The whole job on this machine: rollout server(s), then the trainer ranks; waits for the end."""
    clear_rendezvous(run)
    if isinstance(cfg.trainer.nodes, str):  # a node range (a Slurm job that got one node): its ranks resolve it
        cfg.trainer.nodes = 1
    elif cfg.trainer.nodes != 1:
        log.warning("trainer.nodes=%s: a local run uses this machine only (%d ranks)", cfg.trainer.nodes,
                    cfg.trainer.procs_per_node)
        cfg.trainer.nodes = 1
        run.job_yaml.write_text(config.dump(cfg))
    n_servers = cfg.rollout_servers
    servers: list[subprocess.Popen] = []
    trainers: list[subprocess.Popen] = []
    try:
        devs = list(cfg.rollout.local_devices)
        n_reward = cfg.reward.nodes
        # A reward model on the servers takes the GPU after each server's tensor-parallel ones; reward nodes'
        # servers (one per reward node, on this machine) take the last GPUs of rollout.local_devices.
        per = cfg.gpus_per_rollout_server
        trainer_cpus, rollout_cpus = _local_cpus(cfg)
        entries = [("rollout", k) for k in range(n_servers)] + [("reward", k) for k in range(n_reward)]
        services = cfg.services.roles()
        entries += [(role, k) for role, svc in services.items() for k in range(svc.servers)]
        devices = None
        if devs:
            devices = {("rollout", k): devs[k * per:(k + 1) * per] for k in range(n_servers)}
            devices.update({("reward", k): [devs[len(devs) - n_reward + k]] for k in range(n_reward)})
        for role, svc in services.items():
            if svc.local_devices:
                tp = svc.tensor_parallel
                devices = (devices or {}) | {(role, k): svc.local_devices[k * tp:(k + 1) * tp]
                                             for k in range(svc.servers)}
        keeper = ServerKeeper(run, cfg, entries, devices, rollout_cpus)
        servers = keeper.procs
        log.info("run dir %s: %s%s%s, %d trainer rank(s)", run.root,
                 "SFT, no rollout servers" if cfg.algorithm.supervised else f"{n_servers} rollout server(s)",
                 f", {n_reward} reward server(s)" if n_reward else "",
                 "".join(f", {svc.servers} {role} server(s)" for role, svc in services.items()), cfg.world_size)
        trainers = start_trainer_ranks(run, cfg, 0, "127.0.0.1", free_port("127.0.0.1"), cpus=trainer_cpus)
        code = wait_trainers(run, trainers, servers, keeper)
    except KeyboardInterrupt:
        stop_processes(trainers + servers)
        raise
    write_json_atomic(run.done_file, read_json(run.done_file) or {"exit_code": code, "time": time.time()})
    stop_processes(servers)
    if code == 0:
        log.info("run finished: %s", run.root)
    return code


def run_local_job(job_path: str, overrides: list[str], resume: str | None = None) -> int:
    """`hpc-rl run JOB.yaml [overrides] [--resume RUN_DIR]`."""
    mark_command_start()
    setup_logging(0)
    if resume:
        run = rundir.find(resume)
        cfg = load_for_resume(run.job_yaml, overrides)  # its size may change, its model and the like may not
        if overrides:
            run.job_yaml.write_text(config.dump(cfg))
        log.info("resuming %s", run.root)
    else:
        run, cfg = prepare_run(job_path, overrides)
    return run_local(run, cfg)


# --------------------------------------------------------------------------- one node of a Slurm job


def _wait_for(path: Path, timeout_s: float, what: str) -> dict:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        data = read_json(path)
        if data is not None:
            return data
        time.sleep(0.5)
    raise HpcRlError(f"timed out after {timeout_s:.0f}s waiting for {what} ({path}); check the first trainer "
                     "node's log (hpc-rl logs RUN --role trainer)")


def _record_attempt(run: RunDir, cfg: JobConfig) -> None:
    """attempts.json: how often Slurm requeued this job (preemption, time limit) and the trainer's size in each
    attempt (a node range may give each another); `hpc-rl status` shows both."""
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    job_id = os.environ.get("SLURM_JOB_ID")
    before = read_json(run.root / "attempts.json") or {}
    history = [a for a in before.get("history", []) if a.get("job_id") != job_id or a.get("requeues") != restarts]
    started = time.time()
    history.append({"requeues": restarts, "job_id": job_id, "trainer_nodes": cfg.trainer.nodes,
                    "trainer_ranks": cfg.world_size, "started": started})
    write_json_atomic(run.root / "attempts.json", {"requeues": restarts, "job_id": job_id, "started": started,
                                                   "history": history})
    if restarts:
        log.info("attempt %d of this job (requeued %d time(s)) on %d trainer node(s); resuming from the run's "
                 "checkpoints", restarts + 1, restarts, cfg.trainer.nodes)


def publish_master(run: RunDir) -> dict:
    """The first trainer node's rendezvous address (this node's advertised address, a free port) for the others."""
    master = {"addr": advertise_host(), "port": free_port(), "host": os.uname().nodename}
    write_json_atomic(run.master_file, master)
    return master


def job_of_attempt(run: RunDir, num_nodes: int) -> JobConfig:
    """The run's job with this attempt's trainer nodes: the job's nodes but its rollout and reward nodes (a node range
    in trainer.nodes takes what Slurm gave; a fixed count must match it)."""
    cfg = config.load(run.job_yaml)
    others = cfg.server_nodes
    try:
        cfg.resolve_trainer_nodes(num_nodes - others)
    except ConfigError:
        raise HpcRlError(f"the job has {num_nodes} nodes but trainer.nodes ({cfg.trainer.nodes}) + rollout.nodes + "
                         f"reward.nodes + services' nodes ({others}) does not match; submit with hpc-rl submit so the "
                         "node count matches the spec") from None
    return cfg


def run_node(run: RunDir, node_index: int, num_nodes: int) -> int:
    """This node's role in a Slurm job: trainer node (index < trainer.nodes) or rollout node."""
    mark_command_start()
    cfg = job_of_attempt(run, num_nodes)
    if node_index < cfg.trainer.nodes:
        if node_index == 0:
            publish_master(run)
        master = _wait_for(run.master_file, cfg.rollout.startup_timeout_s, "the first trainer node's address")
        log.info("node %d (%s): trainer ranks %d..%d, master %s:%s", node_index, os.uname().nodename,
                 node_index * cfg.trainer.procs_per_node, (node_index + 1) * cfg.trainer.procs_per_node - 1,
                 master["addr"], master["port"])
        if node_index == 0:
            _record_attempt(run, cfg)
        # The services without nodes of their own (services.ROLE.nodes 0) run beside the first trainer node's ranks.
        beside = [(role, k) for role, svc in cfg.services.roles().items() if not svc.nodes
                  for k in range(svc.servers_per_node)] if node_index == 0 else []
        keeper = ServerKeeper(run, cfg, beside, node_server_devices(cfg, beside)) if beside else None
        ranks = start_trainer_ranks(run, cfg, node_index, master["addr"], int(master["port"]))
        _node_trainers[:] = ranks
        code = wait_trainers(run, ranks, keeper.procs if keeper else [], keeper)
        if keeper is not None:
            stop_processes(keeper.procs)
        return code
    node = cfg.node_roles()[node_index]
    # A rollout or a service's node: procs servers, numbered on from the nodes of the same role before it; a reward
    # node: one reward server.
    first = node.role_index * node.procs
    return serve_servers(run, cfg, node_index, [(node.role, k) for k in range(first, first + node.procs)])


def node_server_devices(cfg: JobConfig, entries: list[tuple], environ=None) -> dict | None:
    """Each server of a GPU node its own GPUs, in order, from the node's (Slurm sets CUDA_VISIBLE_DEVICES to the
    job's GPUs; else slurm.[rollout_]gpus_per_node): a rollout server tensor_parallel of them (+ 1 for a reward
    model on the server), a reward node's server one. None on CPU nodes (nothing to split)."""
    environ = os.environ if environ is None else environ
    visible = [d for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not visible:
        s = cfg.slurm
        n = s.rollout_gpus_per_node if s.rollout_gpus_per_node is not None else s.gpus_per_node
        visible = [str(i) for i in range(n if cfg.trainer.device != "cpu" else 0)]
    if not visible:
        return None
    per = {"rollout": cfg.gpus_per_rollout_server, "reward": 1,
           **{role: svc.tensor_parallel for role, svc in cfg.services.roles().items()}}
    out, start = {}, 0
    for e in entries:
        out[e] = visible[start:start + per[e[0]]]
        start += per[e[0]]
    if start > len(visible):
        log.warning("this node has GPUs %s but its servers %s need %d; they share them", visible, entries, start)
        return None
    return out


# This node's server keeper while serve_servers runs (for drain_servers, called by submitit's signal handler of a
# rollout job in the same process).
_node_keepers: list[ServerKeeper] = []


def drain_servers(timeout_s: float) -> None:
    """Preemption of a rollout job: SIGTERM this node's servers (each answers new work with 503, deregisters and
    finishes its generations in flight) and wait for them; SIGKILL after timeout_s."""
    for keeper in _node_keepers:
        keeper.stopped.update(keeper.indices)  # asked for: not restarted, not a failure
        stop_processes(keeper.procs, grace_s=timeout_s)


def serve_servers(run: RunDir, cfg: JobConfig, node_index: int, entries: list[tuple],
                overrides: list[str] | None = None) -> int:
    """A rollout or reward node (of the run's job, or of a rollout job with its rollout.* `overrides`): keep its
    servers up until the run is done; a server given up on ends the job."""
    keeper = ServerKeeper(run, cfg, entries, node_server_devices(cfg, entries), overrides=overrides)
    _node_keepers[:] = [keeper]
    servers = keeper.procs
    log.info("node %d (%s): %s", node_index, os.uname().nodename, ", ".join(f"{kind} server {k}" for kind, k in entries))
    try:
        while True:
            if run.done_file.exists():
                stop_processes(servers)
                return 0
            failure = keeper.check()
            if failure is not None:
                # A non-zero exit ends the whole Slurm step (--kill-on-bad-exit); the trainer's client, on
                # another node, also reads this file and stops with the same line.
                line = failure.line()
                write_json_atomic(run.server_failure_file(failure.index, failure.kind),
                                  {**asdict(failure), "message": line})
                log.error("%s; stopping the job", line)
                stop_processes(servers)
                return failure.code if failure.code and failure.code > 0 else 1
            if len(keeper.stopped) == len(servers):
                log.info("server(s) on this node stopped; node done")
                return 0
            time.sleep(1.0)
    finally:
        stop_processes(servers)
