"""The clients a step's agents get: an `openai.AsyncOpenAI` per episode whose requests reach the agent front
in-process (no socket, the same routes, API key and JSON checks as over HTTP), made cheap because a toy's whole
generation is worth a few SDK calls (bench/agent_overhead.py measures the path against native generation).

Where the time went before (256 one-call episodes, 2 cores): the SDK's platform probe in a worker thread per new
client (~0.1 ms a call), httpx's cookie, redirect and auth handling of each request (~0.1 ms), the client's
construction (~0.05 ms), and GIL hand-offs to the front's wave threads at Python's 5 ms switch interval (waves left
~90 ms after their calls, the servers idle meanwhile).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
import threading

from ..rollout.wire import openai_api

# The GIL switch interval while episodes run (Python's default: 5 ms). See short_gil_turns.
GIL_TURN_S = 0.0005
_turns = {"users": 0, "previous": None}
_turns_lock = threading.Lock()


def in_process_client(front, timeout_s: float):
    """The httpx client (for the SDK's `http_client`) that hands each request to `front` (agent_front.AgentFront:
    `request` checks it, `aanswer` answers it) and its answer back as an httpx.Response.

    It skips httpx's client-side work: on loopback there are no cookies, redirects, auth flows, proxies or default
    headers to merge. Requests with files, form data or query parameters still get httpx's own build_request (the
    front refuses them as it would over HTTP)."""
    import httpx

    class FrontTransport(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            raw = await request.aread()
            status, body, work = front.request(request.method, request.url.path,
                                               request.headers.get("authorization", ""), raw)
            if work is not None:
                status, body = await front.aanswer(*work)
            data, kind = openai_api.encode(body)
            return httpx.Response(status, content=data, headers={"content-type": kind}, request=request)

    class InProcessClient(httpx.AsyncClient):
        def build_request(self, method, url, *, content=None, data=None, files=None, json=None, params=None,
                          headers=None, cookies=None, timeout=httpx.USE_CLIENT_DEFAULT, extensions=None):
            if data is not None or files is not None or params or cookies:
                return super().build_request(method, url, content=content, data=data, files=files, json=json,
                                             params=params, headers=headers, cookies=cookies, timeout=timeout,
                                             extensions=extensions)
            return httpx.Request(method, url, content=content, json=json, headers=headers, extensions=extensions)

        async def send(self, request: httpx.Request, *, stream: bool = False, **_) -> httpx.Response:
            return await self._transport.handle_async_request(request)

    return InProcessClient(transport=FrontTransport(), timeout=httpx.Timeout(timeout_s))


class EpisodeClients:
    """`clients(base_url)`: a new `openai.AsyncOpenAI` for one episode, on the step's shared httpx client.

    Each is a copy of one configured client with its own base URL, rather than a client built anew: construction
    parses and normalizes URLs and headers (~0.05 ms), and a new client probes the platform for its headers in a
    worker thread at its first request (~0.1 ms); the copies share the template's probe, done once here."""

    def __init__(self, http, api_key: str):
        import openai

        self.template = openai.AsyncOpenAI(base_url="http://127.0.0.1/", api_key=api_key, http_client=http,
                                           max_retries=0)
        if getattr(self.template, "_platform", 0) is None:  # the SDK's cache of its probe (none: nothing to share)
            self.template._platform = _sdk_platform()

    def __call__(self, base_url: str):
        client = copy.copy(self.template)  # the template's resources (client.chat, ...) are never made: none shared
        client.base_url = base_url.rstrip("/") + "/"
        return client


@functools.cache
def _sdk_platform():
    """What the openai SDK's platform probe finds (OS, architecture, runtime): it reads files, once per process."""
    from openai._base_client import get_platform

    return get_platform()


@contextlib.contextmanager
def short_gil_turns():
    """Shorter GIL turns while agents run. Their event loop runs the SDK's Python code for many calls without
    blocking, so each hand-off of the GIL to the front's wave threads (which send the calls to the servers and read
    their answers) waited the 5 ms default, many times per wave. Counted, so that overlapping users (training's and
    an evaluation's episodes) restore the interval once, when the last one ends."""
    with _turns_lock:
        if _turns["users"] == 0:
            _turns["previous"] = sys.getswitchinterval()
            sys.setswitchinterval(min(GIL_TURN_S, _turns["previous"]))
        _turns["users"] += 1
    try:
        yield
    finally:
        with _turns_lock:
            _turns["users"] -= 1
            if _turns["users"] == 0:
                sys.setswitchinterval(_turns["previous"])
