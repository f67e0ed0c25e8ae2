"""Collective weight sync: trainer rank 0 broadcasts the actor's tensors to every rollout worker.

A group made for weight sync only (gloo on CPU, NCCL on GPU), built directly from a TCPStore hosted by
the sender, so it lives beside the trainer's own torch.distributed world (init_process_group/new_group
cannot span separate jobs). Rank 0 is the sender; each server's workers take ranks
`base_rank + tp_rank`. Per update, the sender POSTs the bucket plan to every server (which starts its
receive and answers at once), broadcasts a header then one flat buffer per bucket, and polls until
every server has loaded the version.

Server side: `register_server_routes(service)` adds the /collective/* endpoints to the rollout server. An engine
with `collective_join/collective_receive/collective_close` (VLLMEngine: its workers join) is used as is;
any other engine gets a `LocalCollective` (this process joins, then `engine.load_weights`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch

from ..errors import RolloutError, first_line
from ..netutil import advertise_host, free_port

log = logging.getLogger("hpc_rl")

# About this many bytes per broadcast; one tensor never splits (a bucket may be one large tensor).
BUCKET_BYTES = 64 * 1024 * 1024
STORE_PREFIX = "hpc_rl_weight_sync"


class CollectiveError(RolloutError):
    """The weight-sync group could not be formed or a broadcast failed."""


# --------------------------------------------------------------------------- plan + wire


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make_plan(specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]], bucket_bytes: int = BUCKET_BYTES) -> list:
    """Buckets of one dtype each, in the given order: [{"dtype": "bfloat16", "items": [[name, shape], ...]}]."""
    plan: list[dict] = []
    cur: dict[str, dict] = {}  # dtype -> open bucket
    size: dict[str, int] = {}
    for name, shape, dtype in specs:
        dn = dtype_name(dtype)
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        if dn in cur and size[dn] + nbytes > bucket_bytes:
            plan.append(cur.pop(dn))
        if dn not in cur:
            cur[dn], size[dn] = {"dtype": dn, "items": []}, 0
        cur[dn]["items"].append([name, [int(s) for s in shape]])
        size[dn] += nbytes
    plan.extend(cur.values())
    return plan


def plan_hash(plan: list) -> int:
    """63-bit digest of the plan, sent in the header so both sides agree on the layout."""
    return int.from_bytes(hashlib.sha256(json.dumps(plan).encode()).digest()[:8], "big") >> 1


def plan_bytes(plan: list) -> int:
    total = 0
    for b in plan:
        es = torch.empty((), dtype=getattr(torch, b["dtype"])).element_size()
        total += sum(int(torch.Size(s).numel()) for _, s in b["items"]) * es
    return total


def _bcast(pg, tensor: torch.Tensor):
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return pg.broadcast([tensor], opts)


class SyncGroup:
    """A backend process group plus its TCPStore (kept alive: on rank 0 it is the store's server)."""

    def __init__(self, pg, store):
        self.pg, self.store = pg, store

    def broadcast(self, tensors, opts):
        return self.pg.broadcast(tensors, opts)

    def allreduce(self, tensors, opts):
        return self.pg.allreduce(tensors, opts)

    def shutdown(self) -> None:
        shut = getattr(self.pg, "shutdown", None)
        if callable(shut):
            shut()
        self.pg = self.store = None


def _shutdown(pg) -> None:
    """Leave a weight-sync process group; a group already broken by a dead peer is simply dropped."""
    if pg is not None:
        try:
            pg.shutdown()
        except Exception:
            pass


def join_group(master_addr: str, master_port: int, world_size: int, rank: int, backend: str,
               timeout_s: float, device: str = "cpu"):
    """Join the weight-sync group (rank 0 hosts the TCPStore); returns the backend ProcessGroup."""
    from torch.distributed import PrefixStore, TCPStore

    timeout = timedelta(seconds=timeout_s)
    try:
        store = TCPStore(master_addr, master_port, world_size, rank == 0, timeout=timeout,
                         wait_for_workers=False)
    except Exception as e:  # RuntimeError / DistStoreError: refused, timed out, address in use
        raise CollectiveError(f"weight sync: rank {rank} could not reach the store at {master_addr}:{master_port} "
                              f"within {timeout_s:.0f}s ({first_line(e)}); check that the trainer's "
                              "address is reachable from the rollout nodes") from None
    prefix = PrefixStore(STORE_PREFIX, store)
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        pg = ProcessGroupGloo(prefix, rank, world_size, timeout)
    elif backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        torch.cuda.set_device(torch.device(device))
        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = ProcessGroupNCCL(prefix, rank, world_size, opts)
    else:
        raise CollectiveError(f"weight sync: backend {backend!r} is not supported; use gloo (CPU) or nccl (GPU)")
    pg = SyncGroup(pg, store)
    # A first collective proves every rank is in before anyone relies on the group.
    probe = torch.ones(1, device=device)
    opts_ar = torch.distributed.AllreduceOptions()
    pg.allreduce([probe], opts_ar).wait(timeout)
    if int(probe.item()) != world_size:
        raise CollectiveError(f"weight sync: the group's first all-reduce saw {int(probe.item())} of {world_size} ranks")
    return pg


def receive_buckets(pg, plan: list, version: int, device: str = "cpu") -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Receive the header, then each bucket of `plan`, yielding its (name, tensor) views (one bucket ahead)."""
    hdr = torch.zeros(3, dtype=torch.int64, device=device)
    _bcast(pg, hdr).wait()
    got = [int(x) for x in hdr.tolist()]
    want = [int(version), len(plan), plan_hash(plan)]
    if got != want:
        raise CollectiveError(f"weight sync: header {got} does not match the announced update {want} "
                              "(version, buckets, plan digest); the sender and this server disagree")

    def post(b):
        n = sum(int(torch.Size(s).numel()) for _, s in b["items"])
        buf = torch.empty(n, dtype=getattr(torch, b["dtype"]), device=device)
        return buf, _bcast(pg, buf)

    pending = post(plan[0]) if plan else None
    for i, b in enumerate(plan):
        buf, work = pending
        work.wait()
        # Post the next receive before loading this bucket: the network and the copy overlap.
        pending = post(plan[i + 1]) if i + 1 < len(plan) else None
        out, off = [], 0
        for name, shape in b["items"]:
            n = int(torch.Size(shape).numel())
            out.append((name, buf[off:off + n].view(shape)))
            off += n
        yield out


def broadcast_buckets(pg, plan: list, tensors: dict[str, torch.Tensor], version: int, device: str = "cpu") -> None:
    """Rank 0: send the header, then each bucket flattened into one buffer (the next one built meanwhile)."""
    try:
        hdr = torch.tensor([int(version), len(plan), plan_hash(plan)], dtype=torch.int64, device=device)
        _bcast(pg, hdr).wait()
        prev = None
        for b in plan:
            dt = getattr(torch, b["dtype"])
            buf = torch.cat([tensors[name].detach().to(device=device, dtype=dt).reshape(-1)
                             for name, _ in b["items"]])
            work = _bcast(pg, buf)
            if prev is not None:
                prev[1].wait()
            prev = (buf, work)
        if prev is not None:
            prev[1].wait()
    except RuntimeError as e:  # gloo/NCCL: a peer left (it logs why) or the group timed out
        raise CollectiveError(f"weight sync: broadcast of version {version} failed "
                              f"({first_line(e)}); see the rollout server's log") from None


# --------------------------------------------------------------------------- server side


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
        _shutdown(self.pg)
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
    {joined, busy, error, version, seconds}. An update loads while holding `service.engine_lock` (no
    generation sees half-updated weights) and sets the policy version under the same lock.
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
                "device": _engine_device(engine)}

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
            with service.engine_lock:
                secs = target.collective_receive(version, plan)
                service.policy_version = version
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


def _engine_device(engine) -> str:
    dev = getattr(engine, "device", "cpu")
    return str(dev) if dev else "cpu"


# --------------------------------------------------------------------------- trainer side


class CollectiveSender:
    """Trainer rank 0: `connect()` once, `broadcast(named_tensors, version)` per update, `close()`."""

    def __init__(self, servers: list[str], token: str, backend: str = "auto", master_addr: str | None = None,
                 master_port: int = 0, bucket_bytes: int = BUCKET_BYTES, timeout_s: float = 600.0,
                 device: str = "cpu"):
        self.servers = [s.rstrip("/") for s in servers]
        self.token, self.bucket_bytes, self.timeout_s = token, bucket_bytes, timeout_s
        self.device = device
        self.backend = ("nccl" if str(device).startswith("cuda") else "gloo") if backend == "auto" else backend
        self.master_addr = master_addr
        self.master_port = master_port
        self.pg = None
        self.wire_dtype: list[str | None] = []
        self.last_seconds: dict[str, float] = {}
        self._session = None
        self.last_bytes = 0

    # ---- HTTP helpers
    def _req(self, method: str, url: str, body: dict | None = None, timeout_s: float | None = None) -> dict:
        """One authorized request; a server that does not answer within timeout_s (default: the sender's
        timeout, i.e. rollout.request_timeout_s) is an error, so a hung server cannot stall the trainer."""
        import requests

        if self._session is None:
            self._session = requests.Session()
            self._session.trust_env = False  # never route cluster-internal traffic through a user's proxy
            self._session.headers["Authorization"] = f"Bearer {self.token}"
        try:
            r = self._session.request(method, url, json=body,
                                      timeout=self.timeout_s if timeout_s is None else timeout_s)
        except requests.RequestException as e:
            raise CollectiveError(f"weight sync: {url} unreachable ({type(e).__name__}); is the rollout server up?") from None
        if r.status_code != 200:
            try:
                detail = r.json().get("error", r.text)
            except ValueError:
                detail = r.text
            raise CollectiveError(f"weight sync: {url} answered {r.status_code}: {str(detail)[:300]}")
        return r.json()

    def _wait_all(self, what: str, done) -> list[dict]:
        """Poll /collective/status on every server until done(status) for all; raise on a reported error."""
        deadline = time.monotonic() + self.timeout_s
        pending = list(self.servers)
        results: dict[str, dict] = {}
        delay = 0.005
        while pending:
            for s in list(pending):
                st = self._req("GET", f"{s}/collective/status")
                if st.get("error"):
                    raise CollectiveError(f"weight sync: {s} failed to {what}: {st['error']}")
                if done(st):
                    results[s] = st
                    pending.remove(s)
            if pending:
                if time.monotonic() > deadline:
                    raise CollectiveError(f"weight sync: timed out after {self.timeout_s:.0f}s waiting for "
                                          f"{', '.join(pending)} to {what}")
                time.sleep(delay)
                delay = min(delay * 2, 0.2)
        return [results[s] for s in self.servers]

    def _wait_loaded(self, version: int) -> list[dict]:
        """Long-poll POST /collective/wait on each server until it has loaded `version` (no polling delay)."""
        deadline = time.monotonic() + self.timeout_s
        out = []
        for s in self.servers:
            while True:
                left = deadline - time.monotonic()
                wait = max(0.0, min(left, 30.0))
                # The server holds a long poll for `wait` seconds: give the HTTP request that much more.
                st = self._req("POST", f"{s}/collective/wait", {"version": version, "timeout_s": wait},
                               timeout_s=wait + min(self.timeout_s, 30.0))
                if st.get("error"):
                    raise CollectiveError(f"weight sync: {s} failed to load weights version {version}: {st['error']}")
                if st.get("version") == version and not st.get("busy"):
                    out.append(st)
                    break
                if time.monotonic() >= deadline:
                    raise CollectiveError(f"weight sync: timed out after {self.timeout_s:.0f}s waiting for {s} to "
                                          f"load weights version {version}")
        return out

    def connect(self, specs: dict | None = None) -> None:
        """Ask each server to join, join as rank 0, and wait until every server reports joined."""
        infos = [self._req("GET", f"{s}/collective/info") for s in self.servers]
        self.wire_dtype = [i.get("dtype") for i in infos]
        world = 1 + sum(int(i["workers"]) for i in infos)
        addr = self.master_addr or advertise_host()
        port = self.master_port or free_port(addr)
        self.master_addr, self.master_port = addr, port
        base = 1
        body_specs = None
        if specs:
            body_specs = {n: list(s[0]) for n, s in specs.items()}
        for s, i in zip(self.servers, infos):
            self._req("POST", f"{s}/collective/join", {
                "master_addr": addr, "master_port": port, "world_size": world, "rank": base,
                "backend": self.backend, "timeout_s": self.timeout_s, "specs": body_specs})
            base += int(i["workers"])
        t0 = time.perf_counter()
        self.pg = join_group(addr, port, world, 0, self.backend, self.timeout_s, device=self.device)
        self._wait_all("join the weight-sync group", lambda st: st.get("joined"))
        log.debug("weight sync: group of %d ranks at %s:%d (%s) formed in %.2fs", world, addr, port,
                  self.backend, time.perf_counter() - t0)

    def broadcast(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> float:
        """Push one version to every server in buckets; returns seconds until all of them loaded it."""
        if self.pg is None:
            raise CollectiveError("weight sync: broadcast before connect(); call CollectiveSender.connect() first")
        t0 = time.perf_counter()
        named = list(named_tensors)
        # Send what the servers store (e.g. bf16): half the bytes of an fp32 trainer copy.
        wd = {d for d in self.wire_dtype}
        wire = getattr(torch, wd.pop()) if len(wd) == 1 and None not in wd else None
        specs = [(n, tuple(t.shape), wire if (wire is not None and t.is_floating_point()) else t.dtype)
                 for n, t in named]
        plan = make_plan(specs, self.bucket_bytes)
        for s in self.servers:
            self._req("POST", f"{s}/collective/update", {"version": int(version), "plan": plan})
        try:
            broadcast_buckets(self.pg, plan, dict(named), version, device=self.device)
        except CollectiveError:
            # A server that failed says why in its status; that beats the transport's message.
            for s in self.servers:
                st = self._req("GET", f"{s}/collective/status")
                if st.get("error"):
                    raise CollectiveError(f"weight sync: {s} failed to load version {version}: {st['error']}") from None
            raise
        sts = self._wait_loaded(int(version))
        self.last_seconds = {s: st.get("seconds") for s, st in zip(self.servers, sts)}
        self.last_bytes = plan_bytes(plan)
        return time.perf_counter() - t0

    def close(self) -> None:
        """Leave the group, then tell the servers to leave it too.

        Leaving first: a server still waiting in a receive (an update that failed elsewhere) sees the
        connection drop and gives up at once instead of holding its engine until the group times out.
        """
        _shutdown(self.pg)
        self.pg = None
        for s in self.servers:
            try:
                self._req("POST", f"{s}/collective/close", {})
            except CollectiveError as e:
                log.debug("%s", e)
        if self._session is not None:
            self._session.close()
            self._session = None
