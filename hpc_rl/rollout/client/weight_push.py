"""Pushing a policy version to the servers: the transport rollout.weight_sync names (auto: the collective where every
server offers it on the trainer's device kind, else HTTP), chosen once and again when the setting changes; a
collective push that fails because a server died sends that version over HTTP to the living ones, and the next push
forms a new group without the dead one."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import requests

from ...errors import RolloutError
from .pool import HEALTH_TIMEOUT_S, Server, ServerPool
from .routing import Router
from .transports import Transport
from .transports.collective import CollectiveTransport
from .transports.file import FileTransport
from .transports.http import HttpTransport

log = logging.getLogger("hpc_rl")


def collective_info(srv: Server) -> dict | None:
    """The server's /collective/info (its device), or None when it offers no collective."""
    try:
        r = srv.session.get(srv.url + "/collective/info", timeout=HEALTH_TIMEOUT_S)
    except requests.RequestException:
        return None
    return r.json() if r.status_code == 200 else None


def trainer_gpu_uuid() -> str | None:
    """The UUID of the GPU this process (rank 0, which pushes) computes on."""
    import torch

    from ..wire.collective import gpu_uuid

    return gpu_uuid(f"cuda:{torch.cuda.current_device()}") if torch.cuda.is_available() else None


def collective_problems(infos: list[tuple[str, dict | None]], kind: str, trainer_gpu: str | None) -> list[str]:
    """Why the collective cannot reach these servers ((url, /collective/info or None) each) from a trainer on `kind`
    ("cpu"/"cuda") whose GPU is `trainer_gpu`; [] when it can."""
    problems = []
    for url, info in infos:
        if info is None:
            problems.append(f"{url} does not offer /collective")
            continue
        their = "cuda" if str(info.get("device", "cpu")).startswith("cuda") else "cpu"
        if their != kind:
            problems.append(f"{url} serves on {their} but the trainer runs on {kind}")
        elif trainer_gpu is not None and info.get("gpu_uuid") == trainer_gpu:
            problems.append(f"{url} serves on the trainer's own GPU ({trainer_gpu}), and NCCL does not join two "
                            "processes on one GPU")
    return problems


class WeightPush:
    """rollout.weight_sync's transport over the pool's healthy servers; `push` returns {"seconds", "bytes",
    "transport"}."""

    def __init__(self, pool: ServerPool, router: Router, weight_sync: str = "auto", trainer_device: str = "cpu"):
        self.pool, self.weight_sync = pool, weight_sync
        # "cpu" or "cuda": the collective's backend (gloo/NCCL) and where rank 0 stages each bucket.
        self.trainer_device = trainer_device
        self.transports: dict[str, Transport] = {
            "http": HttpTransport(router), "file": FileTransport(router),
            "collective": CollectiveTransport(pool.token, trainer_device, router.timeout_s)}
        self._chosen: tuple[str, str] | None = None  # (weight_sync, what it resolved to on the first push)

    def push(self, named_tensors: Iterable, version: int) -> dict:
        pool = self.pool
        pool.rejoin()
        servers = pool.healthy()
        if not servers:
            raise RolloutError(f"push_weights v{version}: no healthy rollout server; check RUN/logs/rollout-K.log")
        if self._chosen is None or self._chosen[0] != self.weight_sync:
            pool.drop_dead(servers)  # a server that is already gone must not decide the transport
            servers = pool.healthy()
            if not servers:
                raise RolloutError(f"push_weights v{version}: no healthy rollout server; check RUN/logs/rollout-K.log")
            self._chosen = (self.weight_sync, self._resolve(servers))
        name = self._chosen[1]
        if name != "collective":
            self.transports["collective"].close()
        t0 = time.perf_counter()
        if name == "collective":
            named = list(named_tensors)
            try:
                nbytes = self.transports["collective"].push(named, version, servers)
            except RolloutError as e:
                if not pool.drop_dead(servers):
                    raise  # every server is up: the error is real (wrong names, shapes, a timeout)
                # A server died mid-run: its group is broken. This version goes over HTTP to the living
                # servers; the next push forms a new group without the dead one.
                log.warning("push_weights v%d: collective failed (%s); sending this version over http", version, e)
                self.transports["collective"].close()
                name = "http"
                live = pool.healthy()
                if not live:  # the only server(s) died: no pool of 0 workers, a RolloutError the trainer handles
                    raise RolloutError(f"push_weights v{version}: no healthy rollout server left ({e}); check "
                                       "RUN/logs/rollout-K.log") from None
                nbytes = self.transports["http"].push(named, version, live)
        else:
            nbytes = self.transports[name].push(named_tensors, version, servers)
        pool.pushed_version = version
        dt = time.perf_counter() - t0
        log.debug("push_weights v%d: %d bytes over %s in %.2fs", version, nbytes, name, dt)
        return {"seconds": dt, "bytes": nbytes, "transport": name}

    def _resolve(self, servers: list[Server]) -> str:
        """weight_sync, with "auto" -> collective when every server offers it on the trainer's device kind."""
        if self.weight_sync in ("http", "file"):
            return self.weight_sync
        kind = "cuda" if str(self.trainer_device).startswith("cuda") else "cpu"
        mine = trainer_gpu_uuid() if kind == "cuda" else None
        problems = collective_problems([(srv.url, collective_info(srv)) for srv in servers], kind, mine)
        if not problems:
            log.info("weight sync: collective (%s) to %d server(s)", "nccl" if kind == "cuda" else "gloo",
                     len(servers))
            return "collective"
        if self.weight_sync == "collective":
            raise RolloutError(f"rollout.weight_sync: collective is not possible ({'; '.join(problems)}); set "
                               "rollout.weight_sync to auto, http or file")
        log.info("weight sync: http (rollout.weight_sync=auto; %s)", "; ".join(problems))
        return "http"

    def close(self) -> None:
        for t in self.transports.values():
            t.close()
