"""The trainer side's view of a run's servers (rollout or reward): who is registered in RUN/rendezvous/, who answers
with the run's token, who joined, left or came back, and the waits for them. Requests go through routing.py."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import requests

from ...errors import RolloutError
from ...logs import tail_lines
from ...netutil import auth_session, error_of
from ...rundir import RunDir, read_json

log = logging.getLogger("hpc_rl")

HEALTH_TIMEOUT_S = 5.0
# A server out of rotation that still does not answer /health (hung, or its node gone) is probed again only after
# this wait, doubling up to the second value: each probe of a hung server costs the step HEALTH_TIMEOUT_S.
REPROBE_S = (10.0, 120.0)
# While waiting for servers: a progress line this often.
WAIT_LOG_S = 30.0


@dataclass
class Server:
    index: int
    url: str
    session: requests.Session = field(repr=False)
    healthy: bool = True
    last_error: str = ""
    reprobe_at: float = 0.0  # (monotonic) no rejoin probe before this; see REPROBE_S
    reprobe_wait: float = 0.0
    # Answered with this run's token at least once (a health probe or a request). Only such servers count in the
    # chunking, so a registration that never answers (a dead address, another run's server) changes no sample.
    verified: bool = False
    tokens_per_s: float = 0.0  # measured generation throughput (EWMA over its generate requests; 0: none yet)


def registration_problem(info, path) -> str | None:
    """Why a rendezvous file is not a usable server registration (one line), or None."""
    if info is None:
        return "it does not parse as JSON"
    if not isinstance(info, dict):
        return "it is not a JSON object"
    url = info.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")) or url.count(":") < 2:
        return f"its url {url!r} is not http(s)://host:port"
    index = info.get("index", path.stem.split("-")[-1])
    if isinstance(index, bool) or not (isinstance(index, int) or (isinstance(index, str) and index.isdigit())):
        return f"its index {index!r} is not a non-negative integer"
    return None


def _back(srv: Server) -> None:
    """A server answers again: it takes work, and a later failure starts its re-probe backoff from the start."""
    srv.healthy, srv.reprobe_at, srv.reprobe_wait = True, 0.0, 0.0


class ServerPool:
    """The servers of one kind ("rollout", or "reward": the reward nodes' servers) of a run, as its rendezvous
    folder and their /health answers say."""

    def __init__(self, run: RunDir, token: str, kind: str = "rollout"):
        self.run, self.token, self.kind = run, token, kind
        self.servers: dict[int, Server] = {}
        self._ignored: dict[str, float] = {}  # rendezvous file -> mtime it was warned about
        self._events: list[str] = []  # joins and leaves since membership_events() last took them
        self.pushed_version: int | None = None
        self.expected: int | None = None  # the job's own servers, once wait_ready knows them
        # (its first node, its nodes, servers per node: JobConfig.server_layout): names a missing server's node in errors.
        self.layout: tuple[int, int, int] | None = None
        self.refresh()

    def _session(self) -> requests.Session:
        return auth_session(self.token)

    def refresh(self) -> None:
        """(Re)read RUN/rendezvous/rollout-K.json; a server that restarted on a new port gets a new entry."""
        d = self.run.rendezvous
        seen = set()
        for f in sorted(d.glob(f"{self.kind}-*.json")) if d.is_dir() else []:
            info = read_json(f)
            why = registration_problem(info, f)
            if why is not None:
                self._ignore(f, why)
                continue
            idx = int(info.get("index", f.stem.split("-")[-1]))
            seen.add(idx)
            old = self.servers.get(idx)
            if old is None or old.url != info["url"]:
                if old is not None:
                    old.session.close()
                # A server that (re)starts after a weight push serves stale weights, and one beyond the job's own
                # (a rollout job's, or a forged file) has not shown it holds the token: either gets no work until
                # _rejoin (at the next push, which brings it to the current weights) finds it answering.
                # A restart (a known index at a new address) keeps its place in the chunking.
                own = self.expected is None or idx < self.expected
                self.servers[idx] = Server(idx, info["url"], self._session(),
                                           healthy=self.pushed_version is None and own,
                                           verified=old is not None and old.verified)
        for srv in self.servers.values():
            # A leaving server deregisters before it drains: it gets no new work (nor a place in a weight push).
            if srv.healthy and srv.verified and srv.index not in seen and d.is_dir():
                self.mark_dead(srv, "deregistered: it is draining (its job ended, was removed or preempted)",
                                failed=False)

    def _ignore(self, path, why: str) -> None:
        """Warn once per version of a rendezvous file that is not a registration; it is skipped."""
        try:
            mtime = path.stat().st_mtime
        except OSError:
            return
        if self._ignored.get(str(path)) != mtime:
            self._ignored[str(path)] = mtime
            log.warning("ignoring %s: %s (a %s server writes it once it serves)", path, why, self.kind)

    def answered(self, srv: Server, announce: bool = True) -> None:
        """srv answered with this run's token: it takes work from now on (a join is announced, except at start)."""
        if not srv.verified:
            srv.verified = True
            if announce:
                self._events.append(f"{self.kind} server {srv.index} at {srv.url} joined")
        elif not srv.healthy:
            self._events.append(f"{self.kind} server {srv.index} at {srv.url} is back")
        _back(srv)

    def membership_events(self) -> list[str]:
        """Joins, returns and leaves of servers since the last call (for the step's log)."""
        out, self._events = self._events, []
        return out

    def live_count(self) -> int:
        """Servers taking work now."""
        return sum(1 for s in self.servers.values() if s.healthy)

    def server_throughputs(self) -> dict[int, float]:
        """Each live server's measured generation throughput (tokens/s; 0: not measured yet)."""
        return {s.index: s.tokens_per_s for s in self.servers.values() if s.healthy}

    def elastic(self) -> bool:
        """A server beyond the job's own (a rollout job's) has joined: work is then spread by throughput."""
        return self.expected is not None and any(s.verified and s.index >= self.expected for s in self.servers.values())

    def wait_for_servers(self, timeout_s: float) -> bool:
        """With no server taking work: wait up to timeout_s for a registered one to answer /health with this run's
        token (a progress line every WAIT_LOG_S); True when one does. Before the first push it takes work at once
        (it holds the initial weights); after, the next weight push brings it in (_rejoin)."""
        deadline = time.monotonic() + timeout_s
        t0 = next_log = time.monotonic()
        while True:
            self.refresh()
            found = []
            for s in self.servers.values():
                if self.health(s) is not None:
                    s.reprobe_at, s.reprobe_wait = 0.0, 0.0
                    found.append(s)
            if found:
                if self.pushed_version is None:
                    for s in found:
                        self.answered(s)
                log.info("%s server(s) %s answer; the run goes on", self.kind, ", ".join(s.url for s in found))
                return True
            now = time.monotonic()
            if now >= deadline:
                return False
            if now >= next_log:
                log.info("waiting for %s servers: none answers (%s); %.0fs of %.0fs (rollout.wait_for_servers_s); "
                         "add one with `hpc-rl rollout add %s`", self.kind,
                         "; ".join(f"{s.url}: {s.last_error}" for s in self.servers.values()) or "none registered",
                         now - t0, timeout_s, self.run.name)
                next_log = now + WAIT_LOG_S
            time.sleep(min(2.0, max(0.0, deadline - now)))

    def health(self, srv: Server) -> dict | None:
        try:
            r = srv.session.get(srv.url + "/health", timeout=HEALTH_TIMEOUT_S)
        except requests.RequestException as e:
            srv.last_error = f"{type(e).__name__}: {str(e)[:160]}"
            return None
        if r.status_code != 200:
            srv.last_error = f"HTTP {r.status_code}: {error_of(r)}"
            return None
        info = r.json()
        if info.get("state") == "draining":  # it is leaving: no new work
            srv.last_error = "draining"
            return None
        return info

    def wait_ready(self, expected: int, timeout_s: float) -> None:
        """Wait for `expected` rendezvous files and a healthy /health on each; RolloutError names the missing."""
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.expected = expected
        for s in self.servers.values():  # (read before the count was known) a registration beyond it must answer
            if s.index >= expected and not s.verified:
                s.healthy = False
        if expected == 0:  # none of the job's own (rollout.servers_per_node 0): see wait_for_servers
            return
        deadline = time.monotonic() + timeout_s
        ready: set[int] = set()
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), transient=True) as prog:
            task = prog.add_task(f"waiting for {self.kind} servers: 0/{expected} ready", total=expected)
            while True:
                self.refresh()
                for idx in range(expected):
                    srv = self.servers.get(idx)
                    if idx not in ready and srv is not None and self.health(srv) is not None:
                        ready.add(idx)
                        self.answered(srv, announce=False)
                prog.update(task, completed=len(ready),
                            description=f"waiting for {self.kind} servers: {len(ready)}/{expected} ready")
                if len(ready) >= expected:
                    log.info("%s servers ready: %s", self.kind, ", ".join(self.servers[i].url for i in sorted(ready)))
                    return
                self._raise_if_given_up(set(range(expected)) - ready)
                if time.monotonic() >= deadline:
                    break
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        missing = []
        for idx in range(expected):
            if idx in ready:
                continue
            srv = self.servers.get(idx)
            where = (f"at {srv.url} not healthy ({srv.last_error})" if srv
                     else f"wrote no {self.run.rollout_file(idx, self.kind).name}")
            tail = " | ".join(tail_lines(self.run.logs / f"{self.kind}-{idx}.log", 5))
            missing.append(f"server {idx} ({self._node_of(idx, srv)}) {where}" + (f"; log tail: {tail}" if tail else ""))
        raise RolloutError(f"{self.kind} servers not ready after {timeout_s:.0f}s: {'; '.join(missing)}. Usual causes: "
                           f"the server crashed (see RUN/logs/{self.kind}-K.log), it is bound to 127.0.0.1 "
                           "(set rollout.host: 0.0.0.0), a firewall blocks the port, or startup needs more "
                           "time (raise rollout.startup_timeout_s)")

    def _raise_if_given_up(self, waiting: set[int]) -> None:
        """A server its launcher gave up on (rendezvous/failed-rollout-K.json) will not come: stop waiting."""
        for idx in sorted(waiting):
            failed = read_json(self.run.server_failure_file(idx, self.kind))
            if failed:
                raise RolloutError(str(failed.get("message") or f"{self.kind} server {idx} failed: {failed}"))

    def _node_of(self, idx: int, srv) -> str:
        """Which node runs server `idx`: its hostname once published, else its place in the job layout."""
        info = read_json(self.run.rollout_file(idx, self.kind)) or {}
        if info.get("hostname"):
            return f"node {info['hostname']}"
        if self.layout is None:
            return "node unknown"
        first_node, nodes, per_node = self.layout
        if nodes == 0:
            return "on the first trainer node"
        return f"node index {first_node + idx // per_node} of the job"

    def healthy(self) -> list[Server]:
        live = [s for s in self.servers.values() if s.healthy]
        if live:
            return sorted(live, key=lambda s: s.index)
        # Every server failed at some point: re-probe; one serving stale weights stays out.
        self.refresh()
        for s in self.servers.values():
            h = self.health(s)
            if h is not None and (self.pushed_version is None or h.get("policy_version") == self.pushed_version):
                self.answered(s)
        return sorted((s for s in self.servers.values() if s.healthy), key=lambda s: s.index)

    def rejoin(self) -> None:
        """Servers restarted (or back) since they dropped out join this push, which gives them the current
        weights; a push that fails for one takes it out again."""
        self.refresh()
        now = time.monotonic()
        for s in self.servers.values():
            if s.healthy or now < s.reprobe_at:
                continue
            if self.health(s) is None:
                if not s.verified and s.reprobe_wait == 0.0:  # once: the backoff then keeps it quiet
                    log.warning("%s server %d at %s is registered but does not answer /health with this run's "
                                "token (%s); it gets no work until it does", self.kind, s.index, s.url, s.last_error)
                s.reprobe_wait = min(REPROBE_S[1], max(REPROBE_S[0], 2 * s.reprobe_wait))
                s.reprobe_at = now + s.reprobe_wait
                continue
            log.info("%s server %d at %s answers; it %s%s", self.kind, s.index, s.url,
                     "rejoins" if s.verified else "joins", " with this weight push" if self.pushed_version is not None
                     else "")
            self.answered(s)

    def mark_dead(self, srv: Server, cause: str, failed: bool = True) -> None:
        if srv.healthy:
            log.log(logging.WARNING if failed else logging.INFO, "%s server %d at %s %s (%s); routing its work to "
                    "the other servers", self.kind, srv.index, srv.url, "failed" if failed else "left", cause)
            self._events.append(f"{self.kind} server {srv.index} at {srv.url} left ({cause})")
        srv.healthy = False
        srv.last_error = cause

    def drop_dead(self, servers: list[Server]) -> bool:
        """Mark servers that no longer answer /health as dead; True when there was one."""
        dead = False
        for srv in servers:
            if self.health(srv) is None:
                self.mark_dead(srv, srv.last_error or "no answer to /health")
                dead = True
        return dead

