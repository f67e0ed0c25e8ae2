"""Images of multimodal prompt rows: read as verl, HF datasets and jsonl files hold them, checked once at load.

A row's images (the `data.image_key` field, verl's `images`) are a list whose items are encoded image bytes, a
file path (relative: to the data file's directory), a `{"bytes": ..., "path": ...}` mapping (how parquet and HF
datasets store an Image feature) or a PIL image. Each becomes its encoded bytes (PNG for a PIL image), which is what
crosses the wire to the rollout servers and what the trainer decodes again: compact, and the same pixels on both
sides. `<image>` in the prompt marks where each image goes, as in verl's multimodal datasets.
"""

from __future__ import annotations

import io
from pathlib import Path

from ..errors import DataError

# The placeholder a prompt uses for one image (verl's convention); vision.py turns it into the model's own tokens.
IMAGE_PLACEHOLDER = "<image>"


def _pil():
    try:
        from PIL import Image
    except ImportError:
        raise DataError("data: prompts with images need pillow; pip install pillow") from None
    return Image


def encoded_bytes(item, where: str, base: Path | None) -> bytes:
    """One image item as encoded bytes (not yet decoded); DataError naming `where` for what cannot be one."""
    if isinstance(item, dict):
        if item.get("bytes"):
            item = item["bytes"]
        elif item.get("path"):
            item = item["path"]
        else:
            raise DataError(f"{where}: an image mapping without 'bytes' or 'path'; give encoded bytes or a file path")
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    if isinstance(item, str):
        p = Path(item).expanduser()
        if not p.is_absolute() and base is not None:
            p = base / p
        if not p.is_file():
            raise DataError(f"{where}: image file {p} not found; give a path relative to the data file or absolute")
        return p.read_bytes()
    if hasattr(item, "save") and hasattr(item, "size"):  # a PIL image (HF datasets decode Image features)
        buf = io.BytesIO()
        item.save(buf, format="PNG")
        return buf.getvalue()
    raise DataError(f"{where}: an image is {type(item).__name__}; give encoded bytes, a file path or "
                    "{bytes, path}")


def decode(data: bytes, where: str = "image", max_pixels: int | None = None):
    """Encoded bytes -> an RGB PIL image; DataError naming `where` for bytes that are not an image or one with more
    than `max_pixels` pixels (checked from the header, before the pixels are decoded)."""
    Image = _pil()
    try:
        img = Image.open(io.BytesIO(data))
        w, h = img.size
        if max_pixels is not None and w * h > max_pixels:
            raise DataError(f"{where}: the image has {w}x{h} = {w * h} pixels, more than data.max_image_pixels="
                            f"{max_pixels}; shrink it or raise data.max_image_pixels")
        img.load()
    except DataError:
        raise
    except Exception as e:  # PIL raises many types for a corrupt or unknown file (and DecompressionBombError)
        raise DataError(f"{where}: cannot decode the image ({type(e).__name__}: {str(e)[:120]}); give a PNG/JPEG/"
                        "WebP file or its bytes") from None
    return img.convert("RGB")


def row_images(row: dict, idx: int, key: str, where: str, base: Path | None, max_pixels: int,
               section: str = "data") -> list[bytes]:
    """The checked encoded images of row `idx` (empty when it has none); each is decoded once, so that a bad image
    is an error at load naming its row and field, not a failure inside a server."""
    items = row.get(key)
    if items is None:
        return []
    if not isinstance(items, (list, tuple)):
        items = [items]
    out = []
    for j, item in enumerate(items):
        at = f"{where}: row {idx} field '{key}'[{j}]"
        data = encoded_bytes(item, at, base)
        decode(data, at, max_pixels)
        out.append(data)
    return out


def prompt_placeholders(prompt) -> int:
    """How many `<image>` placeholders a prompt (string or chat messages) holds."""
    if isinstance(prompt, str):
        return prompt.count(IMAGE_PLACEHOLDER)
    return sum(m["content"].count(IMAGE_PLACEHOLDER) for m in prompt if isinstance(m.get("content"), str))


def check_placeholders(prompt, n_images: int, idx: int, where: str, prompt_key: str, image_key: str) -> None:
    n = prompt_placeholders(prompt)
    if n != n_images:
        raise DataError(f"{where}: row {idx} has {n_images} image(s) in '{image_key}' but {n} {IMAGE_PLACEHOLDER} "
                        f"placeholder(s) in '{prompt_key}'; put one {IMAGE_PLACEHOLDER} where each image goes")
