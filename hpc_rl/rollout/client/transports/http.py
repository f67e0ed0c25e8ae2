"""Weight sync over HTTP: each version in safetensors buckets, POST /weights?version=V&bucket=I&final=0|1 to every
server; the last bucket makes the server load the version whole (a failed or partial version is never loaded)."""

from __future__ import annotations

import io
from collections.abc import Iterable

import requests

from ....errors import RolloutError
from ....netutil import error_of
from ...wire.weights import bucket_bytes_of, buckets
from ..pool import Server
from ..routing import HTTPFailure, Router


class HttpTransport:
    name = "http"

    def __init__(self, router: Router):
        self.router = router

    def push(self, named_tensors: Iterable, version: int, servers: list[Server]) -> int:
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
                                         data=io.BytesIO(data), timeout=self.router.timeout_s,
                                         headers={"Content-Type": "application/octet-stream",
                                                  "Content-Length": str(len(data))})
                except requests.RequestException as e:
                    raise HTTPFailure(f"{type(e).__name__}: {str(e)[:200]}") from None
                if r.status_code >= 500:
                    raise HTTPFailure(f"HTTP {r.status_code}: {error_of(r)}")
                if r.status_code != 200:
                    raise RolloutError(f"push_weights v{version}: {srv.url} rejected bucket {i} "
                                       f"(HTTP {r.status_code}): {error_of(r)}")

            self.router.post_all(servers, send)
            cur, i = nxt, i + 1
        return total

    def close(self) -> None:
        pass
