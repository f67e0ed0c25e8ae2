"""RolloutClient: trainer rank 0's view of the rollout servers (discovery, generation, weight push)."""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import requests

from ...errors import RolloutError
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
_SEED_MOD = 2**63 - 1


@dataclass
class GenerateResult:
    outputs: list[list[SampleOut]]
    policy_versions: list[int]
    tokens_per_s: float
    seconds: float


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


def chunk_seed(seed: int | None, start: int) -> int | None:
    """The seed of the chunk starting at prompt `start`: independent of which server serves it."""
    if seed is None:
        return None
    return (int(seed) * 1_000_003 + start * 7919 + 1) % _SEED_MOD


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


def _back(srv: Server) -> None:
    """A server answers again: it takes work, and a later failure starts its re-probe backoff from the start."""
    srv.healthy, srv.reprobe_at, srv.reprobe_wait = True, 0.0, 0.0


class _HTTPFailure(Exception):
    """A request that may succeed elsewhere (connection error, timeout, 5xx)."""


class RolloutClient:
    """Talks to every rollout server of a run; see the module doc of hpc_rl.rollout for the API."""

    def __init__(self, run: RunDir, token: str, timeout_s: float = 300.0, retries: int = 2,
                 weight_sync: str = "auto", trainer_device: str = "cpu", kind: str = "rollout"):
        self.run = run
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
        self.pushed_version: int | None = None
        self.expected = 0
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
                     weight_sync=r.weight_sync, trainer_device=dev, kind=kind)
        client.layout = (cfg.trainer.nodes, r.nodes, r.servers_per_node) if kind == "rollout" else \
            (cfg.trainer.nodes + r.nodes, cfg.reward.nodes, 1)
        return client

    # ------------------------------------------------------------------ discovery

    def _session(self) -> requests.Session:
        return auth_session(self.token)

    def refresh(self) -> None:
        """(Re)read RUN/rendezvous/rollout-K.json; a server that restarted on a new port gets a new entry."""
        d = self.run.rendezvous
        for f in sorted(d.glob(f"{self.kind}-*.json")) if d.is_dir() else []:
            info = read_json(f)
            why = registration_problem(info, f)
            if why is not None:
                self._ignore(f, why)
                continue
            idx = int(info.get("index", f.stem.split("-")[-1]))
            old = self.servers.get(idx)
            if old is None or old.url != info["url"]:
                if old is not None:
                    old.session.close()
                # A server that (re)starts after a weight push serves stale weights, and one beyond the job's own
                # (a rollout job's, or a forged file) has not shown it holds the token: either gets no work until
                # _rejoin (at the next push, which brings it to the current weights) finds it answering.
                # A restart (a known index at a new address) keeps its place in the chunking.
                own = self.expected == 0 or idx < self.expected
                self.servers[idx] = Server(idx, info["url"], self._session(),
                                           healthy=self.pushed_version is None and own,
                                           verified=old is not None and old.verified)

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

    def _health(self, srv: Server) -> dict | None:
        try:
            r = srv.session.get(srv.url + "/health", timeout=HEALTH_TIMEOUT_S)
        except requests.RequestException as e:
            srv.last_error = f"{type(e).__name__}: {str(e)[:160]}"
            return None
        if r.status_code != 200:
            srv.last_error = f"HTTP {r.status_code}: {error_of(r)}"
            return None
        return r.json()

    def wait_ready(self, expected: int, timeout_s: float) -> None:
        """Wait for `expected` rendezvous files and a healthy /health on each; RolloutError names the missing."""
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.expected = expected
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

    def _mark_dead(self, srv: Server, cause: str) -> None:
        if srv.healthy:
            log.warning("%s server %d at %s failed (%s); routing its work to the other servers",
                        self.kind, srv.index, srv.url, cause)
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
        if r.status_code != 200:
            raise RolloutError(f"{self.kind} server {srv.url} rejected {path} (HTTP {r.status_code}): {error_of(r)}")
        if not srv.verified:
            self._verified(srv)
        return r.json()

    def _run_chunks(self, path: str, bodies: list[dict], what: str) -> list[dict]:
        """POST one body per chunk, concurrently; a failed chunk moves to another healthy server."""
        servers = self._healthy()
        if not servers:
            raise RolloutError(f"{what}: no healthy {self.kind} server ("
                               + "; ".join(f"{s.url}: {s.last_error}" for s in self.servers.values())
                               + f"); check RUN/logs/{self.kind}-K.log")

        def one(i: int) -> dict:
            tried: list[str] = []
            start = servers[i % len(servers)].index
            for _attempt in range(self.retries + 1):
                live = self._healthy()
                if not live:
                    break
                # Prefer the chunk's own server, then the next healthy one in index order.
                live.sort(key=lambda s: (s.index - start) % (max(self.servers) + 1))
                srv = live[0]
                try:
                    return self._post_json(srv, path, bodies[i], self.timeout_s)
                except _HTTPFailure as e:
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
        return max(self.expected, sum(s.verified for s in self.servers.values()), 1)

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams, step: int) -> GenerateResult:
        """Samples for every prompt, split across the servers; RolloutError names the server, step and cause."""
        t0 = time.perf_counter()
        if not prompt_token_ids:
            return GenerateResult([], [], 0.0, 0.0)
        ranges = split_contiguous(len(prompt_token_ids), self._n_chunks())
        bodies = []
        for a, b in ranges:
            p = SamplingParams(n=params.n, max_new_tokens=params.max_new_tokens, temperature=params.temperature,
                               top_p=params.top_p, top_k=params.top_k, stop_token_ids=list(params.stop_token_ids),
                               seed=chunk_seed(params.seed, a))
            bodies.append(protocol.params_to_json(prompt_token_ids[a:b], p))
        results = self._run_chunks("/generate", bodies, f"generate at step {step}")
        outputs: list[list[SampleOut]] = []
        versions: list[int] = []
        for (a, b), res in zip(ranges, results):
            outs = protocol.outputs_from_json(res["outputs"])
            if len(outs) != b - a:
                raise RolloutError(f"generate at step {step}: a server returned {len(outs)} outputs for "
                                   f"{b - a} prompts; server and client versions differ")
            outputs.extend(outs)
            versions.extend([int(res["policy_version"])] * (b - a))
        dt = time.perf_counter() - t0
        ntok = sum(len(s.token_ids) for row in outputs for s in row)
        return GenerateResult(outputs, versions, ntok / dt if dt > 0 else 0.0, dt)

    def logprobs(self, token_ids: list[list[int]], prompt_lens: list[int]) -> list[list[float]]:
        """Raw log-probs of token_ids[i][prompt_lens[i]:] under the served policy."""
        if not token_ids:
            return []
        ranges = split_contiguous(len(token_ids), self._n_chunks())
        bodies = [{"token_ids": token_ids[a:b], "prompt_lens": list(prompt_lens[a:b])} for a, b in ranges]
        results = self._run_chunks("/logprobs", bodies, "logprobs")
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


__all__ = ["RolloutClient", "GenerateResult", "SamplingParams", "SampleOut", "chunk_seed", "split_contiguous"]
