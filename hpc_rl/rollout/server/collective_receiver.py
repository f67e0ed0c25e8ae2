"""Collective weight sync, the rollout server's side: the /collective/{info,join,update,status,close} routes.

An engine with `collective_join/collective_receive/collective_close` (VLLMEngine: its workers join) is used as
is; any other engine gets a `LocalCollective` (this process joins, then `engine.load_weights`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from ...errors import first_line
from ..wire.collective import CollectiveError, dtype_name, gpu_uuid, join_group, leave_group, receive_buckets

log = logging.getLogger("hpc_rl")


def check_plan(plan: Any, specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> list:
    """Validate an announced plan against an engine's param specs; CollectiveError naming the first mismatch."""
    if not isinstance(plan, list) or not plan:
        raise CollectiveError("weight sync: plan must be a non-empty list of buckets")
    for b in plan:
        if not isinstance(b, dict) or not isinstance(getattr(torch, str(b.get("dtype")), None), torch.dtype):
            raise CollectiveError(f"weight sync: bucket {str(b)[:80]} has no valid dtype")
        for item in b.get("items", []):
            name, shape = item
            spec = specs.get(name)
            if spec is None:
                raise CollectiveError(f"weight sync: tensor {name!r} is not a parameter of the served model; "
                                      "send the actor's HF state_dict names")
            if tuple(shape) != tuple(spec[0]):
                raise CollectiveError(f"weight sync: tensor {name!r} has shape {list(shape)} but the served model "
                                      f"expects {list(spec[0])}")
    return plan


class LocalCollective:
    """Receive in this process and hand each bucket to `engine.load_weights` (engines without workers)."""

    def __init__(self, engine, device: str = "cpu"):
        self.engine, self.device, self.pg = engine, device, None

    def collective_workers(self) -> int:
        return 1

    def param_specs(self):
        return self.engine.param_specs()

    def collective_join(self, master_addr, master_port, world_size, rank, backend, timeout_s) -> None:
        self.pg = join_group(master_addr, master_port, world_size, rank, backend, timeout_s, device=self.device)

    def collective_receive(self, version: int, plan: list) -> float:
        t0 = time.perf_counter()
        for named in receive_buckets(self.pg, plan, version, self.device):
            self.engine.load_weights(named)
        self.engine.reset_cache()
        return time.perf_counter() - t0

    def collective_close(self) -> None:
        leave_group(self.pg)
        self.pg = None


class _ReceiverState:
    """What the routes share: the join/receive threads' outcome, guarded by one lock."""

    def __init__(self, target):
        self.target = target
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # notified whenever a join/update ends
        self.joined = False
        self.error: str | None = None
        self.busy = False
        self.version: int | None = None
        self.seconds: float | None = None

    def run(self, fn, on_ok) -> None:
        def body():
            try:
                res = fn()
                with self.lock:
                    on_ok(res)
            except Exception as e:
                log.error("weight sync failed: %s", e)
                with self.lock:
                    self.error = first_line(e)
            finally:
                with self.lock:
                    self.busy = False
                    self.changed.notify_all()

        with self.lock:
            self.busy, self.error = True, None
        threading.Thread(target=body, name="hpc-rl-weight-sync", daemon=True).start()

    def _snap(self) -> dict:
        return {"joined": self.joined, "busy": self.busy, "error": self.error, "version": self.version,
                "seconds": self.seconds}

    def snapshot(self) -> dict:
        with self.lock:
            return self._snap()

    def wait_version(self, version: int, timeout_s: float) -> dict:
        """Block until `version` is loaded, an error is reported, or timeout_s passes; the status then."""
        with self.changed:
            self.changed.wait_for(lambda: self.error is not None or (self.version == version and not self.busy),
                                  timeout=timeout_s)
            return self._snap()


def start_collective_receive(target, rs: _ReceiverState, master_addr: str, master_port: int, world_size: int,
                             rank: int, specs: dict | None = None, backend: str = "gloo",
                             timeout_s: float = 600.0) -> None:
    """Begin joining the weight-sync group in the background (the sender joins concurrently as rank 0).

    `specs` ({name: shape}) is what the sender will push; checked against the engine before joining.
    """
    if specs:
        check_plan([{"dtype": "float32", "items": [[n, list(s)] for n, s in specs.items()]}], target.param_specs())

    def ok(_):
        rs.joined = True

    rs.run(lambda: target.collective_join(master_addr, int(master_port), int(world_size), int(rank), backend,
                                          float(timeout_s)), ok)


def _need(d: dict, key: str):
    if key not in d:
        raise CollectiveError(f"weight sync: {key}: missing from the request body")
    return d[key]


def register_server_routes(service) -> None:
    """Add /collective/{info,join,update,status,close} to the rollout server (server.RolloutService).

    The server checks the token and size limits and maps CollectiveError to a one-line 400. join and
    update answer at once; the work runs in a thread and GET /collective/status reports
    {joined, busy, error, version, seconds}. An update loads inside `service.loading_weights()` (no
    generation sees half-updated weights) and sets the policy version before generations resume.
    """
    engine = service.engine
    target = engine if hasattr(engine, "collective_join") else LocalCollective(engine, device=_engine_device(engine))
    rs = _ReceiverState(target)

    def body_of(body) -> dict:
        if not isinstance(body, dict):
            raise CollectiveError("weight sync: body: expected a JSON object")
        return body

    def info(_body) -> dict:
        specs = target.param_specs()
        dtypes = sorted({dtype_name(d) for _, d in specs.values()})
        return {"workers": target.collective_workers(), "dtype": dtypes[0] if len(dtypes) == 1 else None,
                "device": _engine_device(engine), "gpu_uuid": _in_process_gpu(engine)}

    def join(body) -> dict:
        d = body_of(body)
        args = (str(_need(d, "master_addr")), int(_need(d, "master_port")), int(_need(d, "world_size")),
                int(_need(d, "rank")))
        with rs.lock:
            if rs.busy:
                raise CollectiveError("weight sync: a join or update is already running")
        if rs.joined:  # a new sender (e.g. a restarted trainer): leave the old group first
            target.collective_close()
            rs.joined = False
        log.info("weight sync: joining the group at %s:%d as rank %d of %d", args[0], args[1], args[3], args[2])
        start_collective_receive(target, rs, *args, d.get("specs"), str(d.get("backend", "gloo")),
                                 float(d.get("timeout_s", 600.0)))
        return {"ok": True}

    def update(body) -> dict:
        d = body_of(body)
        version, plan = int(_need(d, "version")), _need(d, "plan")
        check_plan(plan, engine.param_specs())
        with rs.lock:
            if not rs.joined:
                raise CollectiveError("weight sync: this server has not joined a group; POST /collective/join first")
            if rs.busy:
                raise CollectiveError("weight sync: a join or update is already running")

        def receive() -> float:
            # Running generations finish first; none starts until the new weights and version are in.
            with service.loading_weights():
                secs = target.collective_receive(version, plan)
                service.loaded(version)
            service.count("weight_updates")
            log.info("weights: policy_version %d loaded over the collective in %.3fs", version, secs)
            return secs

        def ok(secs):
            rs.version, rs.seconds = version, secs

        rs.run(receive, ok)
        return {"ok": True}

    def close(_body) -> dict:
        target.collective_close()
        with rs.lock:
            rs.joined = False
        return {"ok": True}

    service.add_route("GET", "/collective/info", info)
    service.add_route("POST", "/collective/join", join)
    service.add_route("POST", "/collective/update", update)
    def wait(body) -> dict:
        d = body_of(body)
        # Bounded: one HTTP request never hangs longer than this; the sender asks again until its deadline.
        return rs.wait_version(int(_need(d, "version")), min(float(d.get("timeout_s", 30.0)), 30.0))

    service.add_route("GET", "/collective/status", lambda _b: rs.snapshot())
    service.add_route("POST", "/collective/wait", wait)
    service.add_route("POST", "/collective/close", close)


def _in_process_gpu(engine) -> str | None:
    """The UUID of the GPU an engine computing in this process uses (HF: a torch.device); None for vLLM, whose GPUs
    are its workers' (asking torch here would open a CUDA context in the API server)."""
    dev = getattr(engine, "device", None)
    return gpu_uuid(dev) if isinstance(dev, torch.device) else None


def _engine_device(engine) -> str:
    dev = getattr(engine, "device", "cpu")
    return str(dev) if dev else "cpu"
