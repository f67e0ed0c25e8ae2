"""The HF engine in-process on a tiny model: sampling semantics, raw log-probs, determinism, weight loads."""

import math

import pytest
import torch

from hpc_rl.config import TinyModelConfig, load_dict
from hpc_rl.models import load_causal_lm
from hpc_rl.models.tiny import build_tiny_model
from hpc_rl.rollout.server.engine_hf import HFEngine
from hpc_rl.rollout.wire.sampling import SamplingParams

CORPUS = [f"{i} + {i} = {2 * i}" for i in range(100)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(TinyModelConfig(), CORPUS, tmp_path_factory.mktemp("m") / "tiny")


@pytest.fixture(scope="module")
def engine(model_dir):
    cfg = load_dict({"model": {"path": str(model_dir)}, "rollout": {"engine": "hf"}})
    return HFEngine(cfg, "cpu")


PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]


def test_generate_shapes_stop_and_logprobs(engine):
    out = engine.generate(PROMPTS, SamplingParams(n=8, max_new_tokens=30, seed=0))
    assert len(out) == 3 and all(len(row) == 8 for row in out)
    stops = engine.eos_ids
    reasons = set()
    for row in out:
        for s in row:
            reasons.add(s.finish_reason)
            assert len(s.token_ids) == len(s.logprobs) >= 1
            assert all(math.isfinite(x) and x <= 0 for x in s.logprobs)
            assert not any(t in stops for t in s.token_ids[:-1])
            if s.finish_reason == "stop":
                assert s.token_ids[-1] in stops  # EOS kept as the last token
            else:
                assert s.finish_reason == "length" and len(s.token_ids) == 30
    assert reasons == {"stop", "length"}  # a random 64-token model hits EOS in some of 24 samples of 30


def test_stop_token_ids_end_a_sample(engine):
    out = engine.generate([[5, 6]], SamplingParams(n=4, max_new_tokens=10, seed=1,
                                                  stop_token_ids=list(range(64))))
    assert all(s.finish_reason == "stop" and len(s.token_ids) == 1 for s in out[0])


def test_same_seed_same_outputs(engine):
    p = SamplingParams(n=3, max_new_tokens=12, seed=42, temperature=0.8, top_p=0.9)
    a, b = engine.generate(PROMPTS, p), engine.generate(PROMPTS, p)
    assert a == b
    c = engine.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=12, seed=43, temperature=0.8, top_p=0.9))
    assert c != a


def test_logprobs_are_raw_whatever_the_sampling_settings(engine, model_dir):
    """Sampled-token log-probs are log_softmax of the unmodified logits (temperature 1, no top-k/p)."""
    model = load_causal_lm(model_dir).eval()
    out = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=8, seed=5, temperature=0.5, top_k=5))
    for prompt, row in zip(PROMPTS, out):
        for s in row:
            ids = torch.tensor([prompt + s.token_ids])
            with torch.no_grad():
                lp = torch.log_softmax(model(ids).logits[0].float(), -1)
            want = [lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(s.token_ids)]
            assert s.logprobs == pytest.approx(want, abs=1e-5)
            # and top_k=5 means each sampled token is among the 5 most likely
            for j, t in enumerate(s.token_ids):
                assert t in torch.topk(lp[len(prompt) - 1 + j], 5).indices.tolist()


def test_greedy_equals_top_k_1(engine):
    g = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0))
    k = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, top_k=1, seed=9))
    assert [r[0].token_ids for r in g] == [r[0].token_ids for r in k]


def test_prompt_logprobs_match_unpadded_forward(engine, model_dir):
    model = load_causal_lm(model_dir).eval()
    seqs, lens = [[5, 6, 7, 8, 9, 10], [3, 4, 5]], [2, 1]
    got = engine.prompt_logprobs(seqs, lens)
    for seq, pl, g in zip(seqs, lens, got):
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1)
        assert g == pytest.approx([lp[j - 1, seq[j]].item() for j in range(pl, len(seq))], abs=1e-5)


def test_load_weights_in_place_changes_outputs(model_dir):
    cfg = load_dict({"model": {"path": str(model_dir)}, "rollout": {"engine": "hf"}})
    eng = HFEngine(cfg, "cpu")
    before = eng.prompt_logprobs([[5, 6, 7]], [1])
    specs = eng.param_specs()
    assert specs["lm_head.weight"][0] == (64, 128) and specs["lm_head.weight"][1] == torch.float32
    eng.load_weights([("lm_head.weight", torch.zeros(64, 128, dtype=torch.float64))])
    after = eng.prompt_logprobs([[5, 6, 7]], [1])
    assert after[0] == pytest.approx([-math.log(64)] * 2, abs=1e-6) and after != before


def test_batched_sampling_draws_what_multinomial_draws_row_by_row():
    """The engine samples a batch at once; each row's token is still the one torch.multinomial draws from that
    row's own generator (the samples, and the golden files, do not change with the batching)."""
    torch.manual_seed(0)
    for trial in range(30):
        logits = torch.randn(64, 33) * 3
        if trial % 3 == 0:
            logits[:, :10] = float("-inf")  # top-k-filtered rows: zero probabilities
        probs = torch.softmax(logits, -1)
        done = torch.rand(64) < 0.3
        ours = [torch.Generator().manual_seed(100 * trial + i) for i in range(64)]
        theirs = [torch.Generator().manual_seed(100 * trial + i) for i in range(64)]
        for _ in range(3):  # the generators' streams go on alike
            tok = HFEngine._sample(probs, ours, done)
            want = [0 if d else int(torch.multinomial(p, 1, generator=g)[0]) for p, d, g in zip(probs, done, theirs)]
            assert tok.tolist() == want


def test_finished_samples_leave_the_batch_without_changing_the_others(model_dir):
    """Samples that stopped leave the decoding batch (and their KV cache rows): the running ones get the same
    tokens and log-probs as when every row runs to the last step."""
    cfg = load_dict({"model": {"path": str(model_dir)}, "rollout": {"engine": "hf"}})
    dropping, keeping = HFEngine(cfg, "cpu"), HFEngine(cfg, "cpu")
    keeping.drop_finished = False
    calls = []
    forward = dropping.model.forward
    dropping.model.forward = lambda *a, **kw: calls.append(kw["input_ids"].shape[0]) or forward(*a, **kw)
    p = SamplingParams(n=8, max_new_tokens=20, seed=3, stop_token_ids=list(range(10, 22)))
    a, b = dropping.generate(PROMPTS, p), keeping.generate(PROMPTS, p)
    lengths = sorted(len(s.token_ids) for row in b for s in row)
    assert lengths[0] < lengths[-1]  # samples of varied length: some left early
    assert calls[0] == 24 and calls[-1] < 24 and calls == sorted(calls, reverse=True)
    for ra, rb in zip(a, b):
        for sa, sb in zip(ra, rb):
            assert (sa.token_ids, sa.finish_reason) == (sb.token_ids, sb.finish_reason)
            assert sa.logprobs == pytest.approx(sb.logprobs, abs=1e-5)
