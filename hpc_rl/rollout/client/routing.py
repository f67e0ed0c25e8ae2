"""How the trainer side's requests reach the servers: work split into chunks (contiguous, by measured throughput, at
most rollout.max_samples_per_request samples each), one POST per chunk, concurrently; a chunk whose server fails goes
to another, one refused for load (429) to another or, when every server is busy, to the same after the wait asked."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import requests

from ...errors import PolicyNotFiniteError, RolloutError
from ...netutil import error_of
from ..wire import protocol
from .pool import Server, ServerPool


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


def not_finite(r: requests.Response) -> int | None:
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


class HTTPFailure(Exception):
    """A request that may succeed elsewhere (connection error, timeout, 5xx)."""


class Busy(Exception):
    """429: the server holds as many requests as it takes; another server, or the same one shortly, will take it."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Router:
    """POSTs to the servers of `pool` with failover: timeouts and retries from rollout.request_timeout_s/retries."""

    def __init__(self, pool: ServerPool, timeout_s: float = 300.0, retries: int = 2):
        self.pool, self.timeout_s, self.retries = pool, timeout_s, retries

    def post_json(self, srv: Server, path: str, body: dict, timeout: float) -> dict:
        try:
            r = srv.session.post(srv.url + path, json=body, timeout=timeout)
        except requests.RequestException as e:
            raise HTTPFailure(f"{type(e).__name__}: {str(e)[:200]}") from None
        if r.status_code >= 500 or r.status_code in (401, 403):  # 401/403: not this run's server (token refused)
            raise HTTPFailure(f"HTTP {r.status_code}: {error_of(r)}")
        if r.status_code == 429:
            try:
                wait = float(r.headers.get("retry-after", "1"))
            except ValueError:
                wait = 1.0
            raise Busy(f"HTTP 429: {error_of(r)}", min(max(wait, 0.1), 30.0))
        version = not_finite(r)
        if version is not None:  # the weights are broken, not the server: another server holds the same ones
            raise PolicyNotFiniteError(f"{self.pool.kind} server {srv.url}: {error_of(r)}", version)
        if r.status_code != 200:
            raise RolloutError(f"{self.pool.kind} server {srv.url} rejected {path} (HTTP {r.status_code}): {error_of(r)}")
        if not srv.verified:
            self.pool.answered(srv)
        return r.json()

    def run_chunks(self, path: str, bodies: list[dict], what: str, servers: list[Server] | None = None,
                    served_by: list | None = None, owners: list[int] | None = None) -> list[dict]:
        """POST one body per chunk, concurrently, chunk i to servers[owners[i]] (default i mod their count; servers
        default to the healthy ones); a failed chunk moves to another healthy server, a refused one (429: busy) to
        another or, when all are busy, to the same after the wait it asks for. `served_by` receives (server,
        seconds) of each chunk."""
        servers = servers or self.pool.healthy()
        if not servers:
            raise RolloutError(f"{what}: no healthy {self.pool.kind} server ("
                               + "; ".join(f"{s.url}: {s.last_error}" for s in self.pool.servers.values())
                               + f"); check RUN/logs/{self.pool.kind}-K.log")

        def one(i: int) -> dict:
            tried: list[str] = []
            start = servers[(owners[i] if owners else i) % len(servers)].index
            attempts, busy_since, deadline = 0, set(), time.monotonic() + self.timeout_s
            while attempts <= self.retries:
                live = self.pool.healthy()
                if not live:
                    break
                # Prefer the chunk's own server, then the next healthy one in index order; busy ones last.
                live.sort(key=lambda s: (s.index in busy_since, (s.index - start) % (max(self.pool.servers) + 1)))
                srv = live[0]
                t0 = time.perf_counter()
                try:
                    res = self.post_json(srv, path, bodies[i], self.timeout_s)
                    if served_by is not None:
                        served_by[i] = (srv, time.perf_counter() - t0)
                    return res
                except Busy as e:
                    busy_since.add(srv.index)
                    if time.monotonic() + e.retry_after_s > deadline:
                        tried.append(f"{srv.url} ({e}, for {self.timeout_s:.0f}s)")
                        break
                    if len(busy_since) >= len(live):  # every live server is busy: wait as asked, then again
                        time.sleep(e.retry_after_s)
                        busy_since.clear()
                except HTTPFailure as e:
                    attempts += 1
                    tried.append(f"{srv.url} ({e})")
                    self.pool.mark_dead(srv, str(e))
            raise RolloutError(f"{what}: chunk {i} failed after {len(tried)} attempt(s): {'; '.join(tried) or 'no healthy server'}; "
                               f"check RUN/logs/{self.pool.kind}-K.log of those servers, or raise rollout.retries / "
                               "rollout.request_timeout_s")

        if len(bodies) == 1:
            return [one(0)]
        with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
            return list(pool.map(one, range(len(bodies))))

    def n_chunks(self) -> int:
        # Chunk count follows the configured and the joined servers, not the live ones: a retried chunk keeps its
        # seed and its boundaries, so a dead server does not change the samples (nor does a registration that
        # never answered).
        return max(self.pool.expected or 0, sum(s.verified for s in self.pool.servers.values()), 1)

    def post_all(self, servers: list[Server], send) -> None:
        """Run send(server) on every server concurrently; a failing server is taken out of rotation."""
        def guarded(srv: Server):
            try:
                send(srv)
                return None
            except HTTPFailure as e:
                return srv, str(e)

        with ThreadPoolExecutor(max_workers=len(servers)) as pool:
            failures = [f for f in pool.map(guarded, servers) if f]
        for srv, cause in failures:
            self.pool.mark_dead(srv, cause)
            servers.remove(srv)
        if not servers:
            raise RolloutError("push_weights: every rollout server failed: "
                               + "; ".join(f"{s.url} ({c})" for s, c in failures))

