"""Vision-language policies (Qwen2-VL / Qwen2.5-VL architecture): the image processor, prompts with images as
token ids, the vision inputs of a forward pass, and its 3-D (M-RoPE) positions.

One convention on both sides of the wire: a prompt's token ids already hold each image's `<|image_pad|>` repeated
as many times as the image has merged patches (the processor's grid), so that lengths, budgets and log-prob
positions are what the model sees; the images travel beside them as encoded bytes and each side turns them into
`pixel_values` with the same processor settings. Positions are computed here from the ids and grids, never left to
the model's cached `rope_deltas` (state shared between concurrent forwards).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
# What one `<image>` placeholder of a prompt becomes before tokenization (Qwen2-VL's chat template writes the same).
IMAGE_TEXT = VISION_START + IMAGE_PAD + VISION_END
# Where a vision-language model's vision tower lives, as parameter/module name prefixes (transformers 5 nests it under
# `model.`; older checkpoints keep it at the top).
VISION_TOWER = ("model.visual.", "visual.")


def is_vision_model(path: str | Path | None) -> bool:
    """Whether the HF folder at `path` holds a vision-language model (its config has a vision tower)."""
    if not path:
        return False
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and "vision_config" in cfg


def policy_auto_class(vision: bool):
    """The transformers auto class of a policy: a vision-language model's (its forward takes pixel_values) or a
    causal LM's."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if vision else AutoModelForCausalLM


def load_image_processor(path: str | Path, min_pixels: int | None = None, max_pixels: int | None = None,
                         key: str = "model.path"):
    """The folder's image processor (preprocessor_config.json), with model.processor's pixel bounds over the
    folder's. The PIL backend: torchvision (the fast one's dependency) is not part of the CPU stack."""
    if not (Path(path) / "preprocessor_config.json").is_file():
        raise ModelError(f"{key}: {path} is a vision-language model without preprocessor_config.json; copy the "
                         "processor files (preprocessor_config.json) from the model's hub folder")
    from transformers import AutoImageProcessor

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proc = AutoImageProcessor.from_pretrained(str(path), use_fast=False)
    if min_pixels is not None or max_pixels is not None:
        size = dict(getattr(proc, "size", None) or {})
        if min_pixels is not None:
            size["shortest_edge"] = int(min_pixels)
        if max_pixels is not None:
            size["longest_edge"] = int(max_pixels)
        proc.size = size
    return proc


@dataclass
class VisionSpec:
    """What encoding needs of a vision model: its image processor, the pad token and the merge factor."""

    processor: object
    image_pad_id: int
    merge: int  # merged patches per image token: spatial_merge_size^2
    image_text: str = IMAGE_TEXT  # what a prompt's `<image>` is written as before tokenization

    @classmethod
    def of(cls, path: str | Path, tokenizer, min_pixels: int | None = None, max_pixels: int | None = None,
           key: str = "model.path") -> VisionSpec:
        proc = load_image_processor(path, min_pixels, max_pixels, key)
        pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        if pad is None or pad == tokenizer.unk_token_id:
            raise ModelError(f"{key}: the tokenizer of {path} has no {IMAGE_PAD} token; a Qwen2-VL-family "
                             "tokenizer is needed")
        return cls(proc, int(pad), int(getattr(proc, "merge_size", 2)) ** 2)

    @classmethod
    def for_job(cls, cfg, tokenizer) -> VisionSpec | None:
        """The policy's (model.path, model.processor), None for a text model."""
        if not is_vision_model(cfg.model.path):
            return None
        pr = cfg.model.processor
        return cls.of(cfg.model.path, tokenizer, pr.min_pixels, pr.max_pixels)

    def pixels(self, images: list[bytes]):
        """Encoded images -> (pixel_values (patches, dim), image_grid_thw (images, 3)) as the model takes them."""
        from ..data.images import decode

        out = self.processor(images=[decode(b) for b in images], return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    def tokens_per_image(self, images: list[bytes]) -> list[int]:
        """Each image's token count, from its size alone (the header; the processor's resize rule)."""
        import io

        from PIL import Image

        out = []
        for b in images:
            w, h = Image.open(io.BytesIO(b)).size
            out.append(self.processor.get_number_of_image_patches(h, w, {}) // self.merge)
        return out

    def expand(self, ids: list[int], images: list[bytes]) -> list[int]:
        """Token ids with each single image pad (one per image, in order) repeated to the image's token count."""
        n = ids.count(self.image_pad_id)
        if n != len(images):
            raise ModelError(f"a prompt's token ids hold {n} {IMAGE_PAD} token(s) for {len(images)} image(s); the "
                             "chat template must keep each <image> of the prompt")
        counts = iter(self.tokens_per_image(images))
        out: list[int] = []
        for t in ids:
            out.extend([t] * next(counts) if t == self.image_pad_id else [t])
        return out


@dataclass
class RowPixels:
    """The processed images of a batch's rows (a vision-language policy): each row's pixel_values and grids, and a
    key naming its images, so that a micro-batch of any rows gets its vision inputs without processing the images
    again, and the vision tower runs once per distinct picture: the samples of a group share their prompt's."""

    pixel_values: list  # per row: (patches, dim) float tensor (0 patches: a row without images)
    grids: list  # per row: (images, 3) long tensor
    image_pad_id: int
    keys: list  # per row: the index of its images among the batch's distinct image lists

    @classmethod
    def of(cls, spec: VisionSpec, rows_images: list[list[bytes]]) -> RowPixels:
        import torch

        done: dict[tuple, int] = {}
        pv, grids, keys = [], [], []
        processed: list[tuple] = []
        for imgs in rows_images:
            key = done.setdefault(tuple(imgs), len(done))
            if key == len(processed):
                processed.append(spec.pixels(imgs) if imgs else
                                 (torch.zeros(0), torch.zeros((0, 3), dtype=torch.long)))
            pv.append(processed[key][0])
            grids.append(processed[key][1])
            keys.append(key)
        return cls(pv, grids, spec.image_pad_id, keys)

    def select(self, idx) -> RowPixels:
        import torch

        if isinstance(idx, slice):
            rows = list(range(len(self.grids)))[idx]
        elif isinstance(idx, torch.Tensor):
            rows = (idx.nonzero().flatten() if idx.dtype == torch.bool else idx.flatten()).tolist()
        else:
            rows = list(idx)
        return RowPixels([self.pixel_values[i] for i in rows], [self.grids[i] for i in rows], self.image_pad_id,
                         [self.keys[i] for i in rows])

    def to(self, device) -> RowPixels:
        moved: dict[int, tuple] = {}  # a distinct image list moves once
        for i, k in enumerate(self.keys):
            if k not in moved:
                moved[k] = (self.pixel_values[i].to(device), self.grids[i].to(device))
        return RowPixels([moved[k][0] for k in self.keys], [moved[k][1] for k in self.keys], self.image_pad_id,
                         list(self.keys))

    def inputs(self, model) -> dict:
        """The forward kwargs of all rows' images, in row order: the vision tower's output (`mm_encoder_outputs`,
        computed here once per distinct image list, so its gradient sums over the rows that use it) and
        image_grid_thw (for the positions); {} when no row has an image."""
        import torch
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        rows = [i for i, g in enumerate(self.grids) if g.numel()]
        if not rows:
            return {}
        first: dict[int, int] = {}
        for i in rows:
            first.setdefault(self.keys[i], i)
        distinct = list(first)
        inner = getattr(model, "module", model)  # a DeepSpeed engine's module: ZeRO-3's hooks are on the submodules
        feats = inner.get_image_features(torch.cat([self.pixel_values[first[k]] for k in distinct]),
                                         torch.cat([self.grids[first[k]] for k in distinct]),
                                         return_dict=True).pooler_output  # one tensor per image
        per_key, j = {}, 0
        for k in distinct:
            n = self.grids[first[k]].shape[0]
            per_key[k], j = feats[j:j + n], j + n
        images = tuple(f for i in rows for f in per_key[self.keys[i]])
        return {"mm_encoder_outputs": {"image": BaseModelOutputWithPooling(pooler_output=images)},
                "image_grid_thw": torch.cat([self.grids[i] for i in rows])}


def mrope_positions(model, input_ids, attention_mask, image_grid_thw, image_pad_id: int):
    """(3, B, L) M-RoPE positions of a padded batch (padding anywhere): images' tokens get their (t, h, w) grid
    positions, text counts on from there, as the model's own get_rope_index does."""
    inner = getattr(model, "module", model)  # a DeepSpeed engine's module
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # PEFT's
    inner = getattr(inner, "model", inner)
    mm = (input_ids == image_pad_id).int()
    pos, _ = inner.get_rope_index(input_ids, mm, image_grid_thw=image_grid_thw, attention_mask=attention_mask)
    return pos


def check_vision_job(cfg) -> None:
    """ConfigError naming the key of what a vision-language policy does not run with yet."""
    from ..errors import ConfigError

    unsupported = [
        (cfg.rollout.engine == "vllm", "rollout.engine", "serve it with rollout.engine: hf (or auto)"),
        (cfg.algorithm.uses_critic, "algorithm.name", f"use a critic-free algorithm (not {cfg.algorithm.name})"),
        (bool(cfg.rollout.env or cfg.rollout.agent), "rollout.env", "use single-turn prompts"),
        (cfg.reward.model is not None, "reward.model", "score with reward.function or reward.judge"),
        (cfg.services.teacher is not None and not is_vision_model(cfg.services.teacher.path), "services.teacher",
         "distill from a vision-language teacher with the policy's tokenizer (a text model cannot see the images)"),
    ]
    for bad, key, fix in unsupported:
        if bad:
            raise ConfigError(f"{key}: a vision-language policy ({cfg.model.path or 'model.tiny'}) does not run with this "
                              f"yet; {fix}")
