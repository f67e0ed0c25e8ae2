"""The model section: the policy (and critic) weights, their precision, LoRA adapters, and the tiny offline models."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from .job import JobConfig


@dataclass
class TinyModelConfig:
    """A small random-init model built offline (tests and CPU toys); saved as a normal HF folder."""

    # Architecture of the HF model class built from a config; qwen2_vl / qwen2_5_vl: a vision-language model
    # (Qwen2-VL's or Qwen2.5-VL's vision tower, 14-pixel patches merged 2x2, and its image processor).
    arch: Literal["qwen2", "llama", "qwen2_vl", "qwen2_5_vl"] = "qwen2"
    # Width of the residual stream.
    hidden_size: int = 128
    # Transformer blocks.
    num_layers: int = 2
    # Attention (query) heads.
    num_heads: int = 2
    # Key/value heads (grouped-query attention when fewer than num_heads; must divide it).
    num_kv_heads: int = 2
    # Per-head width; vLLM's CPU attention rejects 16, 64 works on both engines.
    head_dim: int = 64
    # Width of the MLP.
    intermediate_size: int = 256
    # Longest sequence the model's position embeddings cover.
    max_position_embeddings: int = 512
    # Seed of the random initial weights (the tokenizer is trained on the task's symbols).
    init_seed: int = 0
    # Standard deviation of the random initial weights (transformers' initializer_range). A frozen output layer
    # (LoRA) bounds the logits by about init_std^2 x hidden_size x the final norm's width: 0.02 leaves a
    # 128-wide model's policy close to uniform whatever its adapters learn.
    init_std: float = 0.02
    # qwen2_vl / qwen2_5_vl: blocks of the vision tower.
    vision_layers: int = 1
    # qwen2_vl: width of the vision tower (a multiple of 16: heads of 16; its merger projects to hidden_size).
    vision_width: int = 32
    # qwen2_vl: the image processor resizes every image to at least this many pixels (56x56: 4 image tokens).
    min_pixels: int = 3136
    # qwen2_vl: ... and to at most this many (112x112: 16 image tokens).
    max_pixels: int = 12544


@dataclass
class ProcessorConfig:
    """A vision-language model's image processor: pixel bounds over the model folder's preprocessor_config.json."""

    # Every image is resized to at least this many pixels (null: the folder's min_pixels).
    min_pixels: int | None = None
    # ... and at most this many (null: the folder's max_pixels); fewer pixels, fewer image tokens.
    max_pixels: int | None = None


@dataclass
class LoraConfig:
    """Low-rank adapters (PEFT LoRA) on linear modules of the body; the base weights stay frozen."""

    # Rank r of each adapter (A: r x in, B: out x r).
    rank: int = 8
    # The adapters' output is scaled by alpha / rank.
    alpha: float = 16.0
    # Dropout on an adapter's input in training (0: none; > 0 costs one more no-grad forward per step).
    dropout: float = 0.0
    # Linear modules to adapt: module names or name suffixes (q_proj, v_proj, ...), or [all-linear] (every
    # linear layer of the body; never the output layer or the critic's value head).
    target_modules: list = field(default_factory=lambda: ["all-linear"])


@dataclass
class ModelConfig:
    """The policy (actor); the critic and the reference start from the same weights unless named."""

    # HF model folder (config.json, weights, tokenizer files) of the policy; or set `tiny` instead. A relative path is
    # read from the job file's directory (then the hpc-rl checkout, then the current directory), as every path here.
    path: str | None = None
    # Build a tiny random model offline instead of loading `path` (toys and tests).
    tiny: TinyModelConfig | None = None
    # HF folder the critic starts from (PPO); null: the policy's weights with a fresh value head.
    critic_path: str | None = None
    # Training precision of actor, critic and reference.
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # Attention kernel of the trainer's models (flash_attention_2 needs the flash-attn package and a GPU).
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] = "sdpa"
    # Recompute activations in the backward pass: less memory, ~30% more compute.
    gradient_checkpointing: bool = False
    # Allow code shipped inside the model folder to run (transformers' trust_remote_code).
    trust_remote_code: bool = False
    # Train the actor through LoRA adapters (null: all weights); the reference is then the actor with its
    # adapters off, and weight syncs push only the adapters.
    lora: LoraConfig | None = None
    # A vision-language policy's image processor settings.
    processor: ProcessorConfig = field(default_factory=ProcessorConfig)
    # Train the vision tower too (a vision-language policy); false: it stays frozen and LoRA adapts the language
    # tower only.
    train_vision: bool = False
    # Train the critic's body through LoRA adapters (its value head stays fully trained); null: all weights.
    critic_lora: LoraConfig | None = None


def check(cfg: JobConfig, need) -> None:
    m, a = cfg.model, cfg.algorithm
    need(m.path is not None or m.tiny is not None,
         "model.path: no model given; set model.path to an HF model folder (or model.tiny for a toy model)")
    need(m.path is None or m.tiny is None, "model.tiny: set either model.path or model.tiny, not both")
    if m.tiny is not None:
        tm = m.tiny
        need(tm.num_kv_heads > 0 and tm.num_heads % tm.num_kv_heads == 0,
             "model.tiny.num_kv_heads must divide model.tiny.num_heads")
        need(tm.hidden_size > 0 and tm.num_layers > 0 and tm.head_dim > 0, "model.tiny: sizes must be positive")
    pr = m.processor
    for key, v in (("min_pixels", pr.min_pixels), ("max_pixels", pr.max_pixels)):
        need(v is None or v >= 784, f"model.processor.{key} must be >= 784 (one 28x28 image token); got {v}")
    need(pr.min_pixels is None or pr.max_pixels is None or pr.min_pixels <= pr.max_pixels,
         "model.processor.min_pixels must not exceed model.processor.max_pixels")
    need(cfg.data.max_image_pixels >= 1, f"data.max_image_pixels must be >= 1; got {cfg.data.max_image_pixels}")
    if m.tiny is not None and m.tiny.arch in ("qwen2_vl", "qwen2_5_vl"):
        need(784 <= m.tiny.min_pixels <= m.tiny.max_pixels,
             "model.tiny.min_pixels must be >= 784 and not exceed model.tiny.max_pixels")
        need(m.tiny.vision_width % 16 == 0 and m.tiny.vision_layers >= 1,
             "model.tiny.vision_width must be a multiple of 16 and vision_layers >= 1")
    for key, lora in (("model.lora", m.lora), ("model.critic_lora", m.critic_lora)):
        if lora is None:
            continue
        need(lora.rank >= 1, f"{key}.rank must be >= 1; got {lora.rank}")
        need(lora.alpha > 0, f"{key}.alpha must be > 0; got {lora.alpha}")
        need(0 <= lora.dropout < 1, f"{key}.dropout must be in [0, 1); got {lora.dropout}")
        need(bool(lora.target_modules) and all(isinstance(x, str) and x.strip() for x in lora.target_modules),
             f"{key}.target_modules must be a non-empty list of module names (e.g. [q_proj, v_proj]) or [all-linear]")
        need("all-linear" not in lora.target_modules or len(lora.target_modules) == 1,
             f"{key}.target_modules: all-linear already names every linear module; give it alone")
    need(m.critic_lora is None or a.uses_critic,
         f"model.critic_lora: algorithm {a.name} has no critic; remove model.critic_lora")
