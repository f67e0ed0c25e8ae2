"""The weight-sync transports, one module each, behind one interface: `push(named_tensors, version, servers) -> bytes`
sends one policy version to the servers given and `close()` lets go of what it holds (weight_push.py picks one)."""

from __future__ import annotations

from typing import Protocol


class Transport(Protocol):
    name: str

    def push(self, named_tensors, version: int, servers: list) -> int:
        """Send `version` to every server of `servers` (a failing one is taken out of the list and of rotation);
        the bytes sent."""

    def close(self) -> None:
        """Release what the transport holds (a collective group)."""
