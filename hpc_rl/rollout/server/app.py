"""The rollout server's HTTP API on FastAPI + uvicorn; bodies and limits are in wire/protocol.py.

The token and the body size are checked by an ASGI guard from the headers alone, before the app reads a byte
of the body (401/411/413 cost nothing, and a multi-GB weight push without the token is never received).
Handlers are async. Generation and log-prob endpoints await the engine (on its own event loop for vLLM, where
the server then serves; in a worker thread for the HF engine); weight loads and the weight-sync routes block, so
they run in the thread pool. /health keeps answering while either runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import socket
import threading
from urllib.parse import parse_qs

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from ...errors import HpcRlError, first_line
from ..wire import openai_api, protocol
from ..wire.protocol import NOT_FINITE_KIND, BadRequest, Busy, Draining, PolicyNotFinite

log = logging.getLogger("hpc_rl")

UNAUTHORIZED = ("Authorization: missing or wrong bearer token; send the run's token (RUN/token) as "
                "'Authorization: Bearer <token>'")
# A trainer step can leave a pooled connection idle for minutes; the server must not close it under the client.
KEEP_ALIVE_S = 24 * 3600


# How often a request in progress checks whether its client is still there.
DISCONNECT_POLL_S = 0.2


def json_response(obj, status: int = 200, close: bool = False, headers: dict | None = None) -> Response:
    """JSON as the stdlib writes it (NaN/inf allowed: a -inf log-prob is data, not an error)."""
    headers = {**({"connection": "close"} if close else {}), **(headers or {})}
    return Response(json.dumps(obj), status_code=status, media_type="application/json", headers=headers or None)


def openai_response(obj: dict) -> Response:
    """A completion: one JSON object, or the server-sent events of a streamed request."""
    data, kind = openai_api.encode(obj)
    streamed = kind == "text/event-stream"
    return Response(data, media_type=kind, headers={"cache-control": "no-cache"} if streamed else None)


# The OpenAI-compatible routes answer errors in OpenAI's shape ({"error": {"message", "type", "code"}}): the SDK puts
# error.message in its exception; the other routes answer {"error": "one line"}, which hpc-rl's clients read.
OPENAI_PATHS = ("/v1/models", "/v1/completions", "/v1/chat/completions")


def error_json(path: str, status: int, message: str, **extra) -> dict:
    """The error body of `path`: OpenAI's shape on the OpenAI-compatible routes, {"error": message} elsewhere."""
    if path.rstrip("/") in OPENAI_PATHS:
        return openai_api.error_body(status, message, **extra)
    return {"error": message, **extra}


class Guard:
    """ASGI middleware: 401 without the run's token, 411 for chunked bodies, 413 past the route's size limit;
    all decided from the headers, before the body is read (the connection is then closed)."""

    def __init__(self, app, service, token: str):
        self.app, self.service, self.want = app, service, f"Bearer {token}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.service.count("requests")
        headers = dict(scope["headers"])
        if not hmac.compare_digest(headers.get(b"authorization", b""), self.want):
            return await _reject(send, scope, 401, UNAUTHORIZED)
        if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            return await _reject(send, scope, 411,
                                 "Content-Length: chunked bodies are not accepted; send Content-Length")
        try:
            n = int(headers.get(b"content-length", b"0") or 0)
        except ValueError:
            return await _reject(send, scope, 400, "Content-Length: not an integer")
        path = scope["path"]
        limit = protocol.MAX_WEIGHTS_BYTES if path.rstrip("/") == "/weights" else protocol.MAX_JSON_BYTES
        if n > limit:
            return await _reject(send, scope, 413, f"body: {n} bytes exceed the limit of {limit} bytes for {path}")
        await self.app(scope, receive, send)


async def _reject(send, scope, status: int, error: str) -> None:
    data = json.dumps(error_json(scope["path"], status, error)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": data})


async def _json_body(request: Request, empty_ok: bool = False):
    raw = await request.body()
    if empty_ok and not raw:
        return None
    return protocol.load_json(raw)


class ClientGone(Exception):
    """The client closed the connection before the answer: its work was stopped."""


async def until_disconnect(request: Request, work) -> dict:
    """Run `work(cancel)` (a coroutine function) until it finishes or the client goes away (disconnect, or its
    timeout closing the connection); then the task is cancelled (engines on their own loop abort the request) and
    `cancel` is set (engines computing in a thread stop at their next decode step), so the server is free again."""
    cancel = threading.Event()
    task = asyncio.ensure_future(work(cancel))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone(f"{request.method} {request.url.path}: the client went away; its work was stopped")
    finally:
        if not task.done():
            cancel.set()
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


def weights_query(query: str) -> tuple[int, int, bool]:
    """(version, bucket, final) of POST /weights?version=V&bucket=I&final=0|1; BadRequest naming the field."""
    q = parse_qs(query)

    def get(name: str, default=None):
        v = q.get(name, [default])[0]
        if v is None:
            raise BadRequest(f"{name}: missing query parameter; POST /weights?version=V&bucket=I&final=0|1")
        return v

    try:
        version = int(get("version"))
    except ValueError:
        raise BadRequest("version: expected an integer query parameter") from None
    try:
        bucket = int(get("bucket", "0"))
    except ValueError:
        raise BadRequest("bucket: expected an integer query parameter") from None
    final_s = get("final", "0").lower()
    if final_s not in ("0", "1", "true", "false"):
        raise BadRequest("final: expected 0/1 or true/false")
    if bucket < 0 or version < 0:
        raise BadRequest("bucket/version: must be >= 0")
    return version, bucket, final_s in ("1", "true")


def make_router(service) -> APIRouter:
    """Every endpoint of the rollout API, the weight-sync routes (service.routes) included."""
    r = APIRouter()

    def call(fn, *args):
        return run_in_threadpool(fn, *args)

    @r.get("/health")
    async def health():
        return json_response(service.health())

    @r.get("/metrics")
    async def metrics():
        return json_response(service.metrics())

    if getattr(service, "engine", None) is not None:  # a reward server (reward nodes) only scores
        _engine_routes(r, service, call)
    for (method, path), fn in service.routes.items():
        r.add_api_route(path, _json_route(fn, call, method), methods=[method])
    return r


def _engine_routes(r: APIRouter, service, call) -> None:
    """Generation, log-probs and weight loads: the endpoints of a server with an engine."""

    @r.get("/version")
    async def version():
        return json_response({"policy_version": service.policy_version})

    @r.post("/generate")
    async def generate(request: Request):
        body = await _json_body(request)
        return json_response(await until_disconnect(request, lambda cancel: service.generate(body, cancel)))

    @r.post("/v1/completions")
    async def completions(request: Request):
        body = await _json_body(request)
        return openai_response(await until_disconnect(request, lambda cancel: service.completions(body, cancel)))

    @r.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _json_body(request)
        return openai_response(await until_disconnect(request,
                                                      lambda cancel: service.chat_completions(body, cancel)))

    @r.get("/v1/models")
    async def models():
        return json_response(service.models())

    @r.post("/logprobs")
    async def logprobs(request: Request):
        body = await _json_body(request)
        return json_response(await until_disconnect(request, lambda cancel: service.logprobs(body, cancel)))

    @r.post("/weights/load_file")
    async def load_file(request: Request):
        return json_response(await call(service.load_file, await _json_body(request)))

    @r.post("/weights")
    async def weights(request: Request):
        version, bucket, final = weights_query(request.url.query)
        return json_response(await call(service.push_bucket, await request.body(), version, bucket, final))


def _json_route(fn, call, method: str):
    async def endpoint(request: Request):
        body = await _json_body(request, empty_ok=True) if method == "POST" else None
        return json_response(await call(fn, body))

    return endpoint


def make_app(service, token: str) -> Guard:
    """The rollout server's ASGI app: the FastAPI router and one-line JSON errors, behind the guard."""
    app = FastAPI(title="hpc-rl rollout server", docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(make_router(service))

    @app.exception_handler(BadRequest)
    @app.exception_handler(HpcRlError)
    async def bad_request(request: Request, e: Exception):
        service.count("errors")
        log.warning("%s %s: 400 %s", request.method, request.url.path, first_line(e))
        return json_response(error_json(request.url.path, 400, first_line(e)), 400)

    @app.exception_handler(PolicyNotFinite)
    async def not_finite(request: Request, e: PolicyNotFinite):
        log.error("%s %s: 422 %s", request.method, request.url.path, first_line(e))
        return json_response(error_json(request.url.path, 422, first_line(e), error_kind=NOT_FINITE_KIND,
                                        policy_version=getattr(e, "version", None)), 422)

    @app.exception_handler(Draining)
    async def draining(request: Request, e: Exception):
        return json_response(error_json(request.url.path, 503, f"{request.method} {request.url.path}: {e}"), 503)

    @app.exception_handler(Busy)
    async def busy(request: Request, e: Busy):
        return json_response(error_json(request.url.path, 429, f"{request.method} {request.url.path}: {e}"), 429,
                             headers={"retry-after": str(max(1, round(e.retry_after_s)))})

    @app.exception_handler(ClientGone)
    async def gone(request: Request, e: Exception):
        log.info("%s", e)
        return json_response(error_json(request.url.path, 499, str(e)), 499, close=True)  # nobody reads it

    @app.exception_handler(HTTPException)
    async def no_route(request: Request, e: HTTPException):
        what = "no such endpoint" if e.status_code == 404 else str(e.detail)
        return json_response(error_json(request.url.path, e.status_code, f"{request.method} {request.url.path}: {what}"),
                             e.status_code)

    @app.exception_handler(Exception)
    async def bug(request: Request, e: Exception):  # keep serving, say what broke
        service.count("errors")
        log.error("%s %s failed", request.method, request.url.path, exc_info=e)
        return json_response(error_json(request.url.path, 500, f"{type(e).__name__}: {first_line(e)}"), 500)

    return Guard(app, service, token)


class HttpServer:
    """uvicorn on a socket bound up front (port 0: a free one, known before serving); the stdlib server's
    serve_forever / shutdown / server_close / server_address, so callers run it in a thread alike. With `loop`
    (a running event loop, e.g. the vLLM engine's) uvicorn serves on that loop instead of one of its own."""

    def __init__(self, app, sock: socket.socket, loop: asyncio.AbstractEventLoop | None = None):
        self._sock = sock
        self._loop = loop
        self.server_address = sock.getsockname()[:2]
        debug = os.environ.get("HPC_RL_DEBUG") == "1"
        config = uvicorn.Config(app, log_config=None, log_level="debug" if debug else "warning", access_log=debug,
                                lifespan="off", timeout_keep_alive=KEEP_ALIVE_S, server_header=False)
        self._server = uvicorn.Server(config)
        self._done = threading.Event()

    def serve_forever(self) -> None:
        try:
            if self._loop is None:
                self._server.run(sockets=[self._sock])
            else:
                asyncio.run_coroutine_threadsafe(self._server.serve(sockets=[self._sock]), self._loop).result()
        finally:
            self._done.set()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        self._done.wait(timeout_s)

    def server_close(self) -> None:
        self._sock.close()


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (IPv6 when host has a colon); OSError when it cannot bind."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock
