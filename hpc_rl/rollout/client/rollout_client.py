"""RolloutClient: trainer rank 0's view of the rollout servers (discovery, generation, weight push)."""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import requests

from ...errors import PolicyNotFiniteError, RolloutError
from ...logs import tail_lines
from ...netutil import auth_session, error_of
from ...rundir import RunDir, read_json
from ..wire import protocol
from ..wire.sampling import SampleOut, SamplingParams

log = logging.getLogger("hpc_rl")

HEALTH_TIMEOUT_S = 5.0
# A server out of rotation that still does not answer /health (hung, or its node gone) is probed again only after
# this wait, doubling up to the second value: each probe of a hung server costs the step HEALTH_TIMEOUT_S.
REPROBE_S = (10.0, 120.0)
# Weight of the newest measurement in a server's throughput estimate (tokens/s of its generate requests).
THROUGHPUT_EWMA = 0.5
# While waiting for servers: a progress line this often.
WAIT_LOG_S = 30.0


@dataclass
class GenerateResult:
    outputs: list[list[SampleOut]]
    policy_versions: list[int]
    tokens_per_s: float
    seconds: float
    server_tokens: dict = field(default_factory=dict)  # server index -> tokens it generated for this call


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


def split_contiguous(n_items: int, n_chunks: int) -> list[tuple[int, int]]:
    """[start, end) ranges of near-equal contiguous chunks (no empty chunk)."""
    n_chunks = max(1, min(n_chunks, n_items))
    base, extra = divmod(n_items, n_chunks)
    out, start = [], 0
    for i in range(n_chunks):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def split_weighted(n_items: int, weights: list[float]) -> list[tuple[int, int]]:
    """[start, end) contiguous chunks, one per weight, sized in proportion (largest remainder), none empty when
    n_items >= len(weights); equal weights give split_contiguous's chunks."""
    n = len(weights)
    if n == 0 or n_items < n or min(weights) <= 0:
        return split_contiguous(n_items, n)
    total = sum(weights)
    exact = [n_items * w / total for w in weights]
    sizes = [max(1, int(x)) for x in exact]
    # Hand out (or take back) what rounding left, by the largest remainder (ties: the earlier chunk).
    order = sorted(range(n), key=lambda i: (-(exact[i] - int(exact[i])), i))
    k = 0
    while sum(sizes) < n_items:
        sizes[order[k % n]] += 1
        k += 1
    for i in sorted(range(n), key=lambda i: (sizes[i] - exact[i], i), reverse=True):
        while sum(sizes) > n_items and sizes[i] > 1:
            sizes[i] -= 1
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size))
        start += size
    return out


def _back(srv: Server) -> None:
    """A server answers again: it takes work, and a later failure starts its re-probe backoff from the start."""
    srv.healthy, srv.reprobe_at, srv.reprobe_wait = True, 0.0, 0.0


def _not_finite(r: requests.Response) -> int | None:
    """The policy version of a server's 'policy not finite' answer (-1 when it names none), else None."""
    if r.status_code != 422:
        return None
    try:
        body = r.json()
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("error_kind") != protocol.NOT_FINITE_KIND:
        return None
    v = body.get("policy_version")
    return v if isinstance(v, int) and not isinstance(v, bool) else -1


class _HTTPFailure(Exception):
    """A request that may succeed elsewhere (connection error, timeout, 5xx)."""


class _Busy(Exception):
    """429: the server holds as many requests as it takes; another server, or the same one shortly, will take it."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


def bounded(ranges: list[tuple[int, int]], per_item: int, max_samples: int) -> tuple[list[tuple[int, int]], list[int]]:
    """`ranges` cut so that no piece asks for more than max_samples samples (items x per_item); with the position
    of the range each piece comes from (the server it is meant for)."""
    step = max(1, max_samples // max(1, per_item))
    pieces, owners = [], []
    for k, (a, b) in enumerate(ranges):
        for start in range(a, b, step):
            pieces.append((start, min(b, start + step)))
            owners.append(k)
    return pieces, owners


class RolloutClient:
    """Talks to every rollout server of a run; see the module doc of hpc_rl.rollout for the API."""

    def __init__(self, run: RunDir, token: str, timeout_s: float = 300.0, retries: int = 2,
                 weight_sync: str = "auto", trainer_device: str = "cpu", kind: str = "rollout",
                 max_samples: int = 1024):
        self.run = run
        self.max_samples = max_samples  # per request (rollout.max_samples_per_request): larger work is split
        self.kind = kind  # "rollout", or "reward": the reward servers of reward nodes (scoring only)
        self.token = token
        self.timeout_s = timeout_s
        self.retries = retries
        self.weight_sync = weight_sync
        # "cpu" or "cuda": the collective's backend (gloo/NCCL) and where rank 0 stages each bucket.
        self.trainer_device = trainer_device
        self._transport: tuple[str, str] | None = None  # (weight_sync, what it resolved to on the first push)
        self._sender = None  # CollectiveSender: one group for the whole run, reused across pushes
        self.servers: dict[int, Server] = {}
        self._ignored: dict[str, float] = {}  # rendezvous file -> mtime it was warned about
        self._events: list[str] = []  # joins and leaves since membership_events() last took them
        self._served_tokens: dict[int, int] = {}  # server index -> generated tokens since take_server_tokens()
        self.pushed_version: int | None = None
        self.expected: int | None = None  # the job's own servers, once wait_ready knows them
        # (trainer.nodes, rollout.nodes, rollout.servers_per_node): names a missing server's node in errors.
        self.layout: tuple[int, int, int] | None = None
        self.refresh()

    @classmethod
    def from_run_dir(cls, run: RunDir, cfg, kind: str = "rollout") -> RolloutClient:
        """A client for the run's servers of `kind`, with timeouts/retries/weight transport from cfg.rollout."""
        r = cfg.rollout
        dev = cfg.trainer.device
        if dev == "auto":
            import torch

            dev = "cuda" if torch.cuda.is_available() else "cpu"
        client = cls(run, run.read_token(), timeout_s=r.request_timeout_s, retries=r.retries,
                     weight_sync=r.weight_sync, trainer_device=dev, kind=kind, max_samples=r.max_samples_per_request)
        client.layout = (cfg.trainer.nodes, r.nodes, r.servers_per_node) if kind == "rollout" else \
            (cfg.trainer.nodes + r.nodes, cfg.reward.nodes, 1)
        return client

    # ------------------------------------------------------------------ discovery

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
                self._mark_dead(srv, "deregistered: it is draining (its job ended, was removed or preempted)",
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

    def _verified(self, srv: Server, announce: bool = True) -> None:
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

    def take_server_tokens(self) -> dict[int, int]:
        """Tokens each server generated since the last call (server index -> tokens)."""
        out, self._served_tokens = self._served_tokens, {}
        return out

    def server_throughputs(self) -> dict[int, float]:
        """Each live server's measured generation throughput (tokens/s; 0: not measured yet)."""
        return {s.index: s.tokens_per_s for s in self.servers.values() if s.healthy}

    def _elastic(self) -> bool:
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
                if self._health(s) is not None:
                    s.reprobe_at, s.reprobe_wait = 0.0, 0.0
                    found.append(s)
            if found:
                if self.pushed_version is None:
                    for s in found:
                        self._verified(s)
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

    def _health(self, srv: Server) -> dict | None:
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
                    if idx not in ready and srv is not None and self._health(srv) is not None:
                        ready.add(idx)
                        self._verified(srv, announce=False)
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
        trainer_nodes, rollout_nodes, per_node = self.layout
        if rollout_nodes == 0:
            return "on the first trainer node"
        return f"node index {trainer_nodes + idx // per_node} of the job"

    def _healthy(self) -> list[Server]:
        live = [s for s in self.servers.values() if s.healthy]
        if live:
            return sorted(live, key=lambda s: s.index)
        # Every server failed at some point: re-probe; one serving stale weights stays out.
        self.refresh()
        for s in self.servers.values():
            h = self._health(s)
            if h is not None and (self.pushed_version is None or h.get("policy_version") == self.pushed_version):
                self._verified(s)
        return sorted((s for s in self.servers.values() if s.healthy), key=lambda s: s.index)

    def _rejoin(self) -> None:
        """Servers restarted (or back) since they dropped out join this push, which gives them the current
        weights; a push that fails for one takes it out again."""
        self.refresh()
        now = time.monotonic()
        for s in self.servers.values():
            if s.healthy or now < s.reprobe_at:
                continue
            if self._health(s) is None:
                if not s.verified and s.reprobe_wait == 0.0:  # once: the backoff then keeps it quiet
                    log.warning("%s server %d at %s is registered but does not answer /health with this run's "
                                "token (%s); it gets no work until it does", self.kind, s.index, s.url, s.last_error)
                s.reprobe_wait = min(REPROBE_S[1], max(REPROBE_S[0], 2 * s.reprobe_wait))
                s.reprobe_at = now + s.reprobe_wait
                continue
            log.info("%s server %d at %s answers; it %s with this weight push", self.kind, s.index, s.url,
                     "rejoins" if s.verified else "joins")
            self._verified(s)

    def _mark_dead(self, srv: Server, cause: str, failed: bool = True) -> None:
        if srv.healthy:
            log.log(logging.WARNING if failed else logging.INFO, "%s server %d at %s %s (%s); routing its work to "
                    "the other servers", self.kind, srv.index, srv.url, "failed" if failed else "left", cause)
            self._events.append(f"{self.kind} server {srv.index} at {srv.url} left ({cause})")
        srv.healthy = False
        srv.last_error = cause

    # ------------------------------------------------------------------ requests

    def _post_json(self, srv: Server, path: str, body: dict, timeout: float) -> dict:
        try:
            r = srv.session.post(srv.url + path, json=body, timeout=timeout)
        except requests.RequestException as e:
            raise _HTTPFailure(f"{type(e).__name__}: {str(e)[:200]}") from None
        if r.status_code >= 500 or r.status_code in (401, 403):  # 401/403: not this run's server (token refused)
            raise _HTTPFailure(f"HTTP {r.status_code}: {error_of(r)}")
        if r.status_code == 429:
            try:
                wait = float(r.headers.get("retry-after", "1"))
            except ValueError:
                wait = 1.0
            raise _Busy(f"HTTP 429: {error_of(r)}", min(max(wait, 0.1), 30.0))
        not_finite = _not_finite(r)
        if not_finite is not None:  # the weights are broken, not the server: another server holds the same ones
            raise PolicyNotFiniteError(f"{self.kind} server {srv.url}: {error_of(r)}", not_finite)
        if r.status_code != 200:
            raise RolloutError(f"{self.kind} server {srv.url} rejected {path} (HTTP {r.status_code}): {error_of(r)}")
        if not srv.verified:
            self._verified(srv)
        return r.json()

    def _run_chunks(self, path: str, bodies: list[dict], what: str, servers: list[Server] | None = None,
                    served_by: list | None = None, owners: list[int] | None = None) -> list[dict]:
        """POST one body per chunk, concurrently, chunk i to servers[owners[i]] (default i mod their count; servers
        default to the healthy ones); a failed chunk moves to another healthy server, a refused one (429: busy) to
        another or, when all are busy, to the same after the wait it asks for. `served_by` receives (server,
        seconds) of each chunk."""
        servers = servers or self._healthy()
        if not servers:
            raise RolloutError(f"{what}: no healthy {self.kind} server ("
                               + "; ".join(f"{s.url}: {s.last_error}" for s in self.servers.values())
                               + f"); check RUN/logs/{self.kind}-K.log")

        def one(i: int) -> dict:
            tried: list[str] = []
            start = servers[(owners[i] if owners else i) % len(servers)].index
            attempts, busy_since, deadline = 0, set(), time.monotonic() + self.timeout_s
            while attempts <= self.retries:
                live = self._healthy()
                if not live:
                    break
                # Prefer the chunk's own server, then the next healthy one in index order; busy ones last.
                live.sort(key=lambda s: (s.index in busy_since, (s.index - start) % (max(self.servers) + 1)))
                srv = live[0]
                t0 = time.perf_counter()
                try:
                    res = self._post_json(srv, path, bodies[i], self.timeout_s)
                    if served_by is not None:
                        served_by[i] = (srv, time.perf_counter() - t0)
                    return res
                except _Busy as e:
                    busy_since.add(srv.index)
                    if time.monotonic() + e.retry_after_s > deadline:
                        tried.append(f"{srv.url} ({e}, for {self.timeout_s:.0f}s)")
                        break
                    if len(busy_since) >= len(live):  # every live server is busy: wait as asked, then again
                        time.sleep(e.retry_after_s)
                        busy_since.clear()
                except _HTTPFailure as e:
                    attempts += 1
                    tried.append(f"{srv.url} ({e})")
                    self._mark_dead(srv, str(e))
            raise RolloutError(f"{what}: chunk {i} failed after {len(tried)} attempt(s): {'; '.join(tried) or 'no healthy server'}; "
                               f"check RUN/logs/{self.kind}-K.log of those servers, or raise rollout.retries / "
                               "rollout.request_timeout_s")

        if len(bodies) == 1:
            return [one(0)]
        with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
            return list(pool.map(one, range(len(bodies))))

    def _n_chunks(self) -> int:
        # Chunk count follows the configured and the joined servers, not the live ones: a retried chunk keeps its
        # seed and its boundaries, so a dead server does not change the samples (nor does a registration that
        # never answered).
        return max(self.expected or 0, sum(s.verified for s in self.servers.values()), 1)

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams, step: int) -> GenerateResult:
        """Samples for every prompt, split across the servers; RolloutError names the server, step and cause."""
        t0 = time.perf_counter()
        if not prompt_token_ids:
            return GenerateResult([], [], 0.0, 0.0)
        live = self._healthy()
        if self._elastic() and len([s for s in live if s.verified]) > 1:
            live = [s for s in live if s.verified]
            # Servers of rollout jobs may be faster or slower: each gets a share by its measured throughput (the
            # unmeasured one the mean of the others'). Chunk boundaries then follow timing, so the samples of such a
            # run are not bit-reproducible; a run of only its own servers keeps equal, fixed chunks.
            measured = [s.tokens_per_s for s in live if s.tokens_per_s > 0]
            mean = sum(measured) / len(measured) if measured else 1.0
            ranges = split_weighted(len(prompt_token_ids), [s.tokens_per_s or mean for s in live])
        else:
            ranges = split_contiguous(len(prompt_token_ids), self._n_chunks())
        ranges, owners = bounded(ranges, params.n, self.max_samples)
        bodies = []
        for a, b in ranges:
            # Each prompt keeps its own seed whichever chunk and server it lands in.
            seeds = [params.prompt_seed(i) for i in range(a, b)]
            p = SamplingParams(n=params.n, max_new_tokens=params.max_new_tokens, temperature=params.temperature,
                               top_p=params.top_p, top_k=params.top_k, stop_token_ids=list(params.stop_token_ids),
                               seeds=None if None in seeds else seeds)
            bodies.append(protocol.params_to_json(prompt_token_ids[a:b], p))
        served_by: list = [None] * len(bodies)
        results = self._run_chunks("/generate", bodies, f"generate at step {step}", live, served_by, owners)
        outputs: list[list[SampleOut]] = []
        versions: list[int] = []
        per_server: dict[int, int] = {}
        for (a, b), res, by in zip(ranges, results, served_by):
            outs = protocol.outputs_from_json(res["outputs"])
            if len(outs) != b - a:
                raise RolloutError(f"generate at step {step}: a server returned {len(outs)} outputs for "
                                   f"{b - a} prompts; server and client versions differ")
            outputs.extend(outs)
            versions.extend([int(res["policy_version"])] * (b - a))
            ntok = sum(len(s.token_ids) for row in outs for s in row)
            srv, seconds = by
            per_server[srv.index] = per_server.get(srv.index, 0) + ntok
            self._served_tokens[srv.index] = self._served_tokens.get(srv.index, 0) + ntok
            if seconds > 0 and ntok:
                rate = ntok / seconds
                srv.tokens_per_s = rate if srv.tokens_per_s <= 0 else \
                    THROUGHPUT_EWMA * rate + (1 - THROUGHPUT_EWMA) * srv.tokens_per_s
        dt = time.perf_counter() - t0
        ntok = sum(len(s.token_ids) for row in outputs for s in row)
        return GenerateResult(outputs, versions, ntok / dt if dt > 0 else 0.0, dt, per_server)

    def logprobs(self, token_ids: list[list[int]], prompt_lens: list[int]) -> list[list[float]]:
        """Raw log-probs of token_ids[i][prompt_lens[i]:] under the served policy."""
        if not token_ids:
            return []
        ranges, owners = bounded(split_contiguous(len(token_ids), self._n_chunks()), 1, self.max_samples)
        bodies = [{"token_ids": token_ids[a:b], "prompt_lens": list(prompt_lens[a:b])} for a, b in ranges]
        results = self._run_chunks("/logprobs", bodies, "logprobs", owners=owners)
        return [row for res in results for row in res["logprobs"]]

    def score(self, token_ids: list[list[int]]) -> list[float]:
        """Raw reward-model logits of the rows (reward.model.placement: server), split across the servers."""
        if not token_ids:
            return []
        ranges = split_contiguous(len(token_ids), self._n_chunks())
        results = self._run_chunks("/v1/score", [{"token_ids": token_ids[a:b]} for a, b in ranges], "reward model score")
        out = [float(x) for res in results for x in res["logits"]]
        if len(out) != len(token_ids):
            raise RolloutError(f"reward model score: the servers returned {len(out)} scores for {len(token_ids)} "
                               "samples; server and client versions differ")
        return out

    # ------------------------------------------------------------------ weights

    def push_weights(self, named_tensors: Iterable, version: int) -> dict:
        """Send the actor's HF state dict to every healthy server; returns {"seconds", "bytes", "transport"}."""
        self._rejoin()
        servers = self._healthy()
        if not servers:
            raise RolloutError(f"push_weights v{version}: no healthy rollout server; check RUN/logs/rollout-K.log")
        if self._transport is None or self._transport[0] != self.weight_sync:
            self._drop_dead(servers)  # a server that is already gone must not decide the transport
            servers = self._healthy()
            if not servers:
                raise RolloutError(f"push_weights v{version}: no healthy rollout server; check RUN/logs/rollout-K.log")
            self._transport = (self.weight_sync, self._resolve_transport(servers))
        transport = self._transport[1]
        if transport != "collective":
            self._close_sender()
        t0 = time.perf_counter()
        if transport == "collective":
            named = list(named_tensors)
            try:
                nbytes = self._push_collective(named, version, servers)
            except RolloutError as e:
                if not self._drop_dead(servers):
                    raise  # every server is up: the error is real (wrong names, shapes, a timeout)
                # A server died mid-run: its group is broken. This version goes over HTTP to the living
                # servers; the next push forms a new group without the dead one.
                log.warning("push_weights v%d: collective failed (%s); sending this version over http", version, e)
                self._close_sender()
                transport = "http"
                live = self._healthy()
                if not live:  # the only server(s) died: no pool of 0 workers, a RolloutError the trainer handles
                    raise RolloutError(f"push_weights v{version}: no healthy rollout server left ({e}); check "
                                       "RUN/logs/rollout-K.log") from None
                nbytes = self._push_http(named, version, live)
        elif transport == "http":
            nbytes = self._push_http(named_tensors, version, servers)
        else:
            nbytes = self._push_file(named_tensors, version, servers)
        self.pushed_version = version
        dt = time.perf_counter() - t0
        log.debug("push_weights v%d: %d bytes over %s in %.2fs", version, nbytes, transport, dt)
        return {"seconds": dt, "bytes": nbytes, "transport": transport}

    def _collective_info(self, srv: Server) -> dict | None:
        try:
            r = srv.session.get(srv.url + "/collective/info", timeout=HEALTH_TIMEOUT_S)
        except requests.RequestException:
            return None
        return r.json() if r.status_code == 200 else None

    def _resolve_transport(self, servers: list[Server]) -> str:
        """weight_sync, with "auto" -> collective when every server offers it on the trainer's device kind."""
        if self.weight_sync in ("http", "file"):
            return self.weight_sync
        kind = "cuda" if str(self.trainer_device).startswith("cuda") else "cpu"
        problems = []
        for srv in servers:
            info = self._collective_info(srv)
            if info is None:
                problems.append(f"{srv.url} does not offer /collective")
                continue
            their = "cuda" if str(info.get("device", "cpu")).startswith("cuda") else "cpu"
            if their != kind:
                problems.append(f"{srv.url} serves on {their} but the trainer runs on {kind}")
        if not problems:
            log.info("weight sync: collective (%s) to %d server(s)", "nccl" if kind == "cuda" else "gloo",
                     len(servers))
            return "collective"
        if self.weight_sync == "collective":
            raise RolloutError(f"rollout.weight_sync: collective is not possible ({'; '.join(problems)}); set "
                               "rollout.weight_sync to auto, http or file")
        log.info("weight sync: http (rollout.weight_sync=auto; %s)", "; ".join(problems))
        return "http"

    def _push_collective(self, named: list, version: int, servers: list[Server]) -> int:
        from .collective_sender import CollectiveSender

        urls = [s.url for s in servers]
        if self._sender is not None and self._sender.servers != urls:
            self._close_sender()  # the set of servers changed: form a new group
        if self._sender is None:
            sender = CollectiveSender(urls, self.token, device=self.trainer_device, timeout_s=self.timeout_s)
            sender.connect(specs={n: (tuple(t.shape), t.dtype) for n, t in named})
            self._sender = sender
        self._sender.broadcast(named, version)
        return self._sender.last_bytes

    def _drop_dead(self, servers: list[Server]) -> bool:
        """Mark servers that no longer answer /health as dead; True when there was one."""
        dead = False
        for srv in servers:
            if self._health(srv) is None:
                self._mark_dead(srv, srv.last_error or "no answer to /health")
                dead = True
        return dead

    def _close_sender(self) -> None:
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.close()

    def _post_all(self, servers: list[Server], send) -> None:
        """Run send(server) on every server concurrently; a failing server is taken out of rotation."""
        def guarded(srv: Server):
            try:
                send(srv)
                return None
            except _HTTPFailure as e:
                return srv, str(e)

        with ThreadPoolExecutor(max_workers=len(servers)) as pool:
            failures = [f for f in pool.map(guarded, servers) if f]
        for srv, cause in failures:
            self._mark_dead(srv, cause)
            servers.remove(srv)
        if not servers:
            raise RolloutError("push_weights: every rollout server failed: "
                               + "; ".join(f"{s.url} ({c})" for s, c in failures))

    def _push_http(self, named_tensors: Iterable, version: int, servers: list[Server]) -> int:
        from ..wire.weights import bucket_bytes_of, buckets

        total = 0
        it = iter(buckets(named_tensors))
        cur = next(it, None)
        i = 0
        while cur is not None:
            nxt = next(it, None)  # look ahead: the last bucket carries final=1
            data = bucket_bytes_of(cur)
            total += len(data)
            final = int(nxt is None)

            def send(srv: Server, data=data, i=i, final=final):
                try:
                    # A file-like body streams with a Content-Length instead of one huge sendall.
                    r = srv.session.post(f"{srv.url}/weights?version={version}&bucket={i}&final={final}",
                                         data=io.BytesIO(data), timeout=self.timeout_s,
                                         headers={"Content-Type": "application/octet-stream",
                                                  "Content-Length": str(len(data))})
                except requests.RequestException as e:
                    raise _HTTPFailure(f"{type(e).__name__}: {str(e)[:200]}") from None
                if r.status_code >= 500:
                    raise _HTTPFailure(f"HTTP {r.status_code}: {error_of(r)}")
                if r.status_code != 200:
                    raise RolloutError(f"push_weights v{version}: {srv.url} rejected bucket {i} "
                                       f"(HTTP {r.status_code}): {error_of(r)}")

            self._post_all(servers, send)
            cur, i = nxt, i + 1
        return total

    def _push_file(self, named_tensors: Iterable, version: int, servers: list[Server]) -> int:
        from ..wire.weights import prune_versions, write_version

        folder, nbytes = write_version(self.run.weights, version, named_tensors)

        def send(srv: Server):
            self._post_json(srv, "/weights/load_file", {"path": str(folder), "version": version}, self.timeout_s)

        self._post_all(servers, send)
        prune_versions(self.run.weights, keep=version)
        return nbytes

    def close(self) -> None:
        """Leave the weight-sync group (servers are told to leave too) and close the HTTP sessions."""
        self._close_sender()
        for s in self.servers.values():
            s.session.close()


__all__ = ["RolloutClient", "GenerateResult", "SamplingParams", "SampleOut", "split_contiguous",
           "split_weighted"]
