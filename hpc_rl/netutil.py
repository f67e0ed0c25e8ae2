"""Networking shared by every process: this node's address (launcher, trainer master, rollout server and
weight-sync group all ask here "which address do the other nodes reach me by?"), free ports, and the
authenticated HTTP session the trainer's clients talk to rollout servers with."""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

import requests

# Set by a user to force the advertised address (e.g. a node's InfiniBand IP name).
ADVERTISE_ENV = "HPC_RL_ADVERTISE_HOST"
# Set per node by the Slurm task (cluster/env.py) before any process starts, so all of them agree.
NODE_ADDR_ENV = "HPC_RL_NODE_ADDR"
_SIOCGIFADDR = 0x8915


def free_port(host: str = "") -> int:
    """A TCP port that is free now (the OS picks it); never a hard-coded 29500."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def interface_ipv4(name: str) -> str | None:
    """IPv4 address of interface `name` (SIOCGIFADDR), or None when it has none."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        res = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(res[20:24])
    except OSError:
        return None
    finally:
        s.close()


def interfaces() -> dict[str, str]:
    """{interface name: IPv4 address} of this node (network namespace), loopback included."""
    out = {}
    for _, name in socket.if_nameindex():
        addr = interface_ipv4(name)
        if addr:
            out[name] = addr
    return out


def node_address() -> tuple[str, str | None]:
    """(IPv4, interface) other nodes reach this node by, found from the machine alone: the hostname's address
    when an interface holds it, else the first non-loopback interface (hosts whose name resolves to 127.0.1.1),
    else loopback. No packet is sent."""
    ifaces = interfaces()
    try:
        addr = socket.gethostbyname(socket.gethostname())
    except OSError:
        addr = None
    for name, ip in ifaces.items():
        if ip == addr and not is_loopback(ip):
            return ip, name
    for name, ip in sorted(ifaces.items()):
        if not is_loopback(ip):
            return ip, name
    return "127.0.0.1", "lo" if "lo" in ifaces else None


def advertise_host(bind_host: str = "0.0.0.0") -> str:
    """The address to publish for a socket bound to `bind_host`: $HPC_RL_ADVERTISE_HOST, else the bind address
    itself when it is one address (only that one works), else $HPC_RL_NODE_ADDR, else node_address()."""
    if os.environ.get(ADVERTISE_ENV):
        return os.environ[ADVERTISE_ENV]
    if bind_host not in ("0.0.0.0", "::", ""):
        return bind_host
    return os.environ.get(NODE_ADDR_ENV) or node_address()[0]


def auth_session(token: str) -> requests.Session:
    """A session that sends the run's token on every request and never goes through a user's HTTP proxy
    (rollout servers are cluster-internal; $http_proxy would route them through a login node)."""
    s = requests.Session()
    s.headers["Authorization"] = f"Bearer {token}"
    s.trust_env = False
    return s


def error_of(resp: requests.Response) -> str:
    """A rollout server's one-line reason for a non-200 answer: its JSON "error", else the body, else the code."""
    try:
        err = resp.json().get("error", resp.text[:200])
        return str(err.get("message", err) if isinstance(err, dict) else err)  # OpenAI's shape on /v1/ routes
    except (ValueError, AttributeError):
        return resp.text[:200].strip() or f"HTTP {resp.status_code}"
