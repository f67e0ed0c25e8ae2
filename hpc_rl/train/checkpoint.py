"""Writing and loading checkpoints (the folder's layout, listing, latest and best: hpc_rl/checkpoints.py).

Everything is written under `.step_N.tmp`, then renamed; `latest` is replaced last. Every rank writes its DeepSpeed
shards; rank 0 the HF folder, the trainer state, the batches generated ahead and the manifest.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from ..checkpoints import manifest, prune, step_dir
from ..errors import CheckpointError
from ..orchestrator.batch import RolloutBatch
from ..rundir import RunDir, fsync_tree, write_json_atomic, write_text_atomic
from .distributed import barrier
from .reshape import load_universal, reshape_message, universal_folder, written_world_size

log = logging.getLogger("hpc_rl")

SHARD_BYTES = 4 * 1024**3


# Batches generated ahead of the checkpoint's step (token ids, engine log-probs, versions, scores), JSON.
PENDING = "pending_batches.json"


def save_hf_folder(state_dict: dict[str, torch.Tensor], model_config, tokenizer, out: Path) -> None:
    """An HF model folder (safetensors, sharded past 4 GiB) that from_pretrained loads without hpc-rl."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    if getattr(model_config, "tie_word_embeddings", False):
        state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in state_dict.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][k] = v.contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
        total = sum(v.numel() * v.element_size() for v in state_dict.values())
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    model_config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


# A vision-language model's processor files: a checkpoint's folder loads (and serves images) as the base did.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "chat_template.json",
                   "video_preprocessor_config.json")


def copy_processor_files(base: Path, out: Path) -> None:
    for name in PROCESSOR_FILES:
        if (base / name).is_file() and not (out / name).exists():
            shutil.copy2(base / name, out / name)


def save_adapter_folder(adapters: dict[str, torch.Tensor], lora, base_path: str, tokenizer, out: Path) -> None:
    """A PEFT adapter folder (adapter_config.json, adapter_model.safetensors) from wire-named adapters
    (models.lora); `PeftModel.from_pretrained(base, out)` loads it without hpc-rl."""
    from safetensors.torch import save_file

    from ..models.lora import PEFT_PREFIX, peft_config, split_wire_name

    out.mkdir(parents=True, exist_ok=True)
    targets = sorted({split_wire_name(n)[0][:-len(".weight")] for n in adapters})
    peft_config(lora, targets, base_path).save_pretrained(str(out))
    save_file({PEFT_PREFIX + n: t.contiguous() for n, t in adapters.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


def _has_frozen(engine) -> bool:
    """A LoRA engine: its frozen base weights come from model.path, not from the checkpoint."""
    return any(not p.requires_grad for p in engine.module.parameters())


def save(run: RunDir, step: int, engines: dict, trainer_state: dict, hf_state_dict: dict | None,
         model_config, tokenizer, keep_last: int, rank: int, pending: list[dict] | None = None,
         lora=None, base_path: str | None = None) -> Path | None:
    """Collective: every rank writes its DeepSpeed shards; rank 0 writes HF weights (the adapters alone as a PEFT
    folder under `lora`), state, the batches generated ahead and not yet trained on (`pending`, async rollouts),
    manifest, `latest`."""
    final = step_dir(run, step)
    tmp = run.checkpoints / f".step_{step}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    for name, engine in engines.items():
        engine.save_checkpoint(str(tmp / "deepspeed" / name), tag="state", save_latest=False,
                               exclude_frozen_parameters=_has_frozen(engine))
    # Each rank flushes what it wrote, from its own node (a shared filesystem's client cache is per node).
    fsync_tree(tmp / "deepspeed")
    barrier()
    if rank == 0:
        if hf_state_dict is not None and lora is not None:
            save_adapter_folder(hf_state_dict, lora, base_path, tokenizer, tmp / "hf")
        elif hf_state_dict is not None:
            save_hf_folder(hf_state_dict, model_config, tokenizer, tmp / "hf")
        if hf_state_dict is not None and base_path:
            copy_processor_files(Path(base_path), tmp / "hf")
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
        if pending:
            (tmp / PENDING).write_text(json.dumps([b.to_json() for b in pending]))
        write_json_atomic(tmp / "manifest.json", manifest(tmp))
        fsync_tree(tmp)
        if final.exists():  # a re-run of this step after a resume
            shutil.rmtree(final)
        os.rename(tmp, final)
        write_text_atomic(run.checkpoints / "latest", final.name)  # also makes the rename above durable
        prune(run, keep_last, final)
    barrier()
    return final if rank == 0 else None


def load_pending(path: Path) -> list[RolloutBatch]:
    """The batches a checkpoint holds that were generated ahead and not yet trained on (async rollouts)."""
    f = path / PENDING
    return [RolloutBatch.from_json(b) for b in json.loads(f.read_text())] if f.is_file() else []


def load(path: Path, engines: dict, world_size: int, rank: int) -> dict:
    """Load every engine's DeepSpeed state (collective) and return the trainer state. A checkpoint written by another
    number of ranks under ZeRO 1-3 is loaded through DeepSpeed's universal checkpoint (reshape.py), converted once."""
    state = json.loads((path / "trainer_state.json").read_text())
    t0, reshaped, written = time.time(), [], None
    for name, engine in engines.items():
        strict = not _has_frozen(engine)
        written = written_world_size(path / "deepspeed" / name / "state")
        if written is not None and written != world_size:
            load_path = load_universal(engine, universal_folder(path, name, rank), strict)
            reshaped.append(name)
        else:
            load_path, _ = engine.load_checkpoint(str(path / "deepspeed" / name), tag="state",
                                                  load_module_strict=strict, load_optimizer_states=True,
                                                  load_lr_scheduler_states=True)
        if load_path is None:
            raise CheckpointError(f"{path}: no DeepSpeed state for {name}; the checkpoint is incomplete — "
                                  "remove it to resume from an older one")
    if reshaped and rank == 0:
        log.info(reshape_message(written, world_size, time.time() - t0, reshaped))
    return state
