"""Rollout server: `python -m hpc_rl.rollout.server --run-dir RUN --index K [--device cpu|cuda:N] [--role ROLE]`.

Serves one engine over HTTP (API in wire/protocol.py), writes RUN/rendezvous/rollout-K.json once it serves
(and again whenever it disappears: a requeued run's preamble clears the folder), and exits when
RUN/rendezvous/done.json appears or on SIGTERM/SIGINT. A signal drains first: the server answers new work with 503
(the trainer's client sends it elsewhere), removes its registration, and finishes what it is generating.

The HTTP side (FastAPI + uvicorn, token and size checks before the body is read) is app.py; this module
holds the service behind it (engine, policy version, staged weight buckets, counters) and the entry point.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import HpcRlError, first_line
from ...netutil import advertise_host
from ...rundir import RunDir, read_json, write_json_atomic
from ..wire import openai_api, protocol
from ..wire.protocol import DRAIN_S, BadRequest, Busy, Draining, PolicyNotFinite
from ..wire.sampling import SampleOut
from ..wire.tool_calls import check_template_tools
from ..wire.weights import WeightError, load_path, tensors_from_bytes, validate_named_tensors
from .app import HttpServer, bind, make_app
from .collective_receiver import register_server_routes
from .engine import Cancelled, Engine
from .engines import make_engine

log = logging.getLogger("hpc_rl")

DONE_POLL_S = 2.0


# --------------------------------------------------------------------------- the service (no HTTP)


class WeightGate:
    """Generations run side by side on the engine; a weight load waits for the running ones and holds new ones
    back, so that no request sees half-updated weights and each reports the one version that produced it.

    Generations enter from the event loop (`generating`, awaited), loads from worker threads (`loading`)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._active = 0
        self._loading = False

    @contextlib.asynccontextmanager
    async def generating(self):
        while True:
            with self._cond:  # held for a moment only: the event loop never blocks on a load
                if not self._loading:
                    self._active += 1
                    break
            await asyncio.sleep(0.005)
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no generation runs and no load is under way; False after timeout_s."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._active or self._loading:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))
        return True

    @property
    def state(self) -> str:
        return "loading weights" if self._loading else "serving"

    @property
    def active(self) -> int:
        """Generations (and log-prob requests) running now."""
        return self._active

    @contextlib.contextmanager
    def loading(self, wait_for_generations: bool = True):
        """Held while weights load: new generations wait; running ones finish first unless `wait_for_generations`
        is False (in-flight updates: the engine pauses them between decoding steps instead)."""
        with self._cond:
            while self._loading:
                self._cond.wait()
            self._loading = True
            while self._active and wait_for_generations:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._loading = False
                self._cond.notify_all()


def check_finite(rows: list[list[float]], what: str) -> None:
    """PolicyNotFinite when a log-prob the engine computed is NaN or +inf (-inf is a possible, impossible token)."""
    for row in rows:
        for x in row:
            if math.isnan(x) or x == math.inf:
                raise PolicyNotFinite(f"{what}: the engine returned a non-finite log-prob ({x})")


class RolloutService:
    """Engine + policy version + staged weight buckets + counters; generations and weight loads pass one gate."""

    def __init__(self, engine: Engine, run: RunDir, model_path: str, limits: protocol.RequestLimits,
                 vocab: int | None, trust_remote_code: bool = False, max_in_flight: int = 256,
                 openai_defaults: openai_api.Defaults | None = None, inflight_updates: bool = False):
        if inflight_updates and not engine.inflight:
            raise HpcRlError(f"rollout.inflight_updates: the {engine.name} engine cannot swap weights under running "
                             "generations; serve it with rollout.engine: hf or vllm, or set rollout.inflight_updates: false")
        self.engine = engine
        # Weight loads pause running generations (engine.swapping()) instead of waiting for them to finish.
        self.inflight = bool(inflight_updates)
        self.openai_defaults = openai_defaults or openai_api.Defaults()
        self.trust_remote_code = trust_remote_code
        self._tokenizer = None  # loaded on the first /v1/ request (the trainer sends token ids)
        self._tok_lock = threading.Lock()
        self.run = run
        self.model_path = model_path
        self.limits = limits
        self.vocab = vocab
        self.max_in_flight = max_in_flight
        self._in_flight = 0  # requests admitted and not answered yet (running or waiting for the engine)
        self.policy_version = 0
        self.weight_gate = WeightGate()
        self._stage_lock = threading.Lock()
        self._staged_version: int | None = None
        self._staged: dict[int, list] = {}
        self._specs = engine.param_specs()
        self._counters = {"requests": 0, "generate_requests": 0, "generated_tokens": 0, "weight_updates": 0,
                          "last_batch_tokens_per_s": 0.0, "last_batch_seconds": 0.0, "errors": 0,
                          "refused_busy": 0, "cancelled": 0}
        self._count_lock = threading.Lock()
        self.started = time.time()
        self.draining = False  # set when the server leaves: new work gets 503 (Draining)
        self.frozen_role: str | None = None  # a service's role (teacher): its weights never change
        # Extra JSON endpoints (e.g. collective weight sync): (method, path) -> fn(body or None) -> dict.
        self.routes: dict[tuple[str, str], Callable[[Any], dict]] = {}

    def add_route(self, method: str, path: str, fn: Callable[[Any], dict]) -> None:
        """Serve `fn(json_body_or_None) -> dict` at method+path, behind the same token/limits/errors."""
        self.routes[(method.upper(), path.rstrip("/"))] = fn

    def set_policy_version(self, version: int) -> None:
        """For weight transports that load outside this class; waits for running generations (or, in flight, for
        their decoding step)."""
        with self.loading_weights():
            self.loaded(version)

    @contextlib.contextmanager
    def loading_weights(self):
        """Held around a weight load: no generation sees half-loaded weights. Without in-flight updates running
        generations finish first (each reports the one version that produced it); with them, generations pause
        between decoding steps and continue with the new weights."""
        if not self.inflight:
            with self.weight_gate.loading():
                yield
            return
        with self.weight_gate.loading(wait_for_generations=False), self.engine.swapping():
            yield

    def loaded(self, version: int) -> None:
        """The weights of `version` are in (called inside loading_weights)."""
        self.engine.weights_version = self.policy_version = int(version)

    def count(self, key: str, inc: float = 1) -> None:
        with self._count_lock:
            self._counters[key] += inc

    @property
    def state(self) -> str:
        """serving, loading weights or draining (what `hpc-rl rollout list` shows)."""
        return "draining" if self.draining else self.weight_gate.state

    def _take_work(self) -> None:
        if self.draining:
            raise Draining("draining: this server is leaving the run; send the request to another server")

    @contextlib.contextmanager
    def _admitted(self):
        """A request with the engine's work to do: at most max_in_flight at once (Busy, answered 429, past it)."""
        self._take_work()
        with self._count_lock:
            if self._in_flight >= self.max_in_flight:
                self._counters["refused_busy"] += 1
                raise Busy(f"busy: this server holds {self._in_flight} requests (rollout.max_requests_in_flight "
                           f"{self.max_in_flight}); send it to another server or again shortly")
            self._in_flight += 1
        try:
            yield
        except (Cancelled, asyncio.CancelledError):  # its client went away (a thread engine / an engine's loop)
            self.count("cancelled")
            raise
        finally:
            with self._count_lock:
                self._in_flight -= 1

    def health(self) -> dict:
        return {"status": "ok", "state": self.state, "engine": self.engine.name,
                "policy_version": self.policy_version, "model": self.model_path}

    def metrics(self) -> dict:
        with self._count_lock:
            out = dict(self._counters)
        out.update(policy_version=self.policy_version, engine=self.engine.name, state=self.state,
                   generating=self.weight_gate.active, in_flight=self._in_flight,
                   uptime_s=round(time.time() - self.started, 3))
        return out

    async def generate(self, body, cancel: threading.Event | None = None) -> dict:
        prompts, params = protocol.parse_generate(body, self.vocab, self.limits)
        images = protocol.parse_images(body, len(prompts))
        if images is not None and any(images) and not self.engine.takes_images:
            raise BadRequest(f"images: this server's model ({self.model_path}, engine {self.engine.name}) takes no "
                             "images; serve a vision-language model with rollout.engine: hf")
        with self._admitted():
            async with self.weight_gate.generating():
                t0 = time.perf_counter()
                outputs = await self._generate(prompts, params, cancel, images)
                dt = time.perf_counter() - t0
                version = self._version_of(outputs)
        ntok = sum(len(s.token_ids) for row in outputs for s in row)
        with self._count_lock:
            self._counters["generate_requests"] += 1
            self._counters["generated_tokens"] += ntok
            self._counters["last_batch_seconds"] = round(dt, 4)
            self._counters["last_batch_tokens_per_s"] = round(ntok / dt, 2) if dt > 0 else 0.0
        log.debug("generate: %d prompts x %d, %d tokens in %.3fs", len(prompts), params.n, ntok, dt)
        return {"policy_version": version, "outputs": protocol.outputs_to_json(outputs)}

    def _version_of(self, outputs: list[list[SampleOut]]) -> int:
        """The response's policy version: the oldest that sampled a token of it (the one that sampled all of them,
        unless weights changed in flight); samples whose tokens all come from it drop their per-token versions."""
        seen = [s.versions[0] for row in outputs for s in row if s.versions]
        if not seen:
            return self.policy_version
        version = min(seen)
        for row in outputs:
            for s in row:
                if s.versions is not None and all(v == version for v in s.versions):
                    s.versions = None
        return version

    async def _generate(self, prompts: list[list[int]], params, cancel: threading.Event | None = None,
                        images: list[list[bytes]] | None = None):
        """The engine's samples; PolicyNotFinite (with this server's policy version) when its forward is not finite."""
        try:
            outputs = await self.engine.generate_async(prompts, params, cancel, images)
            check_finite((s.logprobs for row in outputs for s in row), "generate")
        except PolicyNotFinite as e:
            raise self._not_finite(e) from None
        return outputs

    def _not_finite(self, e: PolicyNotFinite) -> PolicyNotFinite:
        self.count("errors")
        out = PolicyNotFinite(f"policy version {self.policy_version} is not finite here: {e}")
        out.version = self.policy_version
        return out

    def tokenizer(self):
        with self._tok_lock:
            if self._tokenizer is None:
                from ...models import load_tokenizer

                self._tokenizer = load_tokenizer(self.model_path, self.trust_remote_code)
            return self._tokenizer

    async def completions(self, body, cancel: threading.Event | None = None) -> dict:
        """OpenAI-compatible text completion (non-streaming): wire/openai_api.py."""
        self._take_work()
        tok = await asyncio.to_thread(self.tokenizer)
        # Tokenizing a long text takes a while: not on the event loop, which keeps serving.
        req = await asyncio.to_thread(
            openai_api.parse_completions, body, lambda text: tok(text, add_special_tokens=False)["input_ids"],
            self.vocab, self.limits, self.openai_defaults)
        return await self._openai(req, tok, openai_api.completion_response, cancel)

    async def chat_completions(self, body, cancel: threading.Event | None = None) -> dict:
        """OpenAI-compatible chat completion (non-streaming): the tokenizer's chat template, with the generation
        prompt, renders the messages as the run's prompts are rendered."""
        self._take_work()
        tok = await asyncio.to_thread(self.tokenizer)

        def render(messages: list[dict], tools: list[dict] | None) -> list[int]:
            if not getattr(tok, "chat_template", None):
                raise BadRequest(f"messages: the model's tokenizer ({self.model_path}) has no chat template; send "
                                 "text to /v1/completions or give the tokenizer a chat_template")
            check_template_tools(tok, tools, self.model_path)
            try:
                text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
            except Exception as e:  # the template's own checks (raise_exception), or jinja failing on the input
                raise BadRequest(f"messages: the model's chat template refused them: {first_line(e)}") from None
            return tok(text, add_special_tokens=False)["input_ids"]

        req = await asyncio.to_thread(openai_api.parse_chat, body, render, self.vocab, self.limits,
                                      self.openai_defaults)
        return await self._openai(req, tok, openai_api.chat_response, cancel)

    async def _openai(self, req, tok, respond, cancel) -> dict:
        if tok.eos_token_id is not None:
            req.params.stop_token_ids = [tok.eos_token_id]
        with self._admitted():
            async with self.weight_gate.generating():
                outputs = await self._generate(req.prompts, req.params, cancel)
                version = self._version_of(outputs)
        self.count("generate_requests")
        self.count("generated_tokens", sum(len(s.token_ids) for row in outputs for s in row))
        return respond(req, outputs, lambda ids: tok.decode(ids, skip_special_tokens=True), self.model_path, version)

    def models(self) -> dict:
        return openai_api.models_response(self.model_path, self.policy_version, self.limits.max_model_len,
                                          self.started)

    async def logprobs(self, body, cancel: threading.Event | None = None) -> dict:
        toks, lens, top_k = protocol.parse_logprobs(body, self.vocab, self.limits)
        images = protocol.parse_images(body, len(toks))
        if images is not None and any(images) and not self.engine.takes_images:
            raise BadRequest(f"images: this server's model ({self.model_path}) takes no images")
        with self._admitted():
            async with self.weight_gate.generating():
                try:
                    top = await self.engine.prompt_top_logprobs_async(toks, lens, top_k, cancel, images)
                    check_finite(top.logprobs, "logprobs")
                    check_finite([row for rows in top.top_logprobs for row in rows], "top_logprobs")
                except PolicyNotFinite as e:
                    raise self._not_finite(e) from None
                version = self.policy_version if top.version is None else top.version
        out = {"policy_version": version, "logprobs": top.logprobs}
        if top_k:
            out.update(top_ids=top.top_ids, top_logprobs=top.top_logprobs)
        return out

    def _swap(self, named: list, version: int) -> None:
        self._take_work()
        with self.loading_weights():
            self.engine.load_weights(named)
            self.engine.reset_cache()
            self.loaded(version)
        self.count("weight_updates")
        log.info("weights: loaded %d tensors, policy_version %d", len(named), version)

    def _refuse_weights(self) -> None:
        if self.frozen_role:
            raise BadRequest(f"this is a {self.frozen_role} server (services.{self.frozen_role}): its weights never "
                             "change; push the policy to the rollout servers")

    def push_bucket(self, data: bytes, version: int, bucket: int, final: bool) -> dict:
        """Stage one safetensors bucket; on `final`, load every staged bucket of this version at once."""
        self._refuse_weights()
        try:
            named = tensors_from_bytes(data)
            validate_named_tensors(self._specs, named)
        except WeightError:
            with self._stage_lock:  # a bad bucket poisons its version: nothing of it gets loaded
                if self._staged_version == version:
                    self._staged, self._staged_version = {}, None
            raise
        with self._stage_lock:
            if self._staged_version != version:
                self._staged, self._staged_version = {}, version
            self._staged[bucket] = named
            if not final:
                return {"staged": bucket, "version": version}
            missing = [i for i in range(bucket + 1) if i not in self._staged]
            staged = [t for i in sorted(self._staged) for t in self._staged[i]]
            self._staged, self._staged_version = {}, None
        if missing:
            raise WeightError(f"weights: version {version} final bucket {bucket} arrived but bucket(s) {missing} "
                              "did not; resend every bucket of the version")
        self._swap(staged, version)
        return {"policy_version": version, "tensors": len(staged)}

    def load_file(self, body) -> dict:
        self._refuse_weights()
        path_s, version = protocol.parse_load_file(body)
        root = self.run.weights.resolve()
        path = Path(path_s).resolve()
        if path != root and root not in path.parents:
            raise BadRequest(f"path: {path_s} is outside {root}; the file transport only loads from RUN/weights")
        named = load_path(path)
        validate_named_tensors(self._specs, named)
        self._swap(named, version)
        return {"policy_version": version, "tensors": len(named)}


# --------------------------------------------------------------------------- HTTP


def make_http_server(service: RolloutService, token: str, host: str, port: int) -> HttpServer:
    """The API (app.py) bound to host:port (0 = any free port); HpcRlError naming the address when that fails."""
    if not token:  # `Authorization: Bearer ` would pass the check
        raise HpcRlError("rollout server: refusing to serve without the run's token (RUN/token is empty)")
    try:
        sock = bind(host, port)
    except OSError as e:
        raise HpcRlError(f"rollout.host/rollout.port: cannot bind {host}:{port} ({e.strerror}); choose a free "
                         "port (0 picks one) and an address of this node (0.0.0.0 = all interfaces)") from None
    # On the engine's own event loop where it has one (vLLM): the endpoints then await it directly.
    engine = getattr(service, "engine", None)
    return HttpServer(make_app(service, token), sock, loop=engine.loop if engine is not None else None)


# --------------------------------------------------------------------------- main


def _setup_logging() -> None:
    level = logging.DEBUG if os.environ.get("HPC_RL_DEBUG") == "1" else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s rollout %(levelname)s %(message)s", stream=sys.stderr)


def service_job(cfg, role: str):
    """The job as a service's server sees it: the service's model folder and engine settings in place of the
    policy's (services.ROLE)."""
    import dataclasses

    svc = cfg.services.roles()[role]
    r = cfg.rollout
    rollout = dataclasses.replace(
        r, engine=svc.engine or r.engine, dtype=svc.dtype or r.dtype, tensor_parallel=svc.tensor_parallel,
        gpu_memory_utilization=svc.gpu_memory_utilization or r.gpu_memory_utilization, weight_sync="file")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=svc.path, lora=None), rollout=rollout)


def serve(run_dir: str, index: int, device: str | None = None, role: str = "rollout",
          overrides: list[str] | None = None) -> int:
    """Run one rollout server (or, role "reward", a reward node's reward server) until SIGTERM/SIGINT or
    RUN/rendezvous/done.json; `overrides` (rollout.* of a rollout job) apply to the run's job.yaml."""
    from ...config import load
    from ...models.loading import model_vocab_size
    from ...startup_clock import PHASES

    PHASES.mark("server up")
    run = RunDir(Path(run_dir).resolve())
    cfg = load(run.job_yaml, list(overrides or []))
    token = run.read_token()
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if role == "reward":  # a reward node's server: the reward model alone, on this node's first GPU
        from ...rewards.serving import RewardService, register_score_route

        engine = None
        service = RewardService(str(cfg.reward.model.path))
        register_score_route(service, cfg, device, own_device=True)
    else:
        # A service (teacher, judge) serves its own folder with its own engine settings and takes no weights.
        service_role = role in cfg.services.roles()
        served = service_job(cfg, role) if service_role else cfg
        engine = make_engine(served, device)
        PHASES.mark("engine loaded")
        service = RolloutService(engine, run, str(served.model.path), protocol.RequestLimits.of(served.rollout),
                                 model_vocab_size(str(served.model.path)), served.model.trust_remote_code,
                                 served.rollout.max_requests_in_flight, openai_api.Defaults.of(served.rollout),
                                 inflight_updates=served.rollout.inflight_updates and not service_role)
        if service_role:
            service.frozen_role = role
        else:
            register_server_routes(service)  # /collective/*: the weight-sync group's server side
            if cfg.reward.on_rollout_servers:
                from ...rewards.serving import register_score_route

                register_score_route(service, cfg, device)  # /v1/score: the reward model, on its own GPU
    httpd = make_http_server(service, token, cfg.rollout.host, cfg.rollout.port)
    port = httpd.server_address[1]
    # The engine's and libraries' objects live as long as the server: out of the collector's way (a full collection
    # over them stalled a request by ~0.2 s on a toy model).
    gc.freeze()
    if cfg.rollout.host.startswith("127.") or cfg.rollout.host in ("localhost", "::1"):
        log.warning("!!! %s server %d is bound to %s: only processes on this node can reach it; set "
                    "rollout.host: 0.0.0.0 for multi-node jobs !!!", role, index, cfg.rollout.host)
    stop = threading.Event()
    reason = {"why": "signal"}

    def on_signal(signum, _frame):
        reason["why"] = signal.Signals(signum).name
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    thread = threading.Thread(target=httpd.serve_forever, name="http", daemon=True)
    thread.start()
    host = advertise_host(cfg.rollout.host)
    name = engine.name if engine is not None else "reward-model"
    info = {"index": index, "host": host, "port": port, "url": f"http://{host}:{port}",
            "hostname": socket.gethostname(), "pid": os.getpid(), "engine": name, "started": time.time(),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID")}
    publish = run.rollout_file(index, role)
    run.rendezvous.mkdir(parents=True, exist_ok=True)
    write_json_atomic(publish, info)
    log.info("%s server %d serving %s (engine %s, bound %s:%d)", role, index, info["url"], name,
             cfg.rollout.host, port)
    PHASES.mark("serving")
    if os.environ.get("HPC_RL_DEBUG") == "1" and PHASES.t0 is not None:
        log.info("start-up of %s server %d, seconds since the command: %s", role, index, PHASES.line())
    while not stop.wait(DONE_POLL_S):
        if run.done_file.exists():
            reason["why"] = "done.json"
            break
        if not publish.exists():  # the run's job was requeued (its preamble clears rendezvous/): join it again
            log.info("%s server %d: registration gone (the run restarted?); publishing it again", role, index)
            write_json_atomic(publish, info)
    log.info("%s server %d stopping (%s)", role, index, reason["why"])
    # Take no new work, deregister (no client picks this server up again), then drain.
    draining = engine is not None and reason["why"] != "done.json"
    if draining:
        service.draining = True
    mine = read_json(publish)
    if mine and mine.get("pid") == os.getpid():
        publish.unlink(missing_ok=True)
    if draining:
        if service.weight_gate.wait_idle(DRAIN_S):
            log.info("%s server %d drained: no generation in flight", role, index)
        else:
            log.warning("%s server %d: generations still running after %.0fs of draining; stopping anyway (the "
                        "trainer's client re-sends them)", role, index, DRAIN_S)
    httpd.shutdown()
    httpd.server_close()
    if engine is not None:
        engine.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpc_rl.rollout.server", description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True, help="the run directory (job.yaml, token, rendezvous/)")
    ap.add_argument("--index", type=int, required=True, help="this server's index K (rendezvous/rollout-K.json)")
    ap.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    ap.add_argument("--role", choices=["rollout", "reward", "teacher", "judge"], default="rollout",
                    help="reward: a reward node's server, the reward model only (rendezvous/reward-K.json); teacher, "
                    "judge: services.ROLE's model, no weights pushed (rendezvous/ROLE-K.json)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a rollout.* override of the run's job.yaml (a rollout job's own engine settings)")
    args = ap.parse_args(argv)
    _setup_logging()
    try:
        return serve(args.run_dir, args.index, args.device, args.role, args.overrides)
    except HpcRlError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
