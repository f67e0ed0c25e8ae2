"""Addresses and ports: what a node advertises to the others, and free ports."""

from __future__ import annotations

import ipaddress
import os
import socket


def free_port(host: str = "") -> int:
    """A TCP port that is free now (the OS picks it); never a hard-coded 29500."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def _route_address() -> str | None:
    """The source address the kernel would use to leave this host (no packet is sent by a UDP connect)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            addr = s.getsockname()[0]
            return None if _is_loopback(addr) else addr
    except OSError:
        return None


def advertise_host() -> str:
    """An address other nodes can reach: $HPC_RL_ADVERTISE_HOST, the node address the Slurm task found
    ($HPC_RL_NODE_ADDR), the hostname's IP, or the routed one."""
    for var in ("HPC_RL_ADVERTISE_HOST", "HPC_RL_NODE_ADDR"):
        if os.environ.get(var):
            return os.environ[var]
    try:
        addr = socket.gethostbyname(socket.gethostname())
        if not _is_loopback(addr):
            return addr
    except OSError:
        pass
    return _route_address() or "127.0.0.1"
