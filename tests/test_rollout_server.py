"""The real rollout server as a subprocess on 127.0.0.1: API, auth, limits, and both weight transports."""

import http.client
import json
import math
import signal
import time
from urllib.parse import urlsplit

import pytest
import requests
import torch
from safetensors.torch import save

from hpc_rl.config import TinyModelConfig
from hpc_rl.data.toy import LOOKUP_CHAT_TEMPLATE
from hpc_rl.errors import RolloutError
from hpc_rl.models import load_causal_lm
from hpc_rl.models.tiny import build_tiny_model
from hpc_rl.rollout.client.rollout_client import RolloutClient
from hpc_rl.rollout.testing import make_run, start_server, stop_server
from tests import server_abuse
from tests.logprob_checks import local_logprobs, perturbed, served_logprobs

pytestmark = pytest.mark.slow

CORPUS = [f"{i} + {i} = {2 * i}" for i in range(100)]
# fp32 on both sides; the server batches (right-padded) while the test runs one unpadded sequence.
TOL = 1e-5


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    base = tmp_path_factory.mktemp("rollout-server")
    model_dir = build_tiny_model(TinyModelConfig(), CORPUS, base / "tiny", chat_template=LOOKUP_CHAT_TEMPLATE)
    run = make_run(base / "runs", model_dir, max_model_len=32, weight_sync="http", max_samples_per_request=512)
    t0 = time.monotonic()
    proc, info = start_server(run, 0, timeout_s=120)
    s = requests.Session()
    s.headers["Authorization"] = "Bearer " + run.read_token()
    ns = type("Srv", (), {})()
    ns.run, ns.proc, ns.info, ns.url, ns.s, ns.model_dir = run, proc, info, info["url"], s, model_dir
    ns.startup_s = time.monotonic() - t0
    yield ns
    stop_server(proc)


def test_rendezvous_and_health(srv):
    assert srv.startup_s < 120
    info = srv.info
    assert info["index"] == 0 and info["host"] == "127.0.0.1" and info["engine"] == "hf"
    assert info["url"] == f"http://127.0.0.1:{info['port']}" and info["pid"] == srv.proc.pid
    assert srv.run.rollout_file(0).stat().st_mode & 0o777  # written atomically, readable
    h = srv.s.get(srv.url + "/health", timeout=5).json()
    assert h["status"] == "ok" and h["engine"] == "hf" and h["model"] == str(srv.model_dir)
    assert isinstance(h["policy_version"], int)
    log = (srv.run.logs / "rollout-0.log").read_text()
    assert "bound to 127.0.0.1" in log  # the loud warning


def test_generate(srv):
    body = {"prompt_token_ids": [[5, 6, 7], [8, 9]], "n": 3, "max_new_tokens": 10, "temperature": 1.0,
            "top_p": 1.0, "top_k": -1, "stop_token_ids": [], "seed": 11}
    r = srv.s.post(srv.url + "/generate", json=body, timeout=30)
    assert r.status_code == 200, r.text
    res = r.json()
    assert isinstance(res["policy_version"], int)
    assert len(res["outputs"]) == 2 and all(len(row) == 3 for row in res["outputs"])
    for row in res["outputs"]:
        for s in row:
            assert len(s["token_ids"]) == len(s["logprobs"]) and 1 <= len(s["token_ids"]) <= 10
            assert s["finish_reason"] in ("stop", "length")
            assert all(math.isfinite(x) and x <= 0 for x in s["logprobs"])
    again = srv.s.post(srv.url + "/generate", json=body, timeout=30).json()
    assert again["outputs"] == res["outputs"]
    other = srv.s.post(srv.url + "/generate", json={**body, "seed": 12}, timeout=30).json()
    assert other["outputs"] != res["outputs"]


def test_bad_requests_are_400_naming_the_field(srv):
    long = {"prompt_token_ids": [[5], list(range(1, 30))], "max_new_tokens": 8}
    r = srv.s.post(srv.url + "/generate", json=long, timeout=10)
    assert r.status_code == 400 and "prompt_token_ids[1]" in r.json()["error"]
    assert "max_model_len 32" in r.json()["error"]
    r = srv.s.post(srv.url + "/generate", json={"n": 2}, timeout=10)
    assert r.status_code == 400 and r.json()["error"].startswith("prompt_token_ids")
    r = srv.s.post(srv.url + "/generate", data=b"{not json", timeout=10)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    r = srv.s.post(srv.url + "/logprobs", json={"token_ids": [[1, 2]]}, timeout=10)
    assert r.status_code == 400 and r.json()["error"].startswith("prompt_lens")
    r = srv.s.post(srv.url + "/weights?bucket=0&final=1", data=b"x", timeout=10)
    assert r.status_code == 400 and r.json()["error"].startswith("version")
    assert srv.s.get(srv.url + "/nope", timeout=5).status_code == 404


def test_logprobs_equal_local_model(srv):
    # this runs before any weight push: the served weights are the folder's
    assert srv.s.get(srv.url + "/version", timeout=5).json()["policy_version"] == 0
    want = local_logprobs(load_causal_lm(srv.model_dir).eval())
    assert served_logprobs(srv.url, srv.s, 30)[0] == pytest.approx(want[0], abs=TOL)
    assert served_logprobs(srv.url, srv.s, 30)[1] == pytest.approx(want[1], abs=TOL)


ENDPOINTS = [("GET", "/health"), ("GET", "/version"), ("GET", "/metrics"), ("POST", "/generate"),
             ("POST", "/logprobs"), ("POST", "/weights?version=99&bucket=0&final=1"),
             ("POST", "/weights/load_file"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
             ("GET", "/v1/models"), ("GET", "/collective/info"),
             ("POST", "/collective/join"), ("POST", "/collective/update"), ("GET", "/collective/status"),
             ("POST", "/collective/wait"), ("POST", "/collective/close")]


def test_multi_turn_logprobs_equal_the_trainers(srv):
    """A multi-turn sample (assistant turns from the HF engine, tool observations between them, masked): the
    trainer's log-probs of its assistant tokens equal the engine's."""
    from tests.logprob_checks import multi_turn_check

    diff, trajs = multi_turn_check(srv.run, srv.model_dir, max_model_len=32)
    assert any(0 in t.mask for t in trajs)
    assert diff < TOL, diff


def test_multi_turn_tool_timeout_ends_the_trajectory(srv):
    """An environment step past rollout.tool_timeout_s ends its trajectory as truncated, counted as a tool error; the
    loop does not wait for it."""
    from hpc_rl.models import load_tokenizer
    from hpc_rl.orchestrator.multi_turn import Limits, MultiTurnRollout
    from hpc_rl.rollout.environments.tools import ToolContext
    from hpc_rl.rollout.wire.sampling import SamplingParams
    from tests.envs import SlowEnv

    tok = load_tokenizer(str(srv.model_dir))
    loop = MultiTurnRollout(SlowEnv, {"sleep_s": 3.0}, tok, RolloutClient(srv.run, srv.run.read_token()),
                            Limits(3, 24, 0.5, 3, 32), ToolContext())
    t0 = time.monotonic()
    trajs, stats = loop.run([{"id": i, "prompt": f"{i} + {i} ="} for i in range(4)], SamplingParams(max_new_tokens=3), 0)
    assert time.monotonic() - t0 < 2.5
    assert stats["tool_errors"] == 4 and stats["truncated_fraction"] == 1.0 and stats["turns_per_sample"] == 1.0
    assert all(t.mask == [1] * len(t.response_ids) for t in trajs)


def test_auth_required_everywhere(srv):
    before = srv.s.get(srv.url + "/metrics", timeout=5).json()
    bucket = save({"lm_head.weight": torch.zeros(64, 128)})
    for method, path in ENDPOINTS:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic " + srv.run.read_token()}):
            r = requests.request(method, srv.url + path, headers=headers, timeout=10,
                                 data=bucket if "weights?" in path else b'{"prompt_token_ids": [[1]]}')
            assert r.status_code == 401, (method, path, headers)
            assert "Authorization" in server_abuse.error(r)
    after = srv.s.get(srv.url + "/metrics", timeout=5).json()
    assert after["policy_version"] == before["policy_version"]  # the zero lm_head bucket was not loaded
    assert after["generate_requests"] == before["generate_requests"]
    assert after["weight_updates"] == before["weight_updates"]


def raw_post(url, path, headers):
    """Send only headers (a huge Content-Length, no body): the server must answer without reading."""
    u = urlsplit(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    c.putrequest("POST", path)
    for k, v in headers.items():
        c.putheader(k, v)
    c.endheaders()
    r = c.getresponse()
    body = json.loads(r.read())
    c.close()
    return r.status, body


def test_oversize_bodies_are_413(srv):
    auth = {"Authorization": "Bearer " + srv.run.read_token()}
    status, body = raw_post(srv.url, "/generate", {**auth, "Content-Length": str(64 * 2**20 + 1)})
    assert status == 413 and "exceed" in body["error"]
    status, body = raw_post(srv.url, "/weights?version=1&bucket=0&final=1", {**auth, "Content-Length": str(2**40)})
    assert status == 413
    # without the token the size does not matter: 401 first
    status, _ = raw_post(srv.url, "/generate", {"Content-Length": str(2**40)})
    assert status == 401


def push_http(srv, tensors, version, bucket=0, final=1):
    return srv.s.post(f"{srv.url}/weights?version={version}&bucket={bucket}&final={final}",
                      data=save(tensors), timeout=60)


def test_weight_push_http_and_file(srv):
    client = RolloutClient(srv.run, srv.run.read_token(), timeout_s=60, retries=0, weight_sync="http")
    m1 = perturbed(srv.model_dir, 1)
    stats = client.push_weights(m1.state_dict().items(), version=1)
    assert stats["transport"] == "http" and stats["bytes"] > 1_000_000
    assert srv.s.get(srv.url + "/version", timeout=5).json()["policy_version"] == 1
    want = local_logprobs(m1)
    got = served_logprobs(srv.url, srv.s, 30)
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=TOL)
    base = local_logprobs(load_causal_lm(srv.model_dir).eval())
    assert abs(got[0][0] - base[0][0]) > 1e-3  # the perturbation is visible

    client.weight_sync = "file"
    m2 = perturbed(srv.model_dir, 2)
    # bf16 tensors on the wire: the server casts to its fp32 weights
    stats = client.push_weights(((k, v.to(torch.bfloat16)) for k, v in m2.state_dict().items()), version=2)
    assert stats["transport"] == "file"
    assert sorted(p.name for p in srv.run.weights.iterdir()) == ["v2"]
    assert srv.s.get(srv.url + "/version", timeout=5).json()["policy_version"] == 2
    with torch.no_grad():  # round the parameters only (module.to would also round rotary buffers)
        for p in m2.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    want = local_logprobs(m2)
    for g, w in zip(served_logprobs(srv.url, srv.s, 30), want):
        assert g == pytest.approx(w, abs=TOL)
    client.close()


def test_openai_completions(srv):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(srv.model_dir)
    body = {"model": "whatever", "prompt": "3 + 3 =", "max_tokens": 6, "n": 3, "seed": 5, "logprobs": 0}
    r = srv.s.post(srv.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    res = r.json()
    assert res["object"] == "text_completion" and len(res["choices"]) == 3
    assert [c["index"] for c in res["choices"]] == [0, 1, 2]
    prompt_ids = tok("3 + 3 =", add_special_tokens=False)["input_ids"]
    assert res["usage"]["prompt_tokens"] == len(prompt_ids)
    assert res["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in res["choices"])
    # token ids as the prompt give the same samples (same seed); the log-probs are the sampled tokens' own
    r2 = srv.s.post(srv.url + "/v1/completions", json={**body, "prompt": prompt_ids}, timeout=30).json()
    assert [c["text"] for c in r2["choices"]] == [c["text"] for c in res["choices"]]
    c = res["choices"][0]
    assert c["finish_reason"] in ("stop", "length") and len(c["logprobs"]["token_logprobs"]) <= 6
    assert all(math.isfinite(x) and x <= 0 for x in c["logprobs"]["token_logprobs"])
    assert c["logprobs"]["text_offset"][0] == 0
    r = srv.s.post(srv.url + "/v1/completions", json={"prompt": "3 +", "logprobs": 5}, timeout=10)
    assert r.status_code == 400 and server_abuse.error(r).startswith("logprobs")
    r = srv.s.post(srv.url + "/v1/completions", json={"prompt": "3 +", "max_tokens": 40}, timeout=10)
    assert r.status_code == 400 and "max_tokens 40" in server_abuse.error(r)
    r = srv.s.post(srv.url + "/v1/completions", json={"prompt": "3 +", "best_of": 2}, timeout=10)
    assert r.status_code == 400 and server_abuse.error(r).startswith("best_of")


def _engine_sample(srv, prompt_ids: list[int], seed: int, max_new_tokens: int, eos: int) -> dict:
    """What /generate (the trainer's path) samples for one prompt with these settings."""
    body = {"prompt_token_ids": [prompt_ids], "n": 1, "max_new_tokens": max_new_tokens, "temperature": 1.0,
            "top_p": 1.0, "top_k": -1, "stop_token_ids": [eos], "seed": seed}
    r = srv.s.post(srv.url + "/generate", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["outputs"][0][0]


def test_the_openai_sdk_gets_the_engines_exact_tokens(srv):
    """The real openai SDK against the server: /v1/models lists the policy; completions and chat (the tokenizer's
    chat template) return the prompt's and the sample's token ids and log-probs, equal to what /generate samples
    for those token ids with the same seed: an agent's calls can be trained on exactly."""
    from openai import OpenAI
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(srv.model_dir)
    client = OpenAI(base_url=srv.url + "/v1", api_key=srv.run.read_token(), max_retries=0, timeout=30)
    (model,) = client.models.list().data
    version = srv.s.get(srv.url + "/version", timeout=5).json()["policy_version"]  # earlier tests pushed weights
    assert model.id == str(srv.model_dir) and model.model_extra["policy_version"] == version

    c = client.completions.create(model="any name", prompt="4 + 4 =", max_tokens=6, seed=21, logprobs=0,
                                  extra_body={"return_token_ids": True})
    (choice,) = c.choices
    extra = choice.model_extra
    assert extra["prompt_token_ids"] == tok("4 + 4 =", add_special_tokens=False)["input_ids"]
    want = _engine_sample(srv, extra["prompt_token_ids"], 21, 6, tok.eos_token_id)
    assert extra["token_ids"] == want["token_ids"] and choice.logprobs.token_logprobs == want["logprobs"]
    assert choice.text == tok.decode(want["token_ids"], skip_special_tokens=True)
    assert c.usage.completion_tokens == len(want["token_ids"]) and c.model_extra["policy_version"] == version

    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "5 + 5 ="},
                {"role": "assistant", "content": "10"}, {"role": "user", "content": [{"type": "text", "text": "6 +"},
                                                                                   {"type": "text", "text": " 6 ="}]}]
    chat = client.chat.completions.create(model="x", messages=messages, max_tokens=5, seed=8, logprobs=True, n=2,
                                          extra_body={"return_token_ids": True})
    flat = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else "6 + 6 ="}
            for m in messages]
    prompt_ids = tok(tok.apply_chat_template(flat, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
    assert chat.object == "chat.completion" and chat.model_extra["prompt_token_ids"] == prompt_ids
    assert chat.usage.prompt_tokens == len(prompt_ids) and len(chat.choices) == 2
    for j, ch in enumerate(chat.choices):
        want = _engine_sample(srv, prompt_ids, 8 + j, 5, tok.eos_token_id)  # sample j of a request: seed + j
        assert ch.model_extra["token_ids"] == want["token_ids"]
        # n=2 computes both samples in one batch: the same tokens, log-probs equal to float32's rounding
        assert [x.logprob for x in ch.logprobs.content] == pytest.approx(want["logprobs"], abs=TOL)
        assert ch.message.role == "assistant" and ch.message.content == tok.decode(want["token_ids"],
                                                                                   skip_special_tokens=True)
        assert ch.finish_reason == want["finish_reason"]
    plain = client.chat.completions.create(model="x", messages=messages[:2], max_tokens=3)
    assert plain.choices[0].logprobs is None and "token_ids" not in (plain.choices[0].model_extra or {})

    # stream: true, as agent harnesses send every call: the same sample as server-sent events, read by the SDK
    whole = client.chat.completions.create(model="x", messages=messages, max_tokens=5, seed=8, logprobs=True,
                                           extra_body={"return_token_ids": True})
    chunks = list(client.chat.completions.create(model="x", messages=messages, max_tokens=5, seed=8, logprobs=True,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"return_token_ids": True}))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks) and chunks[-1].usage == whole.usage
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == whole.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices] == [None, whole.choices[0].finish_reason]
    assert chunks[0].choices[0].model_extra["token_ids"] == whole.choices[0].model_extra["token_ids"]
    assert chunks[0].model_extra["prompt_token_ids"] == prompt_ids
    text = "".join(ch.choices[0].text for ch in client.completions.create(
        model="any name", prompt="4 + 4 =", max_tokens=6, seed=21, stream=True))
    assert text == c.choices[0].text


def test_the_openai_sdk_is_refused_without_the_token_and_told_what_is_wrong(srv):
    import openai

    bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="not-the-token", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError, match="Error code: 401 - .*Authorization: missing or wrong bearer"):
        bad.models.list()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.run.read_token(), max_retries=0, timeout=30)
    user = [{"role": "user", "content": "1 + 1 ="}]
    cases = [
        (dict(messages=[{"role": "robot", "content": "hi"}]), "messages[0].role: 'robot' is not one of"),
        (dict(messages=user, extra_body={"stream_options": {"include_usage": True}}),
         "stream_options: only with stream: true"),
        (dict(messages=user, tools=[{"type": "function", "function": {"name": "f"}}]), "does not render tools"),
        (dict(messages=user, top_logprobs=3, logprobs=True), "top_logprobs: 3 alternatives are not served"),
        (dict(messages=user, max_tokens=40), "exceed rollout.max_model_len 32"),
        (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
         "messages[0].content[0]: only text parts"),
    ]
    for kwargs, message in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="x", **kwargs)
        err = e.value.body  # OpenAI's shape: the SDK's exception says the message
        assert err["type"] == "invalid_request_error" and err["code"] == 400, err
        assert message in err["message"] and "\n" not in err["message"] and err["message"] in str(e.value), err


def test_weight_push_collective(srv):
    """The HF engine receives in the server process (LocalCollective); auto picks collective on CPU."""
    client = RolloutClient(srv.run, srv.run.read_token(), timeout_s=60, retries=0, weight_sync="auto")
    for version, seed in ((3, 3), (4, 4)):
        m = perturbed(srv.model_dir, seed)
        stats = client.push_weights(list(m.state_dict().items()), version=version)
        # fp32 served, fp32 on the wire: every parameter's bytes
        assert stats["transport"] == "collective" and stats["bytes"] == sum(
            t.numel() * 4 for t in m.state_dict().values())
        assert srv.s.get(srv.url + "/version", timeout=5).json()["policy_version"] == version
        for g, w in zip(served_logprobs(srv.url, srv.s, 30), local_logprobs(m)):
            assert g == pytest.approx(w, abs=TOL)
    group = client.weights.transports["collective"].sender
    assert group is not None and group.pg is not None  # one group, reused for both versions
    st = srv.s.get(srv.url + "/collective/status", timeout=5).json()
    assert st["joined"] and st["version"] == 4 and not st["busy"] and st["error"] is None
    # a tensor the model does not have is refused before anything is broadcast; the weights stay
    before = served_logprobs(srv.url, srv.s, 30)
    with pytest.raises(RolloutError, match="not a parameter"):
        client.push_weights([("model.extra.weight", torch.zeros(2))], version=5)
    assert served_logprobs(srv.url, srv.s, 30) == before
    assert srv.s.get(srv.url + "/version", timeout=5).json()["policy_version"] == 4
    client.close()
    assert not srv.s.get(srv.url + "/collective/status", timeout=5).json()["joined"]


def test_the_collective_is_not_picked_for_a_server_on_the_trainers_own_gpu(srv):
    """NCCL refuses a group with two ranks on one GPU (one GPU shared by the trainer and an HF server): auto sends
    over HTTP then, and an explicit collective is a one-line error naming why. The CPU server says it has no GPU."""
    from hpc_rl.rollout.client.weight_push import collective_problems

    info = srv.s.get(srv.url + "/collective/info", timeout=5).json()
    assert info["device"] == "cpu" and info["gpu_uuid"] is None
    gpu = {"device": "cuda:0", "gpu_uuid": "GPU-a"}
    assert collective_problems([("http://s1", info)], "cpu", None) == []
    assert collective_problems([("http://s1", gpu), ("http://s2", {"device": "cuda", "gpu_uuid": "GPU-b"})],
                               "cuda", "GPU-b") == [
        "http://s2 serves on the trainer's own GPU (GPU-b), and NCCL does not join two processes on one GPU"]
    assert collective_problems([("http://s1", gpu), ("http://s2", None)], "cpu", None) == [
        "http://s1 serves on cuda but the trainer runs on cpu", "http://s2 does not offer /collective"]
    assert collective_problems([("http://s1", {"device": "cuda"})], "cuda", "GPU-a") == []  # vLLM: its workers'


def test_bad_weights_leave_the_model_unchanged(srv):
    before = served_logprobs(srv.url, srv.s, 30)
    version = srv.s.get(srv.url + "/version", timeout=5).json()["policy_version"]
    r = push_http(srv, {"model.norm.weight": torch.zeros(128), "lm_head.weight": torch.zeros(64, 127)}, 50)
    assert r.status_code == 400 and "'lm_head.weight' has shape [64, 127]" in r.json()["error"]
    r = push_http(srv, {"model.norm.weight": torch.zeros(128), "model.extra.weight": torch.zeros(2)}, 51)
    assert r.status_code == 400 and "'model.extra.weight' is not a parameter" in r.json()["error"]
    r = push_http(srv, {"model.norm.weight": torch.zeros(128, dtype=torch.int64)}, 52)
    assert r.status_code == 400 and "dtype" in r.json()["error"]
    r = srv.s.post(f"{srv.url}/weights?version=53&bucket=0&final=1", data=b"not safetensors", timeout=10)
    assert r.status_code == 400
    # staging: a non-final bucket changes nothing; a final bucket with a gap is refused
    assert push_http(srv, {"model.norm.weight": torch.zeros(128)}, 54, bucket=0, final=0).status_code == 200
    assert served_logprobs(srv.url, srv.s, 30) == before
    r = push_http(srv, {"lm_head.weight": torch.zeros(64, 128)}, 54, bucket=2, final=1)
    assert r.status_code == 400 and "bucket(s) [1]" in r.json()["error"]
    # the file transport only reads RUN/weights
    outside = srv.run.root / "elsewhere.safetensors"
    outside.write_bytes(save({"lm_head.weight": torch.zeros(64, 128)}))
    r = srv.s.post(srv.url + "/weights/load_file", json={"path": str(outside), "version": 55}, timeout=10)
    assert r.status_code == 400 and "outside" in r.json()["error"]
    r = srv.s.post(srv.url + "/weights/load_file",
                   json={"path": str(srv.run.weights / ".." / "elsewhere.safetensors"), "version": 55}, timeout=10)
    assert r.status_code == 400 and "outside" in r.json()["error"]
    assert served_logprobs(srv.url, srv.s, 30) == before
    assert srv.s.get(srv.url + "/version", timeout=5).json()["policy_version"] == version


def test_multi_bucket_push_applies_on_final(srv):
    assert push_http(srv, {"model.norm.weight": torch.zeros(128)}, 60, bucket=0, final=0).status_code == 200
    r = push_http(srv, {"lm_head.weight": torch.ones(64, 128)}, 60, bucket=1, final=1)
    assert r.status_code == 200 and r.json() == {"policy_version": 60, "tensors": 2}
    # zero final norm -> zero hidden -> uniform next-token distribution
    assert served_logprobs(srv.url, srv.s, 30)[0] == pytest.approx([-math.log(64)] * 5, abs=1e-5)


def test_metrics(srv):
    m = srv.s.get(srv.url + "/metrics", timeout=5).json()
    assert m["generate_requests"] >= 3 and m["generated_tokens"] > 0 and m["last_batch_tokens_per_s"] > 0
    assert m["weight_updates"] >= 3 and m["policy_version"] == 60 and m["engine"] == "hf"


def test_malformed_inputs_are_4xx_naming_the_field(srv):
    server_abuse.check_malformed_inputs_are_4xx_naming_the_field(srv, samples_limit=512)


def test_fuzzed_bodies_never_get_a_5xx(srv):
    server_abuse.fuzz_bodies_never_5xx(srv, examples=150)


def test_sigterm_drains_generations_in_flight(srv):
    """SIGTERM: /health says draining, new work gets 503 (the client sends it elsewhere), the registration goes
    at once, and the generation in flight still completes before the server exits 0."""
    import threading

    done = {}

    def long_generation():
        body = {"prompt_token_ids": [[5 + i % 20, 6, 7] for i in range(64)], "n": 8, "max_new_tokens": 28,
                "temperature": 1.0, "seed": 3}
        done["r"] = srv.s.post(srv.url + "/generate", json=body, timeout=120)

    t = threading.Thread(target=long_generation)
    t.start()
    deadline = time.monotonic() + 30
    while srv.s.get(srv.url + "/metrics", timeout=5).json()["generating"] < 1:
        assert time.monotonic() < deadline and t.is_alive(), "the generation never started"
        time.sleep(0.01)
    srv.proc.send_signal(signal.SIGTERM)
    while srv.run.rollout_file(0).exists():
        assert time.monotonic() < deadline, "the registration was not removed"
        time.sleep(0.01)
    assert srv.s.get(srv.url + "/health", timeout=5).json()["state"] == "draining"
    r = srv.s.post(srv.url + "/generate", json={"prompt_token_ids": [[5, 6]], "n": 1, "max_new_tokens": 2}, timeout=10)
    assert r.status_code == 503 and "draining" in r.json()["error"]
    t.join(120)
    assert done["r"].status_code == 200 and len(done["r"].json()["outputs"]) == 64
    assert srv.proc.wait(30) == 0
    text = (srv.run.logs / "rollout-0.log").read_text()
    assert "stopping (SIGTERM)" in text and "drained: no generation in flight" in text


@pytest.fixture(scope="module")
def long_srv(tmp_path_factory):
    """A server whose largest allowed request takes seconds: 64 samples of 240 tokens, generated in chunks of 16
    (rollout.hf_batch_samples)."""
    base = tmp_path_factory.mktemp("long-server")
    model_dir = build_tiny_model(TinyModelConfig(max_position_embeddings=256), CORPUS, base / "tiny")
    run = make_run(base / "runs", model_dir, max_model_len=256, max_samples_per_request=64, hf_batch_samples=16,
                   max_requests_in_flight=2)
    proc, info = start_server(run, 0, timeout_s=120)
    s = requests.Session()
    s.headers["Authorization"] = "Bearer " + run.read_token()
    ns = type("Srv", (), {})()
    ns.run, ns.proc, ns.url, ns.s = run, proc, info["url"], s
    # Greedy: the random model's argmax never reaches its EOS from these prompts, so every row runs to the limit.
    ns.large = {**server_abuse.long_request(ns, 64, 240), "temperature": 0.0}
    ns.large_s = server_abuse.time_alone(ns, ns.large)
    yield ns
    stop_server(proc)


def test_a_dropped_request_frees_the_server(long_srv):
    """The largest request, dropped by its client after a moment: the engine stops at its next decode step, so a
    small request sent then is answered in under a quarter of the time the large one takes alone (it would wait
    for all of it, ~{large_s}, if the work went on)."""
    small_s = server_abuse.check_dropped_request_frees_the_server(long_srv, long_srv.large, long_srv.large_s)
    print(f"HF engine: large request alone {long_srv.large_s:.2f}s; small request after dropping it {small_s:.2f}s")
    assert small_s < long_srv.large_s / 4, (small_s, long_srv.large_s)


def test_a_small_request_is_not_starved_by_a_large_one(long_srv):
    """Beside the largest allowed request (4 chunks of 16 rows), a small one waits for the chunk in progress at
    most: under half the large request's time alone."""
    small_s = server_abuse.check_small_request_beside_large_one(long_srv, long_srv.large)
    print(f"HF engine: large request alone {long_srv.large_s:.2f}s; small request beside it {small_s:.2f}s")
    assert small_s < long_srv.large_s / 2, (small_s, long_srv.large_s)


def test_past_the_in_flight_limit_a_request_is_told_to_come_back(long_srv):
    """rollout.max_requests_in_flight 2: while two requests run, a third gets 429 with Retry-After at once; the
    trainer's client waits as told and is served once one of them is done."""
    import threading

    from hpc_rl.rollout.wire.sampling import SamplingParams

    codes = []
    hogs = [threading.Thread(target=lambda: codes.append(long_srv.s.post(long_srv.url + "/generate", json=long_srv.large,
                                                                           timeout=600).status_code)) for _ in range(2)]
    for t in hogs:
        t.start()
    deadline = time.monotonic() + 30
    while long_srv.s.get(long_srv.url + "/metrics", timeout=5).json()["in_flight"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    r = long_srv.s.post(long_srv.url + "/generate", json=server_abuse.SMALL, timeout=30)
    assert r.status_code == 429 and r.headers["retry-after"] == "1" and time.monotonic() - t0 < long_srv.large_s / 4
    assert "rollout.max_requests_in_flight 2" in server_abuse.error(r)
    client = RolloutClient(long_srv.run, long_srv.run.read_token(), timeout_s=600, retries=0)
    res = client.generate([[8, 9]], SamplingParams(max_new_tokens=2, seeds=[2]), step=0)
    waited = time.monotonic() - t0
    for t in hogs:
        t.join()
    assert codes == [200, 200] and len(res.outputs) == 1
    assert waited > long_srv.large_s / 2  # it was served after a hog finished, not refused
    assert long_srv.s.get(long_srv.url + "/metrics", timeout=5).json()["refused_busy"] >= 2
