"""One answer to "which address do other nodes reach this node by": with HPC_RL_NODE_ADDR set (the Slurm task
sets it per node) and a hostname that resolves to loopback, the trainer master, a real rollout server and the
weight-sync group all advertise that address, and the group really forms there."""

from __future__ import annotations

import socket

import pytest

from hpc_rl import launch, netutil
from hpc_rl.config import load
from hpc_rl.models import load_causal_lm
from hpc_rl.rollout.client.rollout_client import RolloutClient
from hpc_rl.rollout.testing import make_run, start_server, stop_server

pytestmark = pytest.mark.slow

# A loopback address no machine-derived answer would give (node_address never returns 127.0.0.2), but one
# that works on every Linux machine: the server binds all interfaces, so it is reachable there.
NODE_ADDR = "127.0.0.2"


@pytest.fixture
def loopback_hostname(monkeypatch):
    """This process's hostname resolves to loopback (as on hosts whose /etc/hosts maps it to 127.0.1.1)."""
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    monkeypatch.delenv(netutil.ADVERTISE_ENV, raising=False)


def test_node_address_ignores_a_loopback_hostname(loopback_hostname, monkeypatch):
    monkeypatch.delenv(netutil.NODE_ADDR_ENV, raising=False)
    addr, _ = netutil.node_address()
    others = [ip for ip in netutil.interfaces().values() if not netutil.is_loopback(ip)]
    assert addr in others if others else addr == "127.0.0.1"
    monkeypatch.setenv(netutil.NODE_ADDR_ENV, NODE_ADDR)
    assert netutil.advertise_host() == NODE_ADDR
    assert netutil.advertise_host("10.1.2.3") == "10.1.2.3"  # bound to one address: only that one works


def test_master_server_and_weight_sync_group_use_node_addr(loopback_hostname, monkeypatch, tmp_path, tiny_model):
    monkeypatch.setenv(netutil.NODE_ADDR_ENV, NODE_ADDR)
    run = make_run(tmp_path / "runs", tiny_model, host="0.0.0.0", max_model_len=64, weight_sync="collective",
                   request_timeout_s=60)
    assert launch.publish_master(run)["addr"] == NODE_ADDR

    proc, info = start_server(run, 0, env={netutil.NODE_ADDR_ENV: NODE_ADDR})
    try:
        assert info["host"] == NODE_ADDR and info["url"].startswith(f"http://{NODE_ADDR}:")
        client = RolloutClient.from_run_dir(run, load(run.job_yaml))
        client.wait_ready(1, timeout_s=60)
        model = load_causal_lm(tiny_model)
        res = client.push_weights(list(model.state_dict().items()), version=1)
        assert res["transport"] == "collective"
        sender = client.weights.transports["collective"].sender
        assert sender.master_addr == NODE_ADDR  # rank 0 of the group advertised the node address
        joined = f"joining the group at {NODE_ADDR}:{sender.master_port} as rank 1"
        assert joined in (run.logs / "rollout-0.log").read_text()  # ... and the server dialled it there
        client.close()
    finally:
        stop_server(proc)
