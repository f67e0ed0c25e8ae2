"""LoRA adapters: which modules they go on, their tensors' names on the wire and in PEFT folders, and the merge
W = W0 + alpha / rank * B @ A shared by the rollout servers and `hpc-rl export --merged`.

On the wire (weight sync) an adapter is two tensors named after the weight they adapt:
`model.layers.0.self_attn.q_proj.lora_A.weight` [rank, in] and `...q_proj.lora_B.weight` [out, rank].
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:
    import torch

    from ..config import LoraConfig

# PEFT's names: base_model.model.<module>.lora_A.default.weight (in a model) / ...lora_A.weight (in a saved folder).
PEFT_PREFIX = "base_model.model."
_PEFT_PARAM = re.compile(r"^(?:base_model\.model\.)?(.+)\.(lora_[AB])(?:\.[^.]+)?\.weight$")
_WIRE = re.compile(r"^(.+)\.(lora_[AB])\.weight$")
# The critic's value head (transformers' token-classification head): trained whole, never adapted.
CRITIC_HEAD = ("score",)


def scaling(alpha: float, rank: int) -> float:
    """The factor of the adapters' output (PEFT's lora_alpha / r)."""
    return float(alpha) / int(rank)


def in_modules(param_name: str, modules: tuple[str, ...]) -> bool:
    """Whether a parameter belongs to one of `modules` (module names like `score`, at any depth)."""
    return any(f".{m}." in f".{param_name}" for m in modules)


def linear_module_names(model, exclude: tuple[str, ...] = (), skip_prefixes: tuple[str, ...] = ()) -> list[str]:
    """Names of the model's nn.Linear modules, less the output layer, the modules named in `exclude` and those
    under `skip_prefixes` (a frozen vision tower)."""
    import torch

    out_layer = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = []
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or mod is out_layer:
            continue
        if any(name == e or name.endswith("." + e) for e in exclude) or name.startswith(skip_prefixes):
            continue
        names.append(name)
    return names


def resolve_targets(model, targets: list[str], key: str, exclude: tuple[str, ...] = (),
                    skip_prefixes: tuple[str, ...] = ()) -> list[str]:
    """The full names of the linear modules `targets` (names, suffixes or [all-linear]) select; ConfigError naming
    `key` and the model's linear module names when one target selects nothing."""
    linear = linear_module_names(model, exclude, skip_prefixes)
    if targets == ["all-linear"]:
        chosen = linear
    else:
        chosen = []
        for t in targets:
            hits = [n for n in linear if n == t or n.endswith("." + t)]
            if not hits:
                kinds = sorted({n.rsplit(".", 1)[-1] for n in linear})
                tower = " (the frozen vision tower's are left out; model.train_vision: true adapts them too)" \
                    if skip_prefixes else ""
                raise ConfigError(f"{key}.target_modules: {t!r} matches no linear module of the model; its linear "
                                  f"modules are {kinds}{tower} (or use [all-linear])")
            chosen += [n for n in hits if n not in chosen]
    if not chosen:
        raise ConfigError(f"{key}.target_modules: the model has no linear module to adapt")
    return chosen


def policy_skip(cfg) -> tuple[str, ...]:
    """Module prefixes the policy's adapters never go on: a vision-language policy's vision tower unless
    model.train_vision (LoRA adapts the language tower only by default)."""
    from .tiny import VISION_ARCHS
    from .vision import VISION_TOWER, is_vision_model

    m = cfg.model
    vision = (m.tiny.arch in VISION_ARCHS) if m.tiny is not None else is_vision_model(m.path)
    return VISION_TOWER if vision and not m.train_vision else ()


def meta_model(cfg, critic: bool = False):
    """The job's policy (or critic) built on the meta device from its config: module names and shapes, no weights."""
    import torch
    from transformers import AutoConfig, AutoModelForTokenClassification

    from .vision import policy_auto_class

    m = cfg.model
    if m.tiny is not None:
        from .tiny import model_config

        # a toy vocabulary's size, and placeholder ids of a vision model's image tokens
        conf = model_config(m.tiny, vocab_size=64, eos_id=1, pad_id=0, vision_ids=(2, 3, 4))
    else:
        path = (m.critic_path or m.path) if critic else m.path
        conf = AutoConfig.from_pretrained(path, trust_remote_code=m.trust_remote_code)
    if critic:
        conf.num_labels = 1
    cls = AutoModelForTokenClassification if critic else policy_auto_class(hasattr(conf, "vision_config"))
    with torch.device("meta"):
        return cls.from_config(conf, trust_remote_code=m.trust_remote_code)


def check_targets(cfg) -> None:
    """ConfigError when model.lora's or model.critic_lora's target_modules select nothing of the job's models
    (before a run starts: the trainer ranks would fail on it)."""
    if cfg.model.lora is not None:
        resolve_targets(meta_model(cfg), cfg.model.lora.target_modules, "model.lora", skip_prefixes=policy_skip(cfg))
    if cfg.model.critic_lora is not None and cfg.algorithm.uses_critic:
        resolve_targets(meta_model(cfg, critic=True), cfg.model.critic_lora.target_modules, "model.critic_lora",
                        exclude=CRITIC_HEAD)


def with_adapters(model, lora: LoraConfig, key: str, exclude: tuple[str, ...] = (), base_path: str | None = None,
                  skip_prefixes: tuple[str, ...] = ()):
    """`model` wrapped by PEFT with `lora`'s adapters on the linear modules its target_modules select (none of
    `exclude` or under `skip_prefixes`); everything else frozen. ConfigError naming `key` when a target selects
    nothing."""
    import warnings

    from peft import get_peft_model

    targets = resolve_targets(model, lora.target_modules, key, exclude=exclude, skip_prefixes=skip_prefixes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(model, peft_config(lora, targets, base_path))


def wire_name(peft_param_name: str) -> str | None:
    """`base_model.model.X.lora_A.default.weight` (a PeftModel's parameter) -> `X.lora_A.weight`; None for other
    parameters."""
    m = _PEFT_PARAM.match(peft_param_name)
    return f"{m.group(1)}.{m.group(2)}.weight" if m else None


def split_wire_name(name: str) -> tuple[str, str] | None:
    """`X.lora_A.weight` -> (`X.weight`, `lora_A`): the weight an adapter tensor belongs to; None for other names."""
    m = _WIRE.match(name)
    return (f"{m.group(1)}.weight", m.group(2)) if m else None


def group_adapters(named) -> tuple[dict, dict]:
    """(tensors that are not adapters, {weight name: {"lora_A": A, "lora_B": B}}) of wire-named tensors."""
    plain, pairs = {}, {}
    for name, t in named:
        parts = split_wire_name(name)
        if parts is None:
            plain[name] = t
        else:
            pairs.setdefault(parts[0], {})[parts[1]] = t
    return plain, pairs


def unpaired(pairs: dict) -> str | None:
    """'the adapter of W came without its lora_B' for the first weight with half an adapter in `pairs`, else None."""
    half = sorted(w for w, p in pairs.items() if len(p) != 2)
    if not half:
        return None
    return f"the adapter of {half[0]} came without its {'lora_B' if 'lora_A' in pairs[half[0]] else 'lora_A'}"


def adapter_specs(base_specs: dict, rank: int) -> dict:
    """The wire specs of the adapters every 2-D float weight of `base_specs` ({name: (shape, dtype)}) could take."""
    out = {}
    for name, (shape, dtype) in base_specs.items():
        if name.endswith(".weight") and len(shape) == 2 and dtype.is_floating_point:
            stem = name[:-len(".weight")]
            out[f"{stem}.lora_A.weight"] = ((rank, shape[1]), dtype)
            out[f"{stem}.lora_B.weight"] = ((shape[0], rank), dtype)
    return out


def merged(w0: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, dtype=None) -> torch.Tensor:
    """W0 + scale * B @ A computed in float32 (what the adapted module computes, as one weight), in `dtype`
    (default: W0's)."""
    return (w0.float() + scale * (b.float() @ a.float())).to(dtype or w0.dtype)


def peft_config(lora: LoraConfig, targets: list[str], base_path: str | None = None):
    """The peft.LoraConfig of `lora` on the resolved module names."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=int(lora.rank), lora_alpha=lora.alpha, lora_dropout=float(lora.dropout),
                          target_modules=list(targets), bias="none", base_model_name_or_path=base_path)
