"""Fast unit tests of the rollout pieces: sampling filters, chunking, validation, buckets, protocol, addresses."""

import ipaddress
import math
import pathlib
import re

import pytest
import torch

from hpc_rl.netutil import advertise_host
from hpc_rl.orchestrator import seeds
from hpc_rl.rollout.client.routing import split_contiguous
from hpc_rl.rollout.server.engine_hf import filter_logits
from hpc_rl.rollout.wire import protocol
from hpc_rl.rollout.wire.weights import (
    WeightError,
    bucket_bytes_of,
    buckets,
    load_path,
    prune_versions,
    tensors_from_bytes,
    validate_named_tensors,
    write_version,
)

# probabilities 0.1, 0.2, 0.3, 0.4
LOGITS = torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))


def kept(logits):
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


def test_filter_logits_top_k_and_top_p():
    assert kept(filter_logits(LOGITS, -1, 1.0)) == [0, 1, 2, 3]
    assert kept(filter_logits(LOGITS, 2, 1.0)) == [2, 3]
    assert kept(filter_logits(LOGITS, 1, 1.0)) == [3]
    # mass before each sorted token: 0, .4, .7, .9 -> a token stays while that mass < top_p
    assert kept(filter_logits(LOGITS, -1, 0.4)) == [3]
    assert kept(filter_logits(LOGITS, -1, 0.5)) == [2, 3]
    assert kept(filter_logits(LOGITS, -1, 0.75)) == [1, 2, 3]
    # top-p applies to the top-k-renormalized distribution (as vLLM/HF do): 4/9, 3/9, 2/9 -> mass before .78
    assert kept(filter_logits(LOGITS, 3, 0.75)) == [2, 3]
    assert kept(filter_logits(LOGITS, 3, 0.8)) == [1, 2, 3]
    assert kept(filter_logits(LOGITS, 2, 0.75)) == [2, 3]
    # kept logits are unchanged (renormalization happens in softmax)
    assert filter_logits(LOGITS, 2, 1.0)[0, 3].item() == pytest.approx(math.log(4.0))


def test_split_contiguous():
    assert split_contiguous(5, 2) == [(0, 3), (3, 5)]
    assert split_contiguous(2, 5) == [(0, 1), (1, 2)]
    assert split_contiguous(6, 3) == [(0, 2), (2, 4), (4, 6)]
    assert split_contiguous(4, 1) == [(0, 4)]


def test_seeds_are_stable_distinct_and_fit_a_generator():
    # Values are fixed across machines and Python versions (a resumed run on another node samples the same).
    assert seeds.mix(1, 2, 3) == seeds.mix(1, 2, 3) == 758583703777463672
    train = seeds.training(1, 0).prompts(64)
    all_ = (train + seeds.training(1, 1).prompts(64) + seeds.training(1, 0, 1).prompts(64)
            + seeds.training(2, 0).prompts(64) + seeds.evaluation(1, 0).prompts(64)
            + [seeds.training(1, 0).turn(i, t) for i in range(8) for t in range(8)]
            + [seeds.evaluation(1, 0).turn(i, t) for i in range(8) for t in range(8)])
    assert len(set(all_)) == len(all_)  # no two purposes, steps, rounds, positions or turns share one
    assert all(0 <= s < 2**62 for s in all_)
    assert seeds.training(1, 0).prompts(8) == train[:8]  # a prompt's seed does not depend on how many come after


def test_a_prompt_keeps_its_seed_in_any_request():
    from hpc_rl.rollout.wire.sampling import SamplingParams

    p = SamplingParams(n=4, seed=100)
    assert [p.prompt_seed(i) for i in range(3)] == [100, 104, 108]  # vLLM's children: seed + j
    p = SamplingParams(n=4, seed=100, seeds=[7, 9])
    assert [p.prompt_seed(i) for i in range(2)] == [7, 9]


SPECS = {"a.weight": ((2, 3), torch.float32), "b.ids": ((4,), torch.int64)}


def test_validate_named_tensors():
    validate_named_tensors(SPECS, [("a.weight", torch.zeros(2, 3, dtype=torch.bfloat16)),
                                   ("b.ids", torch.zeros(4, dtype=torch.int32))])
    with pytest.raises(WeightError, match="'c' is not a parameter"):
        validate_named_tensors(SPECS, [("c", torch.zeros(1))])
    with pytest.raises(WeightError, match=r"'a.weight' has shape \[3, 2\].*expects \[2, 3\]"):
        validate_named_tensors(SPECS, [("a.weight", torch.zeros(3, 2))])
    with pytest.raises(WeightError, match="'b.ids' has dtype torch.float32"):
        validate_named_tensors(SPECS, [("b.ids", torch.zeros(4))])


def test_buckets_group_by_size_and_copy_shared_storage():
    w = torch.ones(100)  # 400 bytes
    named = [("x", w), ("tied", w), ("y", torch.ones(100)), ("z", torch.ones(300))]
    groups = list(buckets(named, bucket_bytes=1000))
    assert [list(g) for g in groups] == [["x", "tied"], ["y"], ["z"]]
    data = bucket_bytes_of(groups[0])  # safetensors refuses shared storage; buckets copies
    back = dict(tensors_from_bytes(data))
    assert torch.equal(back["tied"], w)
    with pytest.raises(WeightError, match="not a safetensors"):
        tensors_from_bytes(b"garbage")


def test_write_version_load_and_prune(tmp_path):
    named = [(f"t{i}", torch.full((64,), float(i))) for i in range(5)]
    folder, nbytes = write_version(tmp_path, 3, named, bucket_bytes=512)
    assert folder == tmp_path / "v3" and nbytes > 5 * 256
    assert len(list(folder.glob("*.safetensors"))) == 3
    back = dict(load_path(folder))
    assert sorted(back) == [f"t{i}" for i in range(5)] and back["t4"][0].item() == 4.0
    write_version(tmp_path, 4, named)
    prune_versions(tmp_path, keep=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v4"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightError, match="no .safetensors"):
        load_path(tmp_path / "empty")


def test_parse_generate_errors_name_the_field():
    ok = {"prompt_token_ids": [[1, 2], [3]], "n": 2, "max_new_tokens": 4}
    prompts, p = protocol.parse_generate(ok, 10, protocol.RequestLimits(6))
    assert prompts == [[1, 2], [3]] and p.n == 2 and p.top_k == -1 and p.seed is None
    cases = [
        ({**ok, "prompt_token_ids": [[1], [1, 2, 3]]}, r"prompt_token_ids\[1\]: 3 prompt tokens"),
        ({**ok, "bogus": 1}, "bogus: unknown field"),
        ({"n": 1}, "prompt_token_ids: missing"),
        ({**ok, "prompt_token_ids": [[1, 99]]}, r"prompt_token_ids\[0\]: token id 99"),
        ({**ok, "n": 0}, "n: must be >= 1"),
        ({**ok, "top_k": 0}, "top_k: must be -1"),
        ({**ok, "top_p": 1.5}, "top_p: must be in"),
        ({**ok, "temperature": "hot"}, "temperature: expected a number"),
        ({**ok, "stop_token_ids": ["x"]}, "stop_token_ids"),
        ({**ok, "stop_token_ids": [10]}, r"stop_token_ids\[0\]: must be <= 9"),
        ({**ok, "temperature": math.nan}, "temperature: nan is not a finite number"),
        ({**ok, "top_p": math.inf}, "top_p: inf is not a finite number"),
        ({**ok, "seed": 2**64}, "seed: must be <="),
        ({**ok, "seed": -1}, "seed: must be >= 0"),
        ({**ok, "seeds": [1]}, "seeds: expected a list of 2 integer seeds"),
        ({**ok, "n": 1_000_000}, r"n: 2 prompt\(s\) x n 1000000 = 2000000 samples exceed rollout.max_samples_per_request 1024"),
        ([1, 2], "body: expected a JSON object"),
    ]
    for body, msg in cases:
        with pytest.raises(protocol.BadRequest, match=msg):
            protocol.parse_generate(body, 10, protocol.RequestLimits(6))


def test_request_limits_refuse_what_can_never_be_served():
    lim = protocol.RequestLimits(max_model_len=8, max_samples=6, max_tokens=20)
    lim.check([[1, 2], [3]], 3, 2)  # 6 samples; 3 prompt tokens + 6 x 2 = 15 tokens
    with pytest.raises(protocol.BadRequest, match=r"asks for 27 tokens \(its prompts \+ n x max_new_tokens"):
        lim.check([[1, 2], [3]], 3, 4)  # 3 + 6 x 4 = 27 > 20
    with pytest.raises(protocol.BadRequest, match="= 8 samples exceed rollout.max_samples_per_request 6"):
        lim.check([[1], [2]], 4, 1)
    assert protocol.RequestLimits(8, max_samples=2).max_tokens is None  # then 2 x 8 tokens: the samples bound it


def test_bodies_are_refused_by_field_for_nan_depth_and_bad_text():
    assert protocol.load_json(b'{"a": [1, 2.5, "x", {"b": null}]}') == {"a": [1, 2.5, "x", {"b": None}]}
    cases = [(b'{"temperature": NaN}', "temperature: NaN is not a number JSON allows"),
             (b'{"x": {"y": [1, -Infinity]}}', r"x.y\[1\]: -Infinity is not a number"),
             (b'{"top_p": 1e999}', "top_p: inf is out of range"),
             (b"[" * 5000 + b"]" * 5000, "nested deeper than 16 levels"),
             (b"[" * 17 + b"]" * 17, r"body(\[0\])+: JSON nested deeper than 16 levels"),
             (b'{"prompt": "ok \\udcff"}', "prompt: text holds '\\\\udcff', a lone surrogate"),
             (b'{"\\ud800": 1}', r"body \(a key\): text holds"),
             (b"{not json", "body: not valid JSON"),
             (b"\xff\xfe", "body: not valid JSON")]
    for raw, msg in cases:
        with pytest.raises(protocol.BadRequest, match=msg):
            protocol.load_json(raw)


def test_parse_logprobs_errors():
    assert protocol.parse_logprobs({"token_ids": [[1, 2, 3]], "prompt_lens": [1]}, 10, protocol.RequestLimits(8)) == ([[1, 2, 3]], [1], 0)
    with pytest.raises(protocol.BadRequest, match=r"prompt_lens\[0\]: must be >= 1"):
        protocol.parse_logprobs({"token_ids": [[1, 2]], "prompt_lens": [0]}, 10, protocol.RequestLimits(8))
    with pytest.raises(protocol.BadRequest, match=r"prompt_lens\[0\]: 3 exceeds"):
        protocol.parse_logprobs({"token_ids": [[1, 2]], "prompt_lens": [3]}, 10, protocol.RequestLimits(8))
    with pytest.raises(protocol.BadRequest, match="one per token_ids row"):
        protocol.parse_logprobs({"token_ids": [[1, 2]], "prompt_lens": [1, 1]}, 10, protocol.RequestLimits(8))


def test_advertise_host(monkeypatch):
    monkeypatch.setenv("HPC_RL_ADVERTISE_HOST", "n3.cluster")
    assert advertise_host("0.0.0.0") == "n3.cluster"
    monkeypatch.delenv("HPC_RL_ADVERTISE_HOST")
    assert advertise_host("10.77.0.12") == "10.77.0.12"  # bound to one address: only that one is reachable
    addr = ipaddress.ip_address(advertise_host("0.0.0.0"))
    assert addr.version == 4
    import socket

    from hpc_rl.netutil import interface_ipv4 as _iface_ipv4
    others = [ip for _, n in socket.if_nameindex() if (ip := _iface_ipv4(n)) and not ip.startswith("127.")]
    if others:
        assert not addr.is_loopback


def test_kv_cache_bytes_from_the_job(tmp_path):
    """Hand-computed: the toy vLLM job's tiny Qwen2 (2 layers, 2 KV heads of 64, fp32) holds 2*2*2*64*4 = 2048
    bytes of K/V per token; 16 prompts x 8 samples = 128 sequences of one 256-token block each -> 64 MiB."""
    from hpc_rl.config import TinyModelConfig, load
    from hpc_rl.data.toy import repeat_digit_corpus
    from hpc_rl.models.tiny import build_tiny_model
    from hpc_rl.rollout.server.engine_vllm import kv_bytes_per_token, kv_cache_bytes

    path = build_tiny_model(TinyModelConfig(), repeat_digit_corpus(), tmp_path / "m")
    assert kv_bytes_per_token(str(path), "float32") == 2048
    assert kv_bytes_per_token(str(path), "bfloat16") == 1024
    job = pathlib.Path(__file__).resolve().parents[1] / "jobs" / "toy-grpo-vllm-cpu.yaml"
    cfg = load(job, ["model.tiny=null", f"model.path={path}"])
    assert kv_cache_bytes(cfg, "cpu", "float32") == 128 * 256 * 2048 == 64 << 20
    cfg.rollout.max_model_len = 300  # two blocks per sequence
    assert kv_cache_bytes(cfg, "cpu", "float32") == 128 * 512 * 2048
    cfg.rollout.tensor_parallel = 2  # each worker holds half of the heads
    assert kv_cache_bytes(cfg, "cpu", "float32") == 128 * 512 * 2048 // 2
    assert kv_cache_bytes(cfg, "cuda", "float32") is None  # GPU: vLLM sizes it from gpu_memory_utilization
    cfg.rollout.kv_cache_bytes = 12345678
    assert kv_cache_bytes(cfg, "cuda", "float32") == kv_cache_bytes(cfg, "cpu", "float32") == 12345678
    cfg.rollout.kv_cache_bytes = 0  # 0: vLLM's fraction everywhere
    assert kv_cache_bytes(cfg, "cpu", "float32") is None


def test_weight_gate_load_waits_for_running_generations_and_holds_new_ones_back():
    """Generations (on an event loop) overlap each other; a load (from a thread) starts only once the running
    ones are done, and a generation that arrives meanwhile starts after the load: each sees one version."""
    import asyncio
    import threading
    import time

    from hpc_rl.rollout.server.service import WeightGate

    gate, state, seen = WeightGate(), {"version": 0}, []

    async def generation(hold_s: float):
        async with gate.generating():
            v0 = state["version"]
            await asyncio.sleep(hold_s)
            seen.append((v0, state["version"]))

    def load():
        with gate.loading():
            state["version"] = 1
            time.sleep(0.2)
            state["version"] = 2

    async def main():
        first = asyncio.gather(generation(0.3), generation(0.3))
        await asyncio.sleep(0.05)  # both generations are running
        loader = threading.Thread(target=load)
        loader.start()
        while not gate._loading and loader.is_alive():  # the load has announced itself (or is already done)
            await asyncio.sleep(0.001)
        await generation(0.0)
        await first
        loader.join()

    asyncio.run(main())
    assert sorted(seen) == [(0, 0), (0, 0), (2, 2)]  # never a version that changed under a generation


def test_a_server_that_fails_its_rejoin_probe_is_probed_again_only_after_a_growing_wait(tmp_path, monkeypatch):
    """A hung server (no answer to /health) costs a weight push one health timeout per REPROBE_S wait, not one per
    push; a server that answers again rejoins at the first push after its wait; a restarted one (new address) at once."""
    from hpc_rl.rollout.client import pool as pool_mod
    from hpc_rl.rollout.client import rollout_client as client_mod
    from hpc_rl.rundir import RunDir, write_json_atomic

    run = RunDir(tmp_path)
    run.rendezvous.mkdir(parents=True)
    write_json_atomic(run.rollout_file(0), {"url": "http://h:1", "index": 0})
    c = client_mod.RolloutClient(run, "t")
    c.pushed_version = 1
    srv = c.servers[0]
    srv.healthy = False
    now = [100.0]
    probes: list[str] = []
    answers = {"http://h:1": None}
    monkeypatch.setattr(pool_mod.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(c, "health", lambda s: probes.append(s.url) or answers.get(s.url))
    lo, hi = pool_mod.REPROBE_S

    c.rejoin()
    assert probes == ["http://h:1"] and srv.reprobe_at == 100.0 + lo
    now[0] += lo - 1
    c.rejoin()
    assert len(probes) == 1  # still waiting
    now[0] += 1
    c.rejoin()
    assert len(probes) == 2 and srv.reprobe_at == now[0] + 2 * lo  # the wait doubles
    for _ in range(10):
        now[0] = srv.reprobe_at
        c.rejoin()
    assert srv.reprobe_wait == hi and not srv.healthy

    answers["http://h:1"] = {"policy_version": 0}  # answers again: rejoins once its wait is over
    now[0] = srv.reprobe_at
    c.rejoin()
    assert srv.healthy and srv.reprobe_wait == 0.0

    srv.healthy, srv.reprobe_at = False, now[0] + hi  # out again, far from its next probe ...
    write_json_atomic(run.rollout_file(0), {"url": "http://h:2", "index": 0})  # ... but restarted elsewhere
    answers["http://h:2"] = {"policy_version": 0}
    c.rejoin()
    assert probes[-1] == "http://h:2" and c.servers[0].healthy

    # Every server out: the fallback re-probe that brings one back also restarts its backoff.
    srv = c.servers[0]
    srv.healthy, srv.reprobe_at, srv.reprobe_wait = False, now[0] + hi, hi
    answers["http://h:2"] = {"policy_version": 1}
    assert c.healthy() == [srv] and srv.reprobe_wait == 0.0 and srv.reprobe_at == 0.0


# --------------------------------------------------------------------------- the OpenAI-compatible wire format


def _limits():
    return protocol.RequestLimits(max_model_len=64, max_samples=8, max_tokens=None)


def test_openai_requests_take_the_runs_sampling_settings_where_they_leave_them_out():
    from hpc_rl.rollout.wire import openai_api

    d = openai_api.Defaults(max_tokens=7, temperature=0.6, top_p=0.9, top_k=20)
    chat = openai_api.parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                                 lambda msgs, tools: [1, 2, 3], 100, _limits(), d)
    p = chat.params
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.n) == (7, 0.6, 0.9, 20, 1)
    assert chat.prompts == [[1, 2, 3]] and not chat.logprobs and not chat.token_ids
    # the SDK's nulls mean "not given"; max_completion_tokens wins over max_tokens, as in OpenAI's API
    chat = openai_api.parse_chat({"messages": [{"role": "user", "content": "hi"}], "temperature": None,
                                  "max_tokens": 3, "max_completion_tokens": 5, "logprobs": True,
                                  "return_token_ids": True, "seed": 4}, lambda msgs, tools: [1], 100, _limits(), d)
    assert (chat.params.temperature, chat.params.max_new_tokens, chat.params.seed) == (0.6, 5, 4)
    assert chat.logprobs and chat.token_ids
    done = openai_api.parse_completions({"prompt": "abc", "temperature": 0.0}, lambda s: [5] * len(s), 100,
                                        _limits(), d)
    assert done.prompts == [[5, 5, 5]] and done.params.temperature == 0.0 and done.params.max_new_tokens == 7


def test_openai_chat_messages_are_checked_by_name():
    from hpc_rl.rollout.wire import openai_api

    msgs = openai_api.check_messages([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                   {"type": "text", "text": "b"}]},
                                      {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}])
    assert [m["content"] for m in msgs] == ["ab", ""] and msgs[1]["tool_calls"] == [{"id": "1"}]
    for bad, field in [([], "messages: expected a non-empty list"), ([{"role": "user"}], "messages[0].content"),
                       (["hi"], "messages[0]: expected an object"), ([{"role": "x", "content": "a"}], "messages[0].role"),
                       ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]")]:
        with pytest.raises(protocol.BadRequest, match=f"^{re.escape(field)}"):
            openai_api.check_messages(bad)


def test_openai_responses_carry_the_engines_tokens_and_version():
    from hpc_rl.rollout.wire import openai_api
    from hpc_rl.rollout.wire.sampling import SampleOut, SamplingParams

    req = openai_api.Request([[7, 8]], SamplingParams(n=2), logprobs=True, token_ids=True)
    outs = [[SampleOut([3, 4], [-0.5, -1.5], "length"), SampleOut([9], [-0.25], "stop")]]
    chat = openai_api.chat_response(req, outs, lambda ids: "".join(chr(96 + i) for i in ids), "m", 5)
    assert chat["prompt_token_ids"] == [7, 8] and chat["policy_version"] == 5
    assert [c["token_ids"] for c in chat["choices"]] == [[3, 4], [9]]
    assert [c["message"]["content"] for c in chat["choices"]] == ["cd", "i"]
    assert [x["logprob"] for x in chat["choices"][0]["logprobs"]["content"]] == [-0.5, -1.5]
    assert chat["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    text = openai_api.completion_response(req, outs, lambda ids: "".join(chr(96 + i) for i in ids), "m", 5)
    assert [(c["prompt_token_ids"], c["token_ids"], c["text"]) for c in text["choices"]] == [
        ([7, 8], [3, 4], "cd"), ([7, 8], [9], "i")]
    assert text["choices"][0]["logprobs"]["text_offset"] == [0, 1]
