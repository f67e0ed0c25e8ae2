"""Weight sync over a collective (NCCL on GPU, gloo on CPU), the trainer's side: rank 0 forms one group with every
server's workers and broadcasts each new version in buckets (the wire: wire/collective.py). The group lives across
pushes; a change in the set of servers forms a new one."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import requests
import torch

from ....netutil import advertise_host, auth_session, error_of
from ...wire.collective import (
    BUCKET_BYTES,
    CollectiveError,
    broadcast_buckets,
    host_store,
    join_group,
    leave_group,
    make_plan,
    plan_bytes,
)

log = logging.getLogger("hpc_rl")


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
        if self._session is None:
            self._session = auth_session(self.token)
        try:
            r = self._session.request(method, url, json=body,
                                      timeout=self.timeout_s if timeout_s is None else timeout_s)
        except requests.RequestException as e:
            raise CollectiveError(f"weight sync: {url} unreachable ({type(e).__name__}); is the rollout server up?") from None
        if r.status_code != 200:
            raise CollectiveError(f"weight sync: {url} answered {r.status_code}: {error_of(r)[:300]}")
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
        store = None if self.master_port else host_store(addr, world, self.timeout_s)
        port = self.master_port or store.port
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
        self.pg = join_group(addr, port, world, 0, self.backend, self.timeout_s, device=self.device, store=store)
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
        leave_group(self.pg)
        self.pg = None
        for s in self.servers:
            try:
                self._req("POST", f"{s}/collective/close", {})
            except CollectiveError as e:
                log.debug("%s", e)
        if self._session is not None:
            self._session.close()
            self._session = None


class CollectiveTransport:
    name = "collective"

    def __init__(self, token: str, device: str, timeout_s: float):
        self.token, self.device, self.timeout_s = token, device, timeout_s
        self.sender: CollectiveSender | None = None  # one group for the whole run, reused across pushes

    def push(self, named_tensors, version: int, servers: list) -> int:
        named = list(named_tensors)
        urls = [s.url for s in servers]
        if self.sender is not None and self.sender.servers != urls:
            self.close()  # the set of servers changed: form a new group
        if self.sender is None:
            sender = CollectiveSender(urls, self.token, device=self.device, timeout_s=self.timeout_s)
            sender.connect(specs={n: (tuple(t.shape), t.dtype) for n, t in named})
            self.sender = sender
        self.sender.broadcast(named, version)
        return self.sender.last_bytes

    def close(self) -> None:
        sender, self.sender = self.sender, None
        if sender is not None:
            sender.close()
