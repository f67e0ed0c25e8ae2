"""Tiny offline models: a tokenizer trained with `tokenizers` on a corpus and a random-init
Qwen2/Llama model from a config, saved as a normal HF folder (loaded like any real model)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from ..config import TinyModelConfig

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"


def train_tokenizer(corpus: Iterable[str], vocab_size: int = 64):
    """A byte-level BPE (as Qwen2/GPT-2 use) trained on `corpus`; returns a PreTrainedTokenizerFast.

    The alphabet is only the bytes the corpus uses, which keeps the vocabulary tiny so that a
    random-init policy samples the right tokens early in RL. Byte-level matters: transformers
    rebuilds Qwen2/Llama tokenizers with a byte-level pipeline, whatever tokenizer.json says.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, EOS, UNK], show_progress=False)
    tok.train_from_iterator(list(corpus), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK)


def model_config(tiny: TinyModelConfig, vocab_size: int, eos_id: int, pad_id: int):
    """The transformers config object for a tiny model."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=vocab_size, hidden_size=tiny.hidden_size, intermediate_size=tiny.intermediate_size,
                  num_hidden_layers=tiny.num_layers, num_attention_heads=tiny.num_heads,
                  num_key_value_heads=tiny.num_kv_heads, head_dim=tiny.head_dim,
                  max_position_embeddings=tiny.max_position_embeddings, eos_token_id=eos_id,
                  pad_token_id=pad_id, bos_token_id=eos_id, tie_word_embeddings=False,
                  initializer_range=tiny.init_std)
    if tiny.arch == "qwen2":
        return Qwen2Config(**common)
    return LlamaConfig(**common)


def fingerprint(tiny: TinyModelConfig, corpus: list[str]) -> str:
    """Stable id of (config, corpus): the same inputs always build the same folder."""
    h = hashlib.sha256(json.dumps(tiny.__dict__, sort_keys=True).encode())
    for line in corpus:
        h.update(line.encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


def build_tiny_model(tiny: TinyModelConfig, corpus: Iterable[str], out_dir: str | Path,
                     chat_template: str | None = None) -> Path:
    """Train a tokenizer on `corpus` (with `chat_template`, if given), build a random-init model, save both into
    `out_dir` (atomically)."""
    import torch
    from transformers import AutoModelForCausalLM

    corpus = list(corpus)
    out = Path(out_dir)
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    tok = train_tokenizer(corpus)
    if chat_template:
        tok.chat_template = chat_template
    cfg = model_config(tiny, len(tok), tok.eos_token_id, tok.pad_token_id)
    torch.manual_seed(tiny.init_seed)
    model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    with atomic_folder(out) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return out


@contextlib.contextmanager
def atomic_folder(out: Path):
    """A temporary folder beside `out` to write a model into; renamed to `out` when the block ends without an
    error (removed otherwise), so that `out` is either complete or absent."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp", dir=out.parent))
    try:
        yield tmp
        try:
            os.rename(tmp, out)
        except OSError:
            # Another process built the same folder first; theirs is identical.
            if not (out / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def tiny_cache_dir() -> Path:
    """Where tiny models are cached: $HPC_RL_CACHE or ~/.cache/hpc-rl/tiny."""
    return Path(os.environ.get("HPC_RL_CACHE", Path.home() / ".cache" / "hpc-rl")) / "tiny"
