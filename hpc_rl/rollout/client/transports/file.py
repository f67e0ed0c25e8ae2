"""Weight sync through the shared filesystem: each version written once under RUN/weights/vV/ (safetensors), then
POST /weights/load_file to every server, which loads it from there; older versions are pruned."""

from __future__ import annotations

from collections.abc import Iterable

from ...wire.weights import prune_versions, write_version
from ..pool import Server
from ..routing import Router


class FileTransport:
    name = "file"

    def __init__(self, router: Router):
        self.router = router

    def push(self, named_tensors: Iterable, version: int, servers: list[Server]) -> int:
        run = self.router.pool.run
        folder, nbytes = write_version(run.weights, version, named_tensors)

        def send(srv: Server):
            self.router.post_json(srv, "/weights/load_file", {"path": str(folder), "version": version},
                                  self.router.timeout_s)

        self.router.post_all(servers, send)
        prune_versions(run.weights, keep=version)
        return nbytes

    def close(self) -> None:
        pass
