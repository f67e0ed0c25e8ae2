"""verifiers environments run as they are: `rollout.env: verifiers:ID` (with `rollout.env_kwargs`, the environment
config's fields) and `data.source: verifiers:ID` (its taskset's tasks as the prompts).

An installed verifiers (0.4, `verifiers.v1`) environment plays each episode the way `vf-eval` does: its harness
program talks to verifiers' interception server, which sends every model call to the episode's base URL on the
run's agent front (agent_front.py). The front records the engine's tokens, so the samples are what the engines
generated; the environment's rewards (its task's `@reward`s and judges) give the episode's reward, and its metrics
become `agent/NAME`. To hpc-rl an episode is an agent's (agents.py): the same concurrency, timeout, failure and
evaluation rules.

What does not work on an offline Slurm node, refused with one line at load:
- runtimes other than `subprocess` (docker, prime, modal, e2b: a daemon or a remote sandbox with a tunnel); hpc-rl
  sets every seat's runtime to subprocess, so the harness programs run on the rank-0 node as the run's user;
- harnesses that install a third-party program in a container (NEEDS_CONTAINER: claude_code, codex, ...);
- verifiers prepares a harness program's environment with `uv`, downloading its declared dependencies. A compute
  node cannot; hpc-rl runs those programs with the run's own Python instead, whose environment has every dependency
  the bundled programs declare (the envs extra installs verifiers with them), and refuses one that does not.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import sys
from pathlib import Path

from ..data.verifiers_tasks import check_id, import_verifiers
from ..errors import ConfigError, first_line

KEY_VAR = "HPC_RL_AGENT_API_KEY"  # the harness subprocesses never see it (verifiers drops *API_KEY* variables)
_PREPARED: set[Path] = set()  # harness programs written and found runnable by this Python


def _script_requirements(script: bytes) -> list[str]:
    """The `dependencies` of a PEP 723 script's metadata block."""
    block = re.search(rb"^# /// script\s*$(.*?)^# ///\s*$", script, re.S | re.M)
    if block is None:
        return []
    meta = "\n".join(line[2:] if line.startswith("# ") else line.lstrip("#")
                     for line in block.group(1).decode().splitlines())
    import tomllib

    return list(tomllib.loads(meta).get("dependencies", []))


def missing_requirements(script: bytes) -> list[str]:
    """The requirements of a harness program that this Python's environment does not satisfy."""
    from packaging.requirements import Requirement

    missing = []
    for spec in _script_requirements(script):
        req = Requirement(spec)
        try:
            have = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(spec)
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            missing.append(f"{spec} (installed: {have})")
    return missing


async def _prepare_with_this_python(self, script, env=None, *, activate: bool = True) -> list[str]:
    """Runtime.prepare_uv_script for the subprocess runtime: the program runs with this Python (see the module's
    docstring) instead of an environment uv downloads."""
    data = script.encode() if isinstance(script, str) else script
    path = Path(self.scripts_dir) / "hpc-rl" / f"{hashlib.sha256(data).hexdigest()}.py"
    if path not in _PREPARED:  # every episode prepares its harness: checked and written once per program
        missing = missing_requirements(data)
        if missing:
            raise RuntimeError(f"a harness program needs {', '.join(missing)}, which this Python's environment lacks; "
                               "install them into the run's venv (compute nodes cannot download them)")
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
        _PREPARED.add(path)
    return [sys.executable, str(path)]


class VerifiersEnv:
    """One verifiers environment: its tasks as prompt rows, and its episodes as an hpc-rl agent (awaited per episode
    with the episode's client and dataset row, inside `serving`). `env_kwargs` are the environment config's fields
    (rollout.env_kwargs: its agent seats, timeouts, ...); `taskset_kwargs` its taskset's (data.kwargs)."""

    def __init__(self, spec: str, env_kwargs: dict | None = None, taskset_kwargs: dict | None = None,
                 key: str = "rollout.env"):
        import_verifiers(key)
        from pydantic import ValidationError
        from verifiers.v1.configs.agent import agent_config_fields
        from verifiers.v1.configs.env import EnvConfig
        from verifiers.v1.env import Env
        from verifiers.v1.runtimes.subprocess import SubprocessRuntime
        from verifiers.v1.utils.generic import concrete_type
        from verifiers.v1.utils.loaders import environment_class

        self.spec, self.id = spec, check_id(spec, key)
        kwargs = dict(env_kwargs or {})
        if "taskset" in kwargs:
            raise ConfigError("rollout.env_kwargs.taskset: the taskset's config is data.kwargs (the tasks are the "
                              "run's prompts); move it there")
        try:
            env_cls = environment_class(self.id)
            cfg_cls = concrete_type(env_cls, EnvConfig, origin=Env) or EnvConfig
            data = {**kwargs, "taskset": {**dict(taskset_kwargs or {}), "id": self.id}}
            for seat in agent_config_fields(cfg_cls.model_validate(data)):
                given = dict(data.get(seat) or {})
                runtime = (given.get("runtime") or {}).get("type", "subprocess")
                if runtime != "subprocess":
                    raise ConfigError(f"rollout.env_kwargs.{seat}.runtime.type: {runtime!r} needs a container daemon "
                                      "or a remote sandbox, which a Slurm node does not have; remove it (hpc-rl runs "
                                      "the harness in the subprocess runtime)")
                data[seat] = {**given, "runtime": {"type": "subprocess"}}
            self.env = env_cls(cfg_cls.model_validate(data))
        except ConfigError:
            raise
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(map(str, err["loc"]))
            where = f"data.kwargs.{where[len('taskset.'):]}" if where.startswith("taskset.") else \
                f"rollout.env_kwargs.{where}"
            raise ConfigError(f"{where}: {err['msg']} (verifiers environment {self.id})") from None
        except Exception as e:  # noqa: BLE001 - verifiers' own loader errors name what is missing
            raise ConfigError(f"{key}: {spec}: {first_line(e)}") from None
        for seat, harness in self.env._harnesses.items():
            if harness.NEEDS_CONTAINER:
                raise ConfigError(f"rollout.env_kwargs.{seat}.harness.id: {harness.config.id!r} installs a program in "
                                  "a container, which a Slurm node does not run; use a harness that runs as a plain "
                                  "process (null, bash)")
        SubprocessRuntime.prepare_uv_script = _prepare_with_this_python
        self.task_cls = type(self.env.taskset).task_type()

    def serving(self, token: str):
        """verifiers' serving resources (its interception server, shared tools) for a step's episodes; `token` is
        the agent front's key."""
        os.environ[KEY_VAR] = token
        return self.env.serving()

    async def __call__(self, client, task: dict) -> dict:
        """One episode of the row `task`'s verifiers task against `client`'s base URL (the episode's own on the
        agent front): the reward (the mean over the episode's traces) and the traces' metrics."""
        from verifiers.v1.clients import ModelContext
        from verifiers.v1.configs.client import EvalClientConfig

        if "verifiers_task" not in task:
            raise ValueError(f"row {task.get('id')} holds no verifiers task; its source must be {self.spec}")
        data = self.task_cls.data_type().model_validate(task["verifiers_task"])
        ctx = ModelContext(model="policy", client=EvalClientConfig(base_url=str(client.base_url).rstrip("/"),
                                                                   api_key_var=KEY_VAR))
        episode = await self.env.run_episode(self.task_cls(data, self.env.taskset.config.task), ctx)
        errors = list(episode.errors) + [e for t in episode.traces for e in t.errors]
        if not episode.ok or errors:
            raise RuntimeError("the verifiers episode failed: " + (
                f"{errors[0].type}: {first_line(errors[0].message)}" if errors else "not ok"))
        metrics = {}
        for t in episode.traces:
            metrics.update({k: float(v) for k, v in t.metrics.items() if isinstance(v, (int, float))})
        return {"reward": sum(t.reward for t in episode.traces) / len(episode.traces), "metrics": metrics}
