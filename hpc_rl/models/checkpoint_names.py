"""The names a model folder's safetensors files give its tensors, against the names the loaded model gives them.

transformers renames some checkpoints' tensors at load: a Qwen2-VL folder's `model.layers.*` are
`model.language_model.layers.*` in memory and its `visual.*` are `model.visual.*` (transformers 5 also saves the old
names). Weight updates and LoRA adapters are named as in memory, so whatever reads a base tensor from the files (the
LoRA merge on a rollout server, `hpc-rl export --merged`) maps the name through the same renaming first.
"""

from __future__ import annotations

import json
from pathlib import Path


def file_keys(folder: str | Path) -> dict[str, str]:
    """{tensor name: the safetensors file that holds it} of an HF folder (names only; no tensor is read)."""
    from safetensors import safe_open

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    out: dict[str, str] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            out.update(dict.fromkeys(sf.keys(), f.name))
    return out


def loaded_names(folder: str | Path, keys, trust_remote_code: bool = False) -> dict[str, str]:
    """{file key: the name transformers gives it once loaded} for the `keys` of `folder` that its load renames one to
    one (a key a converter splits or fuses, e.g. MoE experts, has no single name and is left out)."""
    import torch
    from transformers import AutoConfig
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    from .vision import policy_auto_class

    conf = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    cls = policy_auto_class(hasattr(conf, "vision_config"))
    with torch.device("meta"):
        model = cls.from_config(conf, trust_remote_code=trust_remote_code)
    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    meta = model.state_dict()
    out = {}
    for key in keys:
        name, converted = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
        if converted is None and name in meta:
            out[key] = name
    return out


def file_names(folder: str | Path, names, trust_remote_code: bool = False) -> dict[str, tuple[str, str]]:
    """{in-memory name: (file key, safetensors file)} for each of `names` that `folder` holds, under its own name or
    under the name transformers renames at load; names it does not hold are left out."""
    keys = file_keys(folder)
    names = set(names)
    out = {n: (n, keys[n]) for n in names & set(keys)}
    if names - set(out):
        renamed = {mem: key for key, mem in loaded_names(folder, keys, trust_remote_code).items()}
        out.update({n: (renamed[n], keys[renamed[n]]) for n in names - set(out) if n in renamed})
    return out
