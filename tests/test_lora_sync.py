"""LoRA weight sync: a rollout server of a model.lora job takes the actor's adapters (and nothing else) over every
transport and then serves the adapted model: its log-probs equal a PeftModel's (fp32 both sides)."""

from __future__ import annotations

import time

import pytest
import requests
import torch

from hpc_rl.config import LoraConfig
from hpc_rl.models import load_causal_lm
from hpc_rl.models.lora import adapter_specs, merged, resolve_targets, split_wire_name, wire_name
from hpc_rl.rollout.client.rollout_client import RolloutClient
from hpc_rl.rollout.testing import make_run, start_server, stop_server
from tests.logprob_checks import local_logprobs, max_diff, served_logprobs

TOL = 1e-4
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def adapted(model_dir, seed: int):
    """A PeftModel of the tiny model with random (non-zero) adapters: the policy a LoRA trainer would push."""
    from hpc_rl.models.lora import with_adapters

    m = with_adapters(load_causal_lm(model_dir).eval(), LoraConfig(**LORA), "model.lora")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return m.eval()


def adapters_of(m) -> list:
    return [(wire_name(n), p.detach().clone()) for n, p in m.named_parameters() if wire_name(n)]


def test_wire_names_and_merge_by_hand():
    assert wire_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") == \
        "model.layers.0.self_attn.q_proj.lora_A.weight"
    assert wire_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") is None
    assert split_wire_name("model.layers.1.mlp.down_proj.lora_B.weight") == ("model.layers.1.mlp.down_proj.weight",
                                                                              "lora_B")
    assert split_wire_name("model.layers.1.mlp.down_proj.weight") is None
    w0 = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])  # out 3, in 2
    a = torch.tensor([[1.0, -1.0]])  # rank 1 x in
    b = torch.tensor([[2.0], [0.0], [-1.0]])  # out x rank 1
    # W0 + 0.5 * B @ A = W0 + 0.5 * [[2, -2], [0, 0], [-1, 1]]
    assert torch.equal(merged(w0, a, b, 0.5), torch.tensor([[2.0, 1.0], [3.0, 4.0], [4.5, 6.5]]))
    specs = adapter_specs({"x.weight": ((3, 2), torch.float32), "x.bias": ((3,), torch.float32)}, rank=4)
    assert specs == {"x.lora_A.weight": ((4, 2), torch.float32), "x.lora_B.weight": ((3, 4), torch.float32)}


def test_target_modules_that_match_nothing_name_the_linear_modules(tiny_model):
    from hpc_rl.errors import ConfigError

    m = load_causal_lm(tiny_model)
    names = resolve_targets(m, ["q_proj"], "model.lora")
    assert names == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    assert "lm_head" not in " ".join(resolve_targets(m, ["all-linear"], "model.lora"))
    with pytest.raises(ConfigError) as e:
        resolve_targets(m, ["q_proj", "qkv"], "model.lora")
    msg = str(e.value)
    assert "model.lora.target_modules: 'qkv' matches no linear module" in msg and "'down_proj'" in msg
    assert "\n" not in msg


@pytest.mark.slow
def test_adapters_over_every_transport_serve_the_adapted_model(tiny_model, tmp_path):
    run = make_run(tmp_path / "runs", tiny_model, model={"lora": LORA}, max_model_len=32)
    proc, info = start_server(run, 0, timeout_s=120)
    try:
        url = info["url"]
        s = requests.Session()
        s.headers["Authorization"] = "Bearer " + run.read_token()
        base = local_logprobs(load_causal_lm(tiny_model).eval())
        assert max_diff(served_logprobs(url, s), base) < TOL
        client = RolloutClient(run, run.read_token(), timeout_s=60, retries=0, weight_sync="http")
        for version, transport in enumerate(("http", "file", "collective"), start=1):
            client.weight_sync = transport
            m = adapted(tiny_model, version)
            named = adapters_of(m)
            stats = client.push_weights(named, version=version)
            assert stats["transport"] == transport
            assert s.get(url + "/version", timeout=5).json()["policy_version"] == version
            d = max_diff(served_logprobs(url, s), local_logprobs(m))
            assert d < TOL, (transport, d)
            assert max_diff(served_logprobs(url, s), base) > 10 * TOL  # the adapters changed what it serves
            # adapter-sized: the pushed bytes are the adapters', a small part of the model
            if transport != "collective":
                full = sum(t.numel() * t.element_size() for t in m.get_base_model().state_dict().values())
                assert stats["bytes"] < 0.2 * full
        # A pushed adapter of the wrong rank is refused in one line; the served weights stay.
        bad = [(n, torch.zeros(8, t.shape[1]) if n.endswith("lora_A.weight") else t) for n, t in named][:2]
        client.weight_sync = "http"
        with pytest.raises(Exception) as e:
            client.push_weights(bad, version=9)
        assert "has shape [8, 128] but the served model expects [4, 128]" in str(e.value)
        assert max_diff(served_logprobs(url, s), local_logprobs(m)) < TOL
        client.close()
    finally:
        stop_server(proc, timeout_s=30)


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_merges_adapters_over_collective_and_file(tiny_model, tmp_path):
    """~60 s: a vLLM engine starts on CPU (most of the time: one core busy for ~40 s), then takes adapter pushes over
    the collective and over files."""
    run = make_run(tmp_path / "runs", tiny_model, model={"lora": LORA}, engine="vllm", dtype="float32",
                   max_model_len=64, request_timeout_s=120, retries=0)
    t0 = time.monotonic()
    proc, info = start_server(run, 0, timeout_s=300, env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    try:
        assert info["engine"] == "vllm", info
        url = info["url"]
        s = requests.Session()
        s.headers["Authorization"] = "Bearer " + run.read_token()
        client = RolloutClient(run, run.read_token(), timeout_s=120, retries=0, weight_sync="collective")
        for version, transport in enumerate(("collective", "file", "http"), start=1):
            client.weight_sync = transport
            m = adapted(tiny_model, 10 + version)
            assert client.push_weights(adapters_of(m), version=version)["transport"] == transport
            d = max_diff(served_logprobs(url, s), local_logprobs(m))
            print(f"vLLM fp32 with merged adapters ({transport}) vs PeftModel fp32: max |diff| {d:.2e}")
            assert d < TOL, (transport, d)
        client.close()
        print(f"vLLM LoRA server up and checked in {time.monotonic() - t0:.0f}s")
    finally:
        stop_server(proc, timeout_s=30)


def test_adapted_model_keeps_the_memory_lean_log_prob_path(tiny_model):
    """A PeftModel forwards logits_to_keep to the model it wraps: the output layer runs on the response positions
    only, in chunks (issue 14), and gives the log-probs of the full-logits computation."""
    from hpc_rl.train import experience as ex

    m = adapted(tiny_model, 7)
    assert ex._takes_logits_to_keep(m) and ex._lean_head(m) is not None
    b = ex.pack([[5, 6, 7, 8, 9], [5, 6, 7, 8, 9]], [[9, 9, 9], [4, 5]], 0)
    with torch.no_grad():
        got, _ = ex.policy_forward(m, b)
        logits = m(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).logits
        want, _ = ex.token_logprobs(logits[:, b.prompt_len - 1:-1], b.responses)
    assert float(((got - want) * b.response_mask).abs().max()) < 1e-5
