"""Weight transport helpers shared by every engine, the server and the client: validation against an
engine's param specs, safetensors buckets (HTTP transport), and version folders (file transport)."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from ...errors import RolloutError, first_line

# The client cuts the state dict into buckets of about this many bytes (one tensor never splits).
BUCKET_BYTES = 64 * 1024 * 1024
_VERSION_DIR = re.compile(r"^v(\d+)$")


class WeightError(RolloutError):
    """Pushed weights do not fit the served model (unknown name, wrong shape or dtype kind)."""


def _kind(dtype: torch.dtype) -> str:
    if dtype.is_floating_point:
        return "float"
    if dtype.is_complex:
        return "complex"
    return "bool" if dtype == torch.bool else "int"


def validate_named_tensors(specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                           named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Raise WeightError naming the first tensor whose name, shape or dtype kind the model does not have."""
    for name, t in named:
        spec = specs.get(name)
        if spec is None:
            raise WeightError(f"weights: tensor {name!r} is not a parameter of the served model; push the "
                              "actor's HF state_dict names (e.g. model.layers.0.self_attn.q_proj.weight)")
        shape, dtype = spec
        if tuple(t.shape) != tuple(shape):
            raise WeightError(f"weights: tensor {name!r} has shape {list(t.shape)} but the served model expects "
                              f"{list(shape)}; push weights of the same architecture as model.path")
        if _kind(t.dtype) != _kind(dtype):
            raise WeightError(f"weights: tensor {name!r} has dtype {t.dtype} but the served model expects a "
                              f"{_kind(dtype)} tensor ({dtype}); push the model's own dtype kind")


def buckets(named_tensors: Iterable[tuple[str, torch.Tensor]],
            bucket_bytes: int = BUCKET_BYTES) -> Iterator[dict[str, torch.Tensor]]:
    """Group tensors into dicts of about `bucket_bytes` (CPU, contiguous, never sharing storage)."""
    cur: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in named_tensors:
        # A private copy: safetensors refuses tensors that share storage (tied embeddings, views).
        t = t.detach().to("cpu", copy=True).contiguous()
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > bucket_bytes:
            yield cur
            cur, size = {}, 0
        cur[name] = t
        size += nbytes
    if cur:
        yield cur


def bucket_bytes_of(tensors: dict[str, torch.Tensor]) -> bytes:
    """safetensors serialization of one bucket."""
    from safetensors.torch import save

    return save(tensors)


def tensors_from_bytes(data: bytes) -> list[tuple[str, torch.Tensor]]:
    """Parse a safetensors bucket; WeightError when the bytes are not safetensors."""
    from safetensors.torch import load

    try:
        return list(load(data).items())
    except Exception as e:  # safetensors raises its own SafetensorError / ValueError
        raise WeightError(f"weights: the request body is not a safetensors file ({first_line(e)}); "
                          "send safetensors bytes") from None


def version_dir(weights_root: Path, version: int) -> Path:
    return Path(weights_root) / f"v{version}"


def write_version(weights_root: Path, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]],
                  bucket_bytes: int = BUCKET_BYTES) -> tuple[Path, int]:
    """Write RUN/weights/v{version}/model-NNNNN.safetensors shards atomically (tmp dir, then rename).

    Returns (folder, bytes written). Shards keep memory bounded by one bucket for big models.
    """
    from safetensors.torch import save_file

    root = Path(weights_root)
    root.mkdir(parents=True, exist_ok=True)
    final = version_dir(root, version)
    tmp = root / f".v{version}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    total = 0
    try:
        for i, bucket in enumerate(buckets(named_tensors, bucket_bytes)):
            path = tmp / f"model-{i:05d}.safetensors"
            save_file(bucket, str(path))
            total += path.stat().st_size
        if final.exists():  # a re-push of the same version (e.g. after a resume) replaces it
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final, total


def load_path(path: Path) -> list[tuple[str, torch.Tensor]]:
    """All tensors of one .safetensors file or of every .safetensors file in a folder (sorted)."""
    from safetensors.torch import load_file

    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise WeightError(f"weights: {path} holds no .safetensors file; push weights with the file transport first")
    out: list[tuple[str, torch.Tensor]] = []
    for f in files:
        try:
            out.extend(load_file(str(f)).items())
        except FileNotFoundError:
            raise WeightError(f"weights: {f} does not exist; check the path on the shared filesystem") from None
        except Exception as e:
            raise WeightError(f"weights: {f} is not a readable safetensors file ({first_line(e)})") from None
    return out


def prune_versions(weights_root: Path, keep: int) -> None:
    """Delete RUN/weights/v* folders older than version `keep` (the servers have loaded `keep`)."""
    root = Path(weights_root)
    if not root.is_dir():
        return
    for d in root.iterdir():
        m = _VERSION_DIR.match(d.name)
        if m and int(m.group(1)) < keep and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
