"""Prompt datasets: toy generators, jsonl, parquet, HF `datasets` (verl-compatible fields), reasoning-gym tasks."""

from __future__ import annotations

import json
from pathlib import Path

from ..config import DataConfig
from ..errors import DataError, first_line
from .images import IMAGE_PLACEHOLDER, check_placeholders, row_images
from .toy import toy_corpus, toy_rows

# verl's parquet rows carry the reference answer under reward_model.ground_truth.
_NESTED_FIELDS = ("reward_model", "extra_info")


def _normalize_row(row: dict, idx: int, prompt_key: str, where: str, section: str = "data") -> dict:
    if not isinstance(row, dict):
        raise DataError(f"{where}: row {idx} is {type(row).__name__}, not an object; each row needs a "
                        f"'{prompt_key}' field")
    if prompt_key not in row:
        raise DataError(f"{where}: row {idx} has no '{prompt_key}' field; set {section}.prompt_key to the field that "
                        f"holds the prompt (row has: {', '.join(map(str, row))})")
    prompt = row[prompt_key]
    if isinstance(prompt, list):  # chat messages, as in verl datasets
        if not all(isinstance(m, dict) and "content" in m for m in prompt):
            raise DataError(f"{where}: row {idx} field '{prompt_key}' is a list but not of chat messages "
                            "({'role', 'content'})")
    elif not isinstance(prompt, str):
        raise DataError(f"{where}: row {idx} field '{prompt_key}' is {type(prompt).__name__}; it must be a string "
                        "or a list of chat messages")
    if (isinstance(prompt, str) and not prompt.strip()) or (isinstance(prompt, list) and not prompt):
        raise DataError(f"{where}: row {idx} has an empty prompt; remove it or fill it in")
    out = dict(row)
    out["prompt"] = prompt
    for nested in _NESTED_FIELDS:
        if isinstance(row.get(nested), dict):
            for k, v in row[nested].items():
                out.setdefault(k, v)
    out.setdefault("id", idx)
    return out


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg}); each line must be one JSON object") \
                        from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 (byte {e.start}); convert the file to UTF-8") from None
    return rows


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow; pip install pyarrow") from None
    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises many types for a corrupt file
        raise DataError(f"{path}: cannot read parquet ({first_line(e)}); check the file") from None


def _read_hf(name: str, split: str, section: str = "data") -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{section}.source: hf: datasets need the `datasets` package; pip install datasets") from None
    try:
        if Path(name).is_dir():
            ds = datasets.load_from_disk(name)
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[split]
        else:
            ds = datasets.load_dataset(name, split=split)
    except Exception as e:
        raise DataError(f"{section}.source: cannot load HF dataset {name!r} split {split!r} "
                        f"({first_line(e)}); check the name/folder and {section}.split") from None
    return [dict(r) for r in ds]


def load_rows(cfg: DataConfig, seed: int, section: str = "data") -> list[dict]:
    """All prompt rows of the dataset, normalized to have `prompt` (str or chat list) and `id`; errors name the
    config section the source comes from (data, or eval for held-out prompts)."""
    src = cfg.source
    base = None  # where a row's relative image paths are read from: the data file's (or dataset folder's) directory
    if src.startswith("toy:"):
        raw = toy_rows(src[4:], cfg.toy_size, seed, cfg.split, section)
        where = src
    elif src.startswith("reasoning_gym:"):
        from .reasoning_gym import reasoning_gym_rows

        raw = reasoning_gym_rows(src[len("reasoning_gym:"):], cfg.kwargs, seed, section)
        where = src
    elif src.startswith("verifiers:"):
        from .verifiers_tasks import verifiers_rows

        raw = verifiers_rows(src, cfg.kwargs, section)
        where = src
    elif src.startswith("hf:"):
        raw = _read_hf(src[3:], cfg.split, section)
        where = src
        base = Path(src[3:]) if Path(src[3:]).is_dir() else None
    else:
        path = Path(src)
        if not path.is_file():
            raise DataError(f"{section}.source: {src} not found; give a .jsonl/.parquet file, hf:NAME, toy:NAME, "
                            "reasoning_gym:TASK or verifiers:ID")
        if path.suffix == ".jsonl" or path.suffix == ".json":
            raw = _read_jsonl(path)
        elif path.suffix == ".parquet":
            raw = _read_parquet(path)
        else:
            raise DataError(f"{section}.source: {src} has suffix {path.suffix!r}; use .jsonl or .parquet")
        where = src
        base = path.parent
    if not raw:
        raise DataError(f"{where}: the dataset is empty; it needs at least one prompt row")
    rows = [_normalize_row(r, i, cfg.prompt_key, where, section) for i, r in enumerate(raw)]
    if any(r.get(cfg.image_key) is not None for r in rows):
        for i, r in enumerate(rows):
            r["images"] = row_images(r, i, cfg.image_key, where, base, cfg.max_image_pixels, section)
            check_placeholders(r["prompt"], len(r["images"]), i, where, cfg.prompt_key, cfg.image_key)
    return rows


def tokenizer_corpus(cfg: DataConfig, seed: int) -> list[str]:
    """Text a tiny tokenizer is trained on: the toy task's symbols, or the dataset's prompts and answers."""
    if cfg.source.startswith("toy:"):
        return toy_corpus(cfg.source[4:])
    lines = []
    for row in load_rows(cfg, seed):
        p = row["prompt"]
        lines.append(p if isinstance(p, str) else " ".join(m["content"] for m in p))
        for key in ("ground_truth", cfg.completion_key):  # an answer, an SFT completion
            if isinstance(row.get(key), (str, int, float)):
                lines.append(str(row[key]))
    return lines


def render_prompt(row: dict, tokenizer, image_text: str | None = None) -> str:
    """The prompt text: chat messages go through the tokenizer's chat template when it has one. With `image_text`
    (a vision model's image tokens, models/vision.py), each `<image>` of a row with images is written as it."""
    p = row["prompt"]
    if row.get("images") and image_text:
        p = p.replace(IMAGE_PLACEHOLDER, image_text) if isinstance(p, str) else \
            [{**m, "content": m["content"].replace(IMAGE_PLACEHOLDER, image_text)} for m in p]
    if isinstance(p, str):
        return p
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
    return "\n".join(f"{m.get('role', 'user')}: {m['content']}" for m in p)


class PromptDataset:
    """Rows plus their token ids; prompts longer than data.max_prompt_tokens are rejected at load. With a vision
    model (`vision`: models.vision.VisionSpec), a row's images are in `images[i]` (encoded bytes) and its token ids
    hold each image's tokens, so that lengths count them."""

    def __init__(self, cfg: DataConfig, tokenizer, seed: int, section: str = "data", vision=None):
        self.rows = load_rows(cfg, seed, section)
        self.texts = [render_prompt(r, tokenizer, vision.image_text if vision else None) for r in self.rows]
        self.token_ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in self.texts]
        self.images = [r.get("images") or [] for r in self.rows]
        if any(self.images):
            if vision is None:
                raise DataError(f"{section}.source {cfg.source}: its rows hold images ('{cfg.image_key}') but the "
                                "policy is a text model; use a vision-language model (Qwen2-VL family, or "
                                "model.tiny.arch: qwen2_vl) or drop the images")
            for i, imgs in enumerate(self.images):
                if imgs:
                    self.token_ids[i] = vision.expand(self.token_ids[i], imgs)
        for i, ids in enumerate(self.token_ids):
            if not ids:
                raise DataError(f"{section}.source {cfg.source}: row {i} tokenizes to nothing; remove it or fix the prompt")
            if len(ids) > cfg.max_prompt_tokens:
                raise DataError(f"{section}.source {cfg.source}: row {i} has {len(ids)} prompt tokens, more than "
                                f"data.max_prompt_tokens={cfg.max_prompt_tokens}; raise it (and "
                                "rollout.max_model_len) or filter long prompts")

    def __len__(self) -> int:
        return len(self.rows)
