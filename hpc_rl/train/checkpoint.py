"""Checkpoints: checkpoints/step_N/{hf/, deepspeed/, trainer_state.json, manifest.json}, written atomically.

Everything is written under `.step_N.tmp`, then renamed; `latest` is replaced last. A manifest of file
sizes lets resume reject a checkpoint whose files were cut short (falling back to an older one).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..rundir import RunDir, fsync_tree, read_json, write_json_atomic, write_text_atomic
from .distributed import barrier

log = logging.getLogger("hpc_rl")

SHARD_BYTES = 4 * 1024**3


# Batches generated ahead of the checkpoint's step (token ids, engine log-probs, versions, scores), JSON.
PENDING = "pending_batches.json"


def step_dir(run: RunDir, step: int) -> Path:
    return run.checkpoints / f"step_{step}"


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


def _manifest(root: Path) -> dict:
    files = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != "manifest.json":
            files[str(p.relative_to(root))] = p.stat().st_size
    return {"files": files}


def verify(path: Path) -> bool:
    """True when every file the manifest lists exists with its recorded size."""
    mf = path / "manifest.json"
    try:
        files = json.loads(mf.read_text())["files"]
    except (OSError, ValueError, KeyError):
        return False
    for rel, size in files.items():
        p = path / rel
        try:
            if p.stat().st_size != size:
                return False
        except OSError:
            return False
    return True


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
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
        if pending:
            (tmp / PENDING).write_text(json.dumps(pending))
        write_json_atomic(tmp / "manifest.json", _manifest(tmp))
        fsync_tree(tmp)
        if final.exists():  # a re-run of this step after a resume
            shutil.rmtree(final)
        os.rename(tmp, final)
        write_text_atomic(run.checkpoints / "latest", final.name)  # also makes the rename above durable
        _prune(run, keep_last, final)
    barrier()
    return final if rank == 0 else None


def _prune(run: RunDir, keep_last: int, latest: Path) -> None:
    steps = list_checkpoints(run)
    best = best_checkpoint(run)
    for p in steps[:-keep_last]:
        if p != latest and p != best:
            shutil.rmtree(p, ignore_errors=True)


BEST_JSON = "best.json"


def best_record(run: RunDir) -> dict | None:
    """checkpoints/best.json: {"step", "metric", "value", "mode"} of the best evaluation so far (checkpoint.keep_best)."""
    return read_json(run.checkpoints / BEST_JSON)


def best_checkpoint(run: RunDir) -> Path | None:
    """The checkpoint of the best evaluation, when it was written."""
    rec = best_record(run)
    if rec is None:
        return None
    path = step_dir(run, int(rec["step"]))
    return path if path.is_dir() else None


def link_best(run: RunDir) -> None:
    """Point checkpoints/best at the best evaluation's checkpoint (once it exists); atomic (a new link, renamed)."""
    path = best_checkpoint(run)
    if path is None:
        return
    link = run.checkpoints / "best"
    if link.is_symlink() and os.readlink(link) == path.name:
        return
    tmp = run.checkpoints / ".best.tmp"
    tmp.unlink(missing_ok=True)
    os.symlink(path.name, tmp)
    os.replace(tmp, link)


def record_eval(run: RunDir, row: dict, metric: str, mode: str) -> bool:
    """Keep row's step as the best when its `metric` beats the best so far; True when it does."""
    value = row.get(metric)
    if value is None:
        return False
    rec = best_record(run)
    if rec is not None and rec.get("metric") == metric and \
            not (value > rec["value"] if mode == "max" else value < rec["value"]):
        return False
    run.checkpoints.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run.checkpoints / BEST_JSON, {"step": int(row["step"]), "metric": metric, "value": value,
                                                     "mode": mode})
    link_best(run)
    return True


def list_checkpoints(run: RunDir) -> list[Path]:
    return sorted((p for p in run.checkpoints.glob("step_*") if p.is_dir() and p.name[5:].isdigit()),
                  key=lambda p: int(p.name[5:]))


def find_latest(run: RunDir) -> Path | None:
    """The newest complete checkpoint (manifest verifies); an incomplete one falls back to the one before.

    Newest rather than `latest`: a kill between the rename of step_N and the pointer update leaves a
    complete step_N that `latest` does not name yet; the rename is the commit point.
    """
    candidates = list_checkpoints(run)[::-1]
    for c in candidates:
        if verify(c):
            return c
        log.warning("checkpoint %s is incomplete (files missing or cut short); skipping it", c)
    return None


NOT_FINITE_SUFFIX = ".nonfinite"


def set_aside(run: RunDir, version: int) -> list[Path]:
    """Checkpoints of policy `version` or later hold a policy that is not finite: each is renamed step_N.nonfinite
    (kept for a post-mortem, never resumed: the rename takes it out of list_checkpoints) and `latest` names the
    newest one left (or is removed). Returns the new paths, oldest first."""
    moved = []
    for p in list_checkpoints(run):
        if int(p.name[5:]) >= version:
            dst = p.with_name(p.name + NOT_FINITE_SUFFIX)
            shutil.rmtree(dst, ignore_errors=True)
            os.rename(p, dst)
            moved.append(dst)
    if moved:
        left = list_checkpoints(run)
        if left:
            write_text_atomic(run.checkpoints / "latest", left[-1].name)
        else:
            (run.checkpoints / "latest").unlink(missing_ok=True)
        link = run.checkpoints / "best"
        if link.is_symlink() and not link.exists():
            link.unlink()
    return moved


def load_pending(path: Path) -> list[dict]:
    """The batches a checkpoint holds that were generated ahead and not yet trained on (async rollouts)."""
    f = path / PENDING
    return json.loads(f.read_text()) if f.is_file() else []


def load(path: Path, engines: dict) -> dict:
    """Load every engine's DeepSpeed state (collective) and return the trainer state."""
    for name, engine in engines.items():
        load_path, _ = engine.load_checkpoint(str(path / "deepspeed" / name), tag="state",
                                              load_module_strict=not _has_frozen(engine),
                                              load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if load_path is None:
            raise CheckpointError(f"{path}: no DeepSpeed state for {name}; the checkpoint is incomplete — "
                                  "remove it to resume from an older one")
    return json.loads((path / "trainer_state.json").read_text())
