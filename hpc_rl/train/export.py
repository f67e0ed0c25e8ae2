"""`hpc-rl export`: a checkpoint as an HF model folder; a LoRA run's as its PEFT adapter folder or merged into the
base model (one safetensors file at a time: memory stays bounded by the largest file of the base)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..checkpoints import best_checkpoint, best_record, find_latest, list_checkpoints, step_dir, verify
from ..errors import CheckpointError
from ..models.checkpoint_names import file_names
from ..models.lora import PEFT_PREFIX, group_adapters, merged, scaling, unpaired
from ..models.tiny import atomic_folder
from ..rundir import find

# What a merged folder takes from the base folder besides its weights (tokenizer files come from the checkpoint).
_BASE_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")


def best_step(rd) -> int:
    """The step of checkpoints/best; CheckpointError when the run keeps none."""
    ck = best_checkpoint(rd)
    if ck is None:
        rec = best_record(rd)
        if rec and int(rec["step"]) == 0:
            why = "the best evaluation is step 0's, of the initial policy (model.path), which no step improved on"
        elif rec:
            why = f"the best evaluation (step {rec['step']}) has no checkpoint left"
        else:
            why = "the run has no best checkpoint (it needs checkpoint.keep_best: METRIC and an evaluation)"
        raise CheckpointError(f"{rd.root}: {why}; pick a --step")
    return int(ck.name[5:])


def _checkpoint(rd, step: int | None) -> Path:
    if step is None:
        ck = find_latest(rd)
        if ck is None:
            raise CheckpointError(f"{rd.root}: no complete checkpoint; set checkpoint.every > 0 and run longer")
        return ck
    ck = step_dir(rd, step)
    if not ck.is_dir():
        have = ", ".join(p.name[5:] for p in list_checkpoints(rd)) or "none"
        raise CheckpointError(f"{rd.root}: no checkpoint for step {step}; available steps: {have}")
    if not verify(ck):
        raise CheckpointError(f"{ck}: incomplete checkpoint (files missing or cut short); pick another --step")
    return ck


def merge_adapter_folder(adapter_dir: Path, base_dir: Path, out: Path) -> int:
    """Write base_dir's model with adapter_dir's LoRA adapters merged into its weights (W0 + alpha/r * B @ A) to
    `out`, file by file, in the base's dtype; returns the number of weights changed."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    conf = json.loads((adapter_dir / "adapter_config.json").read_text())
    scale = scaling(conf["lora_alpha"], conf["r"])
    saved = load_file(str(adapter_dir / "adapter_model.safetensors"))
    plain, pairs = group_adapters((n.removeprefix(PEFT_PREFIX), t) for n, t in saved.items())
    problem = f"{sorted(plain)[0]} is not a LoRA tensor" if plain else unpaired(pairs)
    if problem:
        raise CheckpointError(f"{adapter_dir}: {problem}; the adapter folder is damaged")
    files = sorted(base_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{base_dir}: the base model has no .safetensors weights to merge the adapters into")
    # the adapters are named as in the loaded model; a base file may hold a weight under the name transformers
    # renames at load (a Qwen2-VL folder's model.layers.* is model.language_model.layers.*)
    where = file_names(base_dir, pairs)
    missing = sorted(set(pairs) - set(where))
    if missing:
        raise CheckpointError(f"{base_dir}: {len(missing)} adapted weight(s) (e.g. {missing[0]}) are not in the base "
                              "model's files; export from the run's own model.path")
    done = 0
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            metadata = sf.metadata() or {"format": "pt"}
        tensors = load_file(str(f))
        for name, (key, file) in where.items():
            if file == f.name:
                p = pairs[name]
                tensors[key] = merged(tensors[key], p["lora_A"], p["lora_B"], scale)
                done += 1
        save_file(tensors, str(out / f.name), metadata=metadata)
        del tensors
    for name in _BASE_FILES:
        if (base_dir / name).is_file():
            shutil.copy2(base_dir / name, out / name)
    return done


def export_hf(run: str, out: str, step: int | None = None, runs_dir: str = "runs", form: str = "merged",
              best: bool = False) -> int:
    """`hpc-rl export`: the checkpoint of `step` (latest complete one by default; `best`: checkpoints/best) into
    `out`: an HF folder, or for a LoRA run the adapters merged into the base (`merged`) or its PEFT adapter folder."""
    rd = find(run, runs_dir)
    if best:
        step = best_step(rd)
    ck = _checkpoint(rd, step)
    src = ck / "hf"
    lora = (src / "adapter_config.json").is_file()
    if not lora and not (src / "config.json").is_file():
        raise CheckpointError(f"{ck}: has no hf/ folder (checkpoint.save_hf was false)")
    if form == "adapter" and not lora:
        raise CheckpointError(f"{rd.name} trained all weights (no model.lora): there is no adapter to export; drop "
                              "--adapter")
    dest = Path(out)
    if dest.exists() and any(dest.iterdir()):
        raise CheckpointError(f"{out}: exists and is not empty; choose a new folder")
    if dest.exists():
        dest.rmdir()  # an empty folder: atomic_folder renames the finished one into its place
    with atomic_folder(dest) as tmp:
        if not lora or form == "adapter":
            shutil.copytree(src, tmp, dirs_exist_ok=True)
            what = "PEFT adapter folder" if lora else "HF folder"
        else:
            base = Path(json.loads((src / "adapter_config.json").read_text())["base_model_name_or_path"])
            if not (base / "config.json").is_file():
                raise CheckpointError(f"{base}: the run's base model (model.path) is not there; merging needs it")
            n = merge_adapter_folder(src, base, tmp)
            for f in src.iterdir():  # the tokenizer, as the run used it
                if f.name not in ("adapter_config.json", "adapter_model.safetensors"):
                    shutil.copy2(f, tmp / f.name)
            what = f"HF folder ({n} weights merged with their adapters)"
    print(f"exported {ck.name} of {rd.name} to {dest}: {what}")
    return 0
