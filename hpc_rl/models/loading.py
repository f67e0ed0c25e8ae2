"""Load HF model folders and tokenizers the same way for real and tiny models."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

from ..errors import ModelError, first_line

log = logging.getLogger("hpc_rl")
_warned_pad: set[str] = set()


def torch_dtype(name: str):
    """'bfloat16' -> torch.bfloat16 ('auto' -> None, letting the model folder decide)."""
    import torch

    if name in (None, "auto"):
        return None
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def check_model_dir(path: str | Path, key: str = "model.path") -> Path:
    """A local HF folder must hold config.json; raise ModelError naming `key` and what is missing."""
    p = Path(path)
    if not p.exists():
        raise ModelError(f"{key}: {path} does not exist; point it at an HF model folder "
                         "(config.json, weights, tokenizer files)")
    if not (p / "config.json").is_file():
        raise ModelError(f"{key}: {path} has no config.json; point it at an HF model folder "
                         "(the output of save_pretrained)")
    return p


def check_same_tokenizer(tokenizer, policy_path: str | Path, other_path: str | Path, key: str) -> None:
    """A model that scores the policy's token ids (a teacher) must tokenize as the policy does: ModelError naming
    both folders otherwise."""
    check_model_dir(other_path, key)
    other = load_tokenizer(other_path, key=key)
    if other.get_vocab() != tokenizer.get_vocab():
        raise ModelError(f"{key}: the tokenizer of {other_path} is not the policy's (model.path {policy_path}); the "
                         "teacher scores the policy's token ids, so both need the same tokenizer (one model family)")


# Tokenizer classes of a qwen2 folder that AutoTokenizer resolves to Qwen2Tokenizer (transformers 5 lists qwen2 among
# the model types whose hub class it overrides): Qwen2/2.5 checkpoints' and the tiny toys' folders.
_QWEN2_HUB_CLASSES = {"Qwen2Tokenizer", "Qwen2TokenizerFast", "TokenizersBackend"}


def tokenizer_class(path: str | Path, trust_remote_code: bool = False):
    """The class AutoTokenizer picks for `path` when that is certain from its files without importing
    AutoTokenizer (Qwen2Tokenizer), else None. AutoTokenizer imports most of transformers' modeling code and torch,
    ~5 CPU-s that a launcher which only checks the prompts does not need (tests/test_data_rewards.py holds both to
    the same class and token ids)."""
    if trust_remote_code:
        return None
    try:
        tc = json.loads((Path(path) / "tokenizer_config.json").read_text())
        mc = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(tc, dict) or not isinstance(mc, dict) or "auto_map" in tc or mc.get("model_type") != "qwen2" \
            or tc.get("tokenizer_class") not in _QWEN2_HUB_CLASSES:
        return None
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    return Qwen2Tokenizer


def load_tokenizer(path: str | Path, trust_remote_code: bool = False, key: str = "model.path"):
    """AutoTokenizer's tokenizer with a pad token guaranteed (eos reused, warned once) and left padding for prompts;
    errors name `key` (the config key of the folder)."""
    try:
        cls = tokenizer_class(path, trust_remote_code)
        if cls is None:
            from transformers import AutoTokenizer as cls
        tok = cls.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ModelError(f"{key}: cannot load a tokenizer from {path} ({first_line(e)}); "
                         "the folder needs tokenizer.json or tokenizer_config.json") from None
    vocab = model_vocab_size(path)
    # Some tokenizer classes invent a default pad token (Qwen2: '<|endoftext|>') that the model's
    # embedding does not have: an id past the vocabulary fails only later, inside the forward pass.
    invented = vocab is not None and tok.pad_token_id is not None and tok.pad_token_id >= vocab
    if tok.pad_token is None or invented:
        if tok.eos_token is None:
            raise ModelError(f"{key}: the tokenizer in {path} has neither pad_token nor eos_token; "
                             "set one in tokenizer_config.json")
        tok.pad_token = tok.eos_token
        if str(path) not in _warned_pad:
            _warned_pad.add(str(path))
            log.warning("tokenizer in %s has no pad_token; using eos_token %r as pad_token", path, tok.eos_token)
    if not getattr(tok, "chat_template", None):
        tok.chat_template = _processor_chat_template(Path(path))
    tok.padding_side = "left"
    return tok


def _processor_chat_template(folder: Path) -> str | None:
    """A chat template the folder keeps beside the tokenizer (vision-language models keep theirs with the processor:
    chat_template.json or chat_template.jinja), or None."""
    try:
        if (folder / "chat_template.jinja").is_file():
            return (folder / "chat_template.jinja").read_text()
        if (folder / "chat_template.json").is_file():
            value = json.loads((folder / "chat_template.json").read_text()).get("chat_template")
            return value if isinstance(value, str) else None
    except (OSError, ValueError, AttributeError):
        return None
    return None


def model_vocab_size(path) -> int | None:
    """The vocabulary size in an HF folder's config.json (a vision-language model's is its text_config's); None
    when it does not say."""
    try:
        c = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(c, dict):
        return None
    v = c.get("vocab_size") or (c.get("text_config") or {}).get("vocab_size")
    return int(v) if isinstance(v, int) else None


def load_causal_lm(path: str | Path, dtype: str = "float32", attn_implementation: str = "sdpa",
                   gradient_checkpointing: bool = False, trust_remote_code: bool = False):
    """AutoModelForCausalLM from a local folder (a vision-language model's: AutoModelForImageTextToText, whose
    forward takes pixel_values); under an active HfDeepSpeedConfig it loads ZeRO-3 partitioned."""
    from .vision import is_vision_model, policy_auto_class

    check_model_dir(path)
    auto = policy_auto_class(is_vision_model(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = auto.from_pretrained(
            str(path), dtype=torch_dtype(dtype), attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model
