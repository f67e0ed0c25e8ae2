"""Prompt datasets, the deterministic sampler, reward loading/validation/shaping, tiny model builders."""

import json
import logging

import numpy as np
import pytest

from hpc_rl.config import DataConfig, RewardConfig, TinyModelConfig
from hpc_rl.data.datasets import PromptDataset, load_rows
from hpc_rl.data.sampler import indices_for_step
from hpc_rl.errors import DataError, RewardError
from hpc_rl.rewards.base import RewardShaper, compute_rewards, load_reward_fn
from hpc_rl.rewards.toy import repeat_digit

# ----------------------------------------------------------------------------- sampler


def test_sampler_is_a_function_of_seed_and_step():
    a = [indices_for_step(10, 4, seed=3, step=s) for s in range(5)]
    b = [indices_for_step(10, 4, seed=3, step=s) for s in range(5)]
    assert a == b
    assert a != [indices_for_step(10, 4, seed=4, step=s) for s in range(5)]
    # Steps 0..1 and half of 2 cover epoch 0 exactly once (10 rows, 4 per step).
    first_epoch = a[0] + a[1] + a[2][:2]
    assert sorted(first_epoch) == list(range(10))


def test_sampler_without_shuffle_walks_in_order():
    assert indices_for_step(5, 3, 0, 0, shuffle=False) == [0, 1, 2]
    assert indices_for_step(5, 3, 0, 1, shuffle=False) == [3, 4, 0]


# ----------------------------------------------------------------------------- datasets


def test_jsonl_and_verl_fields(tmp_path):
    p = tmp_path / "d.jsonl"
    rows = [{"prompt": [{"role": "user", "content": "2+2?"}], "reward_model": {"ground_truth": "4"}},
            {"prompt": "3+3?", "ground_truth": "6"}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = load_rows(DataConfig(source=str(p)), 0)
    assert out[0]["ground_truth"] == "4" and out[1]["ground_truth"] == "6"
    assert out[0]["id"] == 0 and out[1]["id"] == 1


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "q1", "answer": "a"}]), p)
    out = load_rows(DataConfig(source=str(p), prompt_key="question"), 0)
    assert out[0]["prompt"] == "q1"


@pytest.mark.parametrize("content,message", [
    ('{"prompt": "ok"}\n{"prompt": ""}\n', "row 1 has an empty prompt"),
    ('{"question": "x"}\n', "row 0 has no 'prompt' field; set data.prompt_key"),
    ('{"prompt": "x"\n', "d.jsonl:1: invalid JSON"),
    ('', "the dataset is empty"),
    ('{"prompt": 5}\n', "must be a string or a list of chat messages"),
    ('[1, 2]\n', "row 0 is list, not an object"),
])
def test_bad_datasets(tmp_path, content, message):
    p = tmp_path / "d.jsonl"
    p.write_text(content)
    with pytest.raises(DataError) as e:
        load_rows(DataConfig(source=str(p)), 0)
    assert message in str(e.value)


def test_non_utf8_and_missing(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match="not UTF-8"):
        load_rows(DataConfig(source=str(p)), 0)
    with pytest.raises(DataError, match="not found"):
        load_rows(DataConfig(source=str(tmp_path / "nope.jsonl")), 0)
    with pytest.raises(DataError, match="unknown toy task 'toy:nope'"):
        load_rows(DataConfig(source="toy:nope"), 0)


def test_too_long_prompt_is_rejected(tiny_model):
    from hpc_rl.models import load_tokenizer

    tok = load_tokenizer(tiny_model)
    with pytest.raises(DataError, match="more than data.max_prompt_tokens=2"):
        PromptDataset(DataConfig(source="toy:repeat_digit", toy_size=5, max_prompt_tokens=2), tok, 0)


# ----------------------------------------------------------------------------- rewards


def test_toy_reward_by_hand():
    assert repeat_digit("copy 7 :", " 7 7 7 7", ground_truth="7") == 1.0
    assert repeat_digit("copy 7 :", "7x77", ground_truth="7") == 0.75
    assert repeat_digit("copy 7 :", "", ground_truth="7") == 0.0
    assert repeat_digit("copy 7 :", "17", ground_truth="7") == 0.25


def _nan(prompt, completion, **_):
    return float("nan")


def _vector(prompt, completion, **_):
    return np.array([1.0])


def _raises(prompt, completion, **_):
    raise KeyError("ground_truth")


def _batched_bad(prompts, completions, **_):
    return np.zeros((len(prompts), 1))


def _batched_ok(prompts, completions, ground_truth, **_):
    return [float(c == g) for c, g in zip(completions, ground_truth)]


@pytest.mark.parametrize("fn,batched,message", [
    ("_nan", False, "sample 0 returned nan; rewards must be finite"),
    ("_vector", False, "sample 0 returned shape (1,); a reward must be one float per sample"),
    ("_raises", False, "raised KeyError on sample 0"),
    ("_batched_bad", True, "returned shape (2, 1) for 2 samples"),
])
def test_reward_validation_names_function_and_sample(fn, batched, message):
    spec = f"tests.test_data_rewards:{fn}"
    cfg = RewardConfig(function=spec, batched=batched)
    with pytest.raises(RewardError) as e:
        compute_rewards(load_reward_fn(spec), cfg, ["p", "p"], ["a", "b"], [{"prompt": "p"}, {"prompt": "p"}])
    assert spec in str(e.value) and message in str(e.value)


def test_batched_reward_gets_fields_as_lists():
    spec = "tests.test_data_rewards:_batched_ok"
    out = compute_rewards(load_reward_fn(spec), RewardConfig(function=spec, batched=True), ["p", "p"], ["a", "b"],
                          [{"prompt": "p", "ground_truth": "a"}, {"prompt": "p", "ground_truth": "a"}])
    assert out.tolist() == [1.0, 0.0]


@pytest.mark.parametrize("spec,message", [
    ("nope_pkg.mod:fn", "cannot import module 'nope_pkg.mod'"),
    ("hpc_rl.rewards.toy:nope", "has no callable 'nope'"),
    ("justaname", "is not a dotted path"),
])
def test_reward_loading_errors(spec, message):
    with pytest.raises(RewardError, match=message):
        load_reward_fn(spec)


def test_reward_shaper_scale_normalize_clip():
    sh = RewardShaper(RewardConfig(scale=2.0))
    assert sh(np.array([1.0, 2.0])).tolist() == [2.0, 4.0]
    sh = RewardShaper(RewardConfig(normalize=True))
    out = sh(np.array([1.0, 3.0]))
    # mean 2, unbiased std sqrt(2): (1-2)/1.414, (3-2)/1.414
    assert np.allclose(out, [-1 / np.sqrt(2), 1 / np.sqrt(2)], atol=1e-6)
    state = sh.state_dict()
    sh2 = RewardShaper(RewardConfig(normalize=True))
    sh2.load_state_dict(state)
    assert np.allclose(sh2(np.array([2.0])), sh(np.array([2.0])))
    sh = RewardShaper(RewardConfig(clip=0.5))
    assert sh(np.array([-3.0, 0.2, 3.0])).tolist() == [-0.5, 0.2, 0.5]


# ----------------------------------------------------------------------------- models


def test_tiny_model_loads_through_the_real_loader(tiny_model):
    from transformers import AutoModelForCausalLM

    from hpc_rl.models import load_causal_lm, load_tokenizer

    tok = load_tokenizer(tiny_model)
    ids = tok("copy 7 : 7 7", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "copy 7 : 7 7"
    assert len(tok) < 64  # a small vocabulary: chance is low but not hopeless for RL from scratch
    m = load_causal_lm(tiny_model)
    assert m.config.head_dim == 64  # vLLM's CPU attention rejects head_dim 16
    ref = AutoModelForCausalLM.from_pretrained(tiny_model)
    import torch

    x = torch.tensor([ids])
    assert torch.equal(m(x).logits, ref(x).logits)


def test_the_launchers_tokenizer_is_autotokenizers(tiny_model, tmp_path):
    """load_tokenizer skips AutoTokenizer's import for qwen2 folders (models/loading.tokenizer_class): the same class,
    token ids, chat template and special tokens as AutoTokenizer gives, for the toys' folders (one with a chat
    template) and a Qwen2.5-style tokenizer_config; other folders still go through AutoTokenizer."""
    from transformers import AutoTokenizer

    from hpc_rl.data.toy import LOOKUP_CHAT_TEMPLATE, lookup_corpus
    from hpc_rl.models.loading import load_tokenizer, tokenizer_class
    from hpc_rl.models.tiny import build_tiny_model

    chat = build_tiny_model(TinyModelConfig(), lookup_corpus(), tmp_path / "chat", chat_template=LOOKUP_CHAT_TEMPLATE)
    hub = tmp_path / "hub-style"
    __import__("shutil").copytree(tiny_model, hub)
    tc = json.loads((hub / "tokenizer_config.json").read_text())
    (hub / "tokenizer_config.json").write_text(json.dumps({**tc, "tokenizer_class": "Qwen2Tokenizer"}))
    texts = ["copy 7 : 7 7", "find a : look = 3 : 3 3 3 3", "copy  9:9", "<eos>copy 1 :<pad>"]
    for folder in (tiny_model, chat, hub):
        assert tokenizer_class(folder) is not None
        ours, auto = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
        assert type(ours) is type(auto) and type(ours).__name__ == "Qwen2Tokenizer"
        for t in texts:
            assert ours(t, add_special_tokens=False)["input_ids"] == auto(t, add_special_tokens=False)["input_ids"]
        assert (ours.eos_token_id, ours.chat_template, ours.get_vocab()) == (auto.eos_token_id, auto.chat_template,
                                                                              auto.get_vocab())
    msgs = [{"role": "user", "content": "find a"}]
    assert load_tokenizer(chat).apply_chat_template(msgs, tokenize=False) == AutoTokenizer.from_pretrained(
        str(chat)).apply_chat_template(msgs, tokenize=False)
    assert tokenizer_class(tiny_model, trust_remote_code=True) is None
    cfg = json.loads((hub / "config.json").read_text())
    (hub / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    assert tokenizer_class(hub) is None


def test_same_inputs_build_the_same_model(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from hpc_rl.data.toy import repeat_digit_corpus
    from hpc_rl.models.tiny import build_tiny_model

    a = build_tiny_model(TinyModelConfig(), repeat_digit_corpus(), tmp_path / "a")
    b = build_tiny_model(TinyModelConfig(), repeat_digit_corpus(), tmp_path / "b")
    ma, mb = AutoModelForCausalLM.from_pretrained(a), AutoModelForCausalLM.from_pretrained(b)
    for (na, pa), (nb, pb) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()


def test_the_cache_gives_the_fresh_build_and_builds_each_input_once(tmp_path, monkeypatch):
    """A run copies its tiny model from HPC_RL_CACHE: byte-identical to a fresh build; the second run with the same
    inputs does not build; other inputs build anew; `off` or a cache that cannot be written builds in place."""
    from hpc_rl.data.toy import repeat_digit_corpus
    from hpc_rl.models import tiny

    corpus = repeat_digit_corpus()
    monkeypatch.setenv("HPC_RL_CACHE", str(tmp_path / "cache"))
    fresh = tiny.build_tiny_model(TinyModelConfig(), corpus, tmp_path / "fresh")
    first = tiny.cached_tiny_model(TinyModelConfig(), corpus, tmp_path / "first")
    files = sorted(p.name for p in fresh.iterdir())
    assert files == sorted(p.name for p in first.iterdir()) and "model.safetensors" in files
    assert all((fresh / f).read_bytes() == (first / f).read_bytes() for f in files)
    assert len(list((tmp_path / "cache" / "tiny").iterdir())) == 1

    built = []
    real = tiny.build_tiny_model
    monkeypatch.setattr(tiny, "build_tiny_model", lambda *a, **k: built.append(a[0]) or real(*a, **k))
    again = tiny.cached_tiny_model(TinyModelConfig(), corpus, tmp_path / "again")
    assert built == [] and (again / "model.safetensors").read_bytes() == (fresh / "model.safetensors").read_bytes()
    other = tiny.cached_tiny_model(TinyModelConfig(init_seed=7), corpus, tmp_path / "other")
    assert len(built) == 1 and (other / "model.safetensors").read_bytes() != (fresh / "model.safetensors").read_bytes()
    assert len(list((tmp_path / "cache" / "tiny").iterdir())) == 2

    monkeypatch.setenv("HPC_RL_CACHE", "off")
    tiny.cached_tiny_model(TinyModelConfig(), corpus, tmp_path / "off")
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("HPC_RL_CACHE", str(tmp_path / "not-a-folder"))
    tiny.cached_tiny_model(TinyModelConfig(), corpus, tmp_path / "unwritable")
    assert len(built) == 3
    for d in ("off", "unwritable"):
        assert (tmp_path / d / "model.safetensors").read_bytes() == (fresh / "model.safetensors").read_bytes()


def test_missing_pad_token_uses_eos_and_warns_once(tiny_model, tmp_path, caplog):
    import shutil

    from hpc_rl.models import load_tokenizer

    d = tmp_path / "nopad"
    shutil.copytree(tiny_model, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("pad_token", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    caplog.set_level(logging.WARNING, logger="hpc_rl")
    tok = load_tokenizer(d)
    load_tokenizer(d)
    assert tok.pad_token == tok.eos_token == "<eos>"
    assert sum("no pad_token" in r.message for r in caplog.records) == 1, [(r.name, r.message) for r in caplog.records]


def test_missing_model_folder_is_a_user_error(tmp_path):
    from hpc_rl.errors import ModelError
    from hpc_rl.models import load_causal_lm

    with pytest.raises(ModelError, match="does not exist"):
        load_causal_lm(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="has no config.json"):
        load_causal_lm(tmp_path / "empty")
