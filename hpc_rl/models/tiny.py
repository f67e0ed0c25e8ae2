"""Tiny offline models: a tokenizer trained with `tokenizers` on a corpus and a random-init
Qwen2/Llama model from a config, saved as a normal HF folder (loaded like any real model)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from ..config import TinyModelConfig

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
# Tiny vision-language architectures (model.tiny.arch): a vision tower, an image processor, prompts with images.
VISION_ARCHS = ("qwen2_vl", "qwen2_5_vl")


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


def model_config(tiny: TinyModelConfig, vocab_size: int, eos_id: int, pad_id: int, vision_ids=None):
    """The transformers config object for a tiny model; `vision_ids` (qwen2_vl): the ids of the vision start, image
    pad and vision end tokens."""
    from transformers import LlamaConfig, Qwen2_5_VLConfig, Qwen2Config, Qwen2VLConfig

    common = dict(vocab_size=vocab_size, hidden_size=tiny.hidden_size, intermediate_size=tiny.intermediate_size,
                  num_hidden_layers=tiny.num_layers, num_attention_heads=tiny.num_heads,
                  num_key_value_heads=tiny.num_kv_heads, head_dim=tiny.head_dim,
                  max_position_embeddings=tiny.max_position_embeddings, eos_token_id=eos_id,
                  pad_token_id=pad_id, bos_token_id=eos_id, tie_word_embeddings=False,
                  initializer_range=tiny.init_std)
    if tiny.arch == "qwen2":
        return Qwen2Config(**common)
    if tiny.arch in VISION_ARCHS:
        # M-RoPE splits each head's rotary half into (t, h, w) sections.
        half = tiny.head_dim // 2
        common.pop("tie_word_embeddings")
        common["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6,
                                     "mrope_section": [half - 2 * (half // 4), half // 4, half // 4]}
        start, pad, end = vision_ids
        patches = dict(num_heads=max(1, tiny.vision_width // 16), patch_size=14, spatial_merge_size=2,
                       temporal_patch_size=2, initializer_range=tiny.init_std)
        if tiny.arch == "qwen2_vl":
            vision, cls = dict(depth=tiny.vision_layers, embed_dim=tiny.vision_width, hidden_size=tiny.hidden_size,
                               mlp_ratio=2, **patches), Qwen2VLConfig
        else:  # Qwen2.5-VL: windowed attention in the tower, full attention in its last block
            vision, cls = dict(depth=tiny.vision_layers, hidden_size=tiny.vision_width,
                               intermediate_size=2 * tiny.vision_width, out_hidden_size=tiny.hidden_size,
                               window_size=112, fullatt_block_indexes=[tiny.vision_layers - 1], **patches), \
                Qwen2_5_VLConfig
        return cls(text_config=common, vision_config=vision, image_token_id=pad, vision_start_token_id=start,
                   vision_end_token_id=end, tie_word_embeddings=False)
    return LlamaConfig(**common)


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
    vision_ids = image_processor = None
    if tiny.arch in VISION_ARCHS:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        from .vision import IMAGE_PAD, VISION_END, VISION_START

        tok.add_special_tokens({"additional_special_tokens": [VISION_START, IMAGE_PAD, VISION_END]})
        vision_ids = tok.convert_tokens_to_ids([VISION_START, IMAGE_PAD, VISION_END])
        image_processor = Qwen2VLImageProcessorPil(min_pixels=tiny.min_pixels, max_pixels=tiny.max_pixels,
                                                   patch_size=14, merge_size=2, temporal_patch_size=2)
    cfg = model_config(tiny, len(tok), tok.eos_token_id, tok.pad_token_id, vision_ids)
    torch.manual_seed(tiny.init_seed)
    if tiny.arch in VISION_ARCHS:
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_config(cfg)
    else:
        model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    with atomic_folder(out) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if image_processor is not None:
            image_processor.save_pretrained(tmp)
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


def cache_dir() -> Path | None:
    """Where built tiny models are kept: $HPC_RL_CACHE/tiny (default ~/.cache/hpc-rl/tiny); None when
    HPC_RL_CACHE=off."""
    root = os.environ.get("HPC_RL_CACHE", str(Path.home() / ".cache" / "hpc-rl"))
    return None if root.strip().lower() in ("off", "") else Path(root) / "tiny"


def _fingerprint(kind: str, key: dict) -> str:
    """The cache name of a build: its inputs, the libraries whose numbers it depends on (random init, tokenizer
    training) and the source of the builders, so that a change to any of them builds anew."""
    from importlib.metadata import version

    h = hashlib.sha256(json.dumps({"kind": kind, **key}, sort_keys=True, default=str).encode())
    for pkg in ("torch", "transformers", "tokenizers"):
        h.update(f"{pkg}={version(pkg)}".encode())
    for src in ("tiny.py", "tiny_reward.py", "vision.py"):
        h.update((Path(__file__).parent / src).read_bytes())
    return f"{kind}-{h.hexdigest()[:20]}"


def build_cached(kind: str, key: dict, out_dir: str | Path, build: Callable[[Path], Path]) -> Path:
    """`build(folder)` once per `key` into the cache, then a copy of it at `out_dir` (atomically). A toy run otherwise
    spends seconds at every start training the same tokenizer (and reward model) and initialising the same weights;
    the cached folder is byte-identical to a fresh build. A cache that cannot be written builds at `out_dir`."""
    out = Path(out_dir)
    root = cache_dir()
    if root is None:
        return build(out)
    cached = root / _fingerprint(kind, key)
    if not (cached / "config.json").is_file():
        try:
            root.mkdir(parents=True, exist_ok=True)
            writable = os.access(root, os.W_OK)
        except OSError:
            writable = False
        if not writable:
            return build(out)
        build(cached)
    with atomic_folder(out) as tmp:
        for f in cached.iterdir():
            shutil.copy2(f, tmp / f.name)
    return out


def cached_tiny_model(tiny: TinyModelConfig, corpus: Iterable[str], out_dir: str | Path,
                      chat_template: str | None = None) -> Path:
    """build_tiny_model through the cache."""
    import dataclasses

    corpus = list(corpus)
    return build_cached("model", {"tiny": dataclasses.asdict(tiny), "corpus": corpus, "template": chat_template},
                        out_dir, lambda out: build_tiny_model(tiny, corpus, out, chat_template=chat_template))
