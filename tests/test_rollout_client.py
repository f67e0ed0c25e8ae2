"""RolloutClient against two real servers: load balancing, failover after SIGKILL, error messages."""

import json
import logging
import os
import signal
import time

import pytest

from hpc_rl.config import TinyModelConfig
from hpc_rl.errors import RolloutError
from hpc_rl.models import load_causal_lm
from hpc_rl.models.tiny import build_tiny_model
from hpc_rl.rollout.client.rollout_client import RolloutClient
from hpc_rl.rollout.testing import make_run, spawn_server, stop_server, wait_rendezvous
from hpc_rl.rollout.wire.sampling import SamplingParams

pytestmark = pytest.mark.slow

CORPUS = [f"{i} * 3 = {3 * i}" for i in range(100)]
PROMPTS = [[5 + i, 6, 7 + (i % 3)] for i in range(6)]
PARAMS = SamplingParams(n=2, max_new_tokens=8, seed=123)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    base = tmp_path_factory.mktemp("rollout-client")
    model_dir = build_tiny_model(TinyModelConfig(), CORPUS, base / "tiny")
    run = make_run(base / "runs", model_dir, max_model_len=64, retries=1, request_timeout_s=30,
                   weight_sync="http")
    procs = [spawn_server(run, k) for k in range(2)]  # start both at once: startup dominates the runtime
    for k, p in enumerate(procs):
        wait_rendezvous(run, k, p)
    ns = type("Pair", (), {})()
    ns.run, ns.procs, ns.model_dir = run, procs, model_dir
    yield ns
    for p in procs:
        stop_server(p)


def client_for(run, **kw):
    from hpc_rl.config import load

    cfg = load(run.job_yaml, [f"rollout.{k}={v}" for k, v in kw.items()])
    return RolloutClient.from_run_dir(run, cfg)


def test_wait_ready_and_balanced_generate(pair):
    c = client_for(pair.run)
    c.wait_ready(2, timeout_s=30)
    res = c.generate(PROMPTS, PARAMS, step=0)
    assert len(res.outputs) == 6 and all(len(r) == 2 for r in res.outputs)
    assert res.policy_versions == [0] * 6 and res.tokens_per_s > 0 and res.seconds > 0
    assert c.generate(PROMPTS, PARAMS, step=0).outputs == res.outputs  # same seed, same samples
    # both servers did part of the work (contiguous chunks, one per server)
    for k in range(2):
        m = c.servers[k].session.get(c.servers[k].url + "/metrics", timeout=5).json()
        assert m["generate_requests"] == 2
    # the logprobs route agrees with the generated log-probs (same weights everywhere)
    s = res.outputs[4][1]
    lp = c.logprobs([PROMPTS[4] + s.token_ids], [len(PROMPTS[4])])
    assert lp[0] == pytest.approx(s.logprobs, abs=1e-5)
    pair.baseline = res.outputs
    c.close()


def test_push_weights_reaches_both_servers(pair):
    c = client_for(pair.run)
    c.wait_ready(2, timeout_s=30)
    m = load_causal_lm(pair.model_dir)
    stats = c.push_weights(list(m.state_dict().items()), version=1)  # the same weights, version 1
    assert stats["transport"] == "http"
    res = c.generate(PROMPTS, PARAMS, step=1)
    assert res.policy_versions == [1] * 6 and res.outputs == pair.baseline
    c.close()


def test_collective_push_survives_a_killed_server(pair, caplog):
    c = client_for(pair.run, weight_sync="collective")
    c.wait_ready(2, timeout_s=30)
    m = load_causal_lm(pair.model_dir)
    assert c.push_weights(list(m.state_dict().items()), version=2)["transport"] == "collective"
    for k in range(2):
        assert c.servers[k].session.get(c.servers[k].url + "/version", timeout=5).json()["policy_version"] == 2
    pair.procs[1].send_signal(signal.SIGKILL)
    pair.procs[1].wait(10)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="hpc_rl"):
        stats = c.push_weights(list(m.state_dict().items()), version=3)
    # the broken group is dropped at once (no wait for its timeout); this version goes over http
    assert stats["transport"] == "http" and time.monotonic() - t0 < 20
    assert any("collective failed" in r.getMessage() for r in caplog.records)
    assert c.servers[0].session.get(c.servers[0].url + "/version", timeout=5).json()["policy_version"] == 3
    assert not c.servers[1].healthy
    # the next push forms a new group with the living server only
    assert c.push_weights(list(m.state_dict().items()), version=4)["transport"] == "collective"
    assert c.weights.transports["collective"].sender.servers == [c.servers[0].url]
    assert c.generate(PROMPTS, PARAMS, step=4).policy_versions == [4] * 6

    # The launcher restarts the dead server: it serves stale (initial) weights, so it gets no work
    # until the next push, which it joins and which brings it to the current version.
    pair.procs[1] = spawn_server(pair.run, 1)
    wait_rendezvous(pair.run, 1, pair.procs[1])
    assert c.generate(PROMPTS, PARAMS, step=4).policy_versions == [4] * 6
    c.refresh()
    assert not c.servers[1].healthy
    with caplog.at_level(logging.INFO, logger="hpc_rl"):
        assert c.push_weights(list(m.state_dict().items()), version=5)["transport"] == "collective"
    assert any("rejoins" in r.getMessage() for r in caplog.records)
    assert sorted(c.weights.transports["collective"].sender.servers) == sorted(s.url for s in c.servers.values())
    assert c.servers[1].session.get(c.servers[1].url + "/version", timeout=5).json()["policy_version"] == 5
    res = c.generate(PROMPTS, PARAMS, step=5)
    assert res.policy_versions == [5] * 6 and res.outputs == pair.baseline
    m1 = c.servers[1].session.get(c.servers[1].url + "/metrics", timeout=5).json()
    assert m1["generate_requests"] >= 1  # the rejoined server took its share
    c.close()


def test_killed_server_work_moves_to_the_other(pair, caplog):
    pair.procs[1].send_signal(signal.SIGKILL)
    pair.procs[1].wait(10)
    dead_url = client_for(pair.run).servers[1].url
    c = client_for(pair.run)
    c.expected = 2
    with caplog.at_level(logging.WARNING, logger="hpc_rl"):
        res = c.generate(PROMPTS, PARAMS, step=2)
    # chunk boundaries and seeds do not depend on which server answers: the same samples as before
    assert res.outputs == pair.baseline
    assert any(dead_url in r.getMessage() for r in caplog.records)
    assert not c.servers[1].healthy
    c.close()
    # without retries the failed chunk is an error naming the dead server and the step
    c = client_for(pair.run, retries=0)
    c.expected = 2
    with pytest.raises(RolloutError) as ei:
        c.generate(PROMPTS, PARAMS, step=7)
    msg = str(ei.value)
    assert dead_url in msg and "step 7" in msg and "\n" not in msg
    c.close()


def test_registrations_that_are_not_servers_of_this_run_change_nothing(pair, caplog):
    """Garbage rendezvous files are skipped with one warning each; a registration whose address refuses this run's
    token (another run's server) is not counted in the chunking and a request to it fails over instead of failing
    the step."""
    import http.server
    import threading

    from hpc_rl.rollout.client.routing import HTTPFailure

    class Foreign(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(401)
            self.end_headers()

        do_POST = do_GET

        def log_message(self, *args):
            pass

    foreign = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Foreign)
    threading.Thread(target=foreign.serve_forever, daemon=True).start()
    rdv = pair.run.rendezvous
    forged = {"rollout-7.json": "{not json", "rollout-8.json": '["a list"]',
              "rollout-x.json": json.dumps({"url": "http://127.0.0.1:1"}),
              "rollout-6.json": json.dumps({"url": "ftp://nowhere", "index": 6}),
              "rollout-9.json": json.dumps({"url": f"http://127.0.0.1:{foreign.server_port}", "index": 9})}
    c = client_for(pair.run)
    c.wait_ready(1, timeout_s=30)
    c.expected = 2  # (server 1 was killed above: its chunk fails over to server 0, same boundaries and seeds)
    try:
        for name, text in forged.items():
            (rdv / name).write_text(text)
        with caplog.at_level(logging.WARNING, logger="hpc_rl"):
            c.refresh()
            c.refresh()
            res = c.generate(PROMPTS, PARAMS, step=1)
        warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ignoring ")]
        assert sorted(w.split()[1].rsplit("/", 1)[1].rstrip(":") for w in warned) == \
            ["rollout-6.json", "rollout-7.json", "rollout-8.json", "rollout-x.json"], warned
        assert res.outputs == pair.baseline and c.router.n_chunks() == 2
        assert not any("joined" in e for e in c.membership_events())
        with pytest.raises(HTTPFailure):
            c.router.post_json(c.servers[9], "/generate", {}, 5)
    finally:
        for name in forged:
            (rdv / name).unlink()
        foreign.shutdown()
        c.close()


def test_a_server_that_registers_mid_run_joins_at_the_next_push(pair, caplog):
    # (server 1 was killed above: server 0 serves alone)
    c = client_for(pair.run)
    c.wait_ready(1, timeout_s=30)
    m = load_causal_lm(pair.model_dir)
    c.push_weights(list(m.state_dict().items()), version=6)
    proc = spawn_server(pair.run, 5)
    try:
        wait_rendezvous(pair.run, 5, proc)
        c.refresh()
        assert not c.servers[5].healthy  # initial weights, older than version 6: no work before the next push
        assert c.generate(PROMPTS, PARAMS, step=6).policy_versions == [6] * 6
        c.push_weights(list(m.state_dict().items()), version=7)
        events = c.membership_events()
        assert any(e.startswith("rollout server 5 at ") and e.endswith(" joined") for e in events), events
        res = c.generate(PROMPTS, PARAMS, step=7)
        assert res.policy_versions == [7] * 6 and c.live_count() == 2
        m5 = c.servers[5].session.get(c.servers[5].url + "/metrics", timeout=5).json()
        assert m5["generate_requests"] >= 1  # the joined server took its share
        stop_server(proc)
        assert c.generate(PROMPTS, PARAMS, step=8).policy_versions == [7] * 6  # its chunk moved to server 0
        assert any("server 5" in e and " left " in e for e in c.membership_events())
    finally:
        stop_server(proc)
        c.close()


def test_split_weighted_by_hand():
    from hpc_rl.rollout.client.routing import split_contiguous, split_weighted

    assert split_weighted(10, [1, 1, 1]) == split_contiguous(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert split_weighted(10, [3, 1]) == [(0, 8), (8, 10)]  # 7.5 / 2.5: the tie goes to the first
    assert split_weighted(8, [300, 100]) == [(0, 6), (6, 8)]
    assert split_weighted(5, [100, 1, 1]) == [(0, 3), (3, 4), (4, 5)]  # none empty
    assert split_weighted(7, [0.1, 10]) == [(0, 1), (1, 7)]
    assert split_weighted(2, [1, 1, 1]) == [(0, 1), (1, 2)]  # fewer items than servers: one each


def test_a_joined_server_gets_work_by_its_measured_throughput(pair):
    """With a rollout job's server in the run (index beyond the job's own), chunk sizes follow each server's
    measured tokens/s; the per-server token counts come back for the step's metrics."""
    import threading

    proc = spawn_server(pair.run, 7)
    c = client_for(pair.run)
    try:
        wait_rendezvous(pair.run, 7, proc)
        c.wait_ready(1, timeout_s=30)  # server 0 of the job's own; 7 joins (before any push: at once)
        c.rejoin()
        assert sorted(s.index for s in c.healthy() if s.verified) == [0, 7] and c.elastic()
        prompts = [[5 + i, 6, 7] for i in range(8)]
        res = c.generate(prompts, PARAMS, step=1)  # unmeasured: equal shares
        assert set(res.server_tokens) == {0, 7} and sum(res.server_tokens.values()) == sum(
            len(s.token_ids) for row in res.outputs for s in row)
        assert c.servers[0].tokens_per_s > 0 and c.servers[7].tokens_per_s > 0
        assert c.take_server_tokens() == res.server_tokens and c.take_server_tokens() == {}
        c.servers[0].tokens_per_s, c.servers[7].tokens_per_s = 300.0, 100.0
        sizes, lock = [], threading.Lock()
        real = c.router.post_json

        def seen(srv, path, body, timeout):
            with lock:
                sizes.append((srv.index, len(body["prompt_token_ids"])))
            return real(srv, path, body, timeout)

        c.router.post_json = seen
        c.generate(prompts, PARAMS, step=2)
        assert sorted(sizes) == [(0, 6), (7, 2)]  # 3:1
    finally:
        stop_server(proc)
        c.close()


def test_wait_ready_timeout_names_missing_servers(pair):
    (pair.run.logs / "rollout-2.log").write_text("Traceback ...\nRuntimeError: CUDA out of memory\n")
    c = client_for(pair.run)
    c.layout = (2, 3, 1)  # the first rollout node, rollout.nodes, rollout.servers_per_node (JobConfig.server_layout)
    t0 = time.monotonic()
    with pytest.raises(RolloutError) as ei:
        c.wait_ready(3, timeout_s=2)
    assert time.monotonic() - t0 < 15
    msg = str(ei.value)
    host = json.loads(pair.run.rollout_file(1).read_text())["hostname"]
    # killed: its file is there but it does not answer
    assert f"server 1 (node {host}) at http://127.0.0.1:" in msg
    assert "server 2 (node index 4 of the job) wrote no rollout-2.json" in msg and "CUDA out of memory" in msg
    assert "127.0.0.1" in msg and "server 0" not in msg
    c.close()


def test_done_file_stops_the_server(pair):
    proc = pair.procs[0]
    pair.run.done_file.write_text('{"step": 3}')
    assert proc.wait(15) == 0
    assert not pair.run.rollout_file(0).exists()
    assert "stopping (done.json)" in (pair.run.logs / "rollout-0.log").read_text()
    assert os.path.exists(pair.run.rollout_file(1))  # SIGKILLed servers leave theirs

