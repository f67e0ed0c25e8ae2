"""The DeepSpeed engines of a trainer rank: actor and critic (ZeRO-3, trained) and a frozen reference."""

from __future__ import annotations

import logging
import math
import sys
import types
import warnings

import torch

from ..config import JobConfig
from ..models.loading import check_model_dir, torch_dtype
from ..models.lora import CRITIC_HEAD, in_modules, policy_skip, with_adapters
from ..models.vision import VISION_TOWER, is_vision_model, policy_auto_class
from . import ds_config, zero3_gather
from .optimizer import make_optimizer

log = logging.getLogger("hpc_rl")


def _from_pretrained(auto_cls, path: str, cfg: JobConfig, ds: dict, device_kind: str, dtype: str | None = None,
                     trust_remote_code: bool | None = None, **config_kwargs):
    """Load under an active HfDeepSpeedConfig so ZeRO-3 partitions the weights while they load; config_kwargs
    override the folder's config (keys the model class does not take, too). dtype and trust_remote_code default
    to the policy's."""
    from transformers import AutoConfig
    from transformers.integrations import HfDeepSpeedConfig

    check_model_dir(path)
    trust = cfg.model.trust_remote_code if trust_remote_code is None else trust_remote_code
    kwargs = {}
    if config_kwargs:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
        for key, value in config_kwargs.items():
            setattr(config, key, value)
        kwargs["config"] = config
    keep_alive = HfDeepSpeedConfig(ds) if ds["zero_optimization"]["stage"] == 3 else None  # noqa: F841
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = auto_cls.from_pretrained(path, dtype=torch_dtype(dtype or cfg.model.dtype),
                                         attn_implementation=cfg.model.attn_implementation,
                                         trust_remote_code=trust, **kwargs)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    if ds["zero_optimization"]["stage"] == 3 and device_kind == "cpu":
        fetch_blocks_whole(model, ds)
    return model, keep_alive


def fetch_blocks_whole(model, ds: dict) -> None:
    """ZeRO-3 fetches each transformer block's weights in one go (a DeepSpeed leaf module: no hooks on its parts)
    where the block is no larger than the prefetch bucket.

    On CPU gloo runs every fetch in line with the compute, and in a small model a block's ~10 fetches and ~40 hooks
    cost more than its arithmetic (the toy's update: 65 -> 57 ms a step). The bucket bounds the memory as DeepSpeed's
    prefetching does. On GPUs the fetches overlap the compute on their own stream, and the default stays."""
    from deepspeed.utils import set_z3_leaf_modules

    names = set(getattr(model, "_no_split_modules", None) or [])
    limit = float(ds["zero_optimization"].get("stage3_prefetch_bucket_size", 5e7))
    blocks = [m for m in model.modules() if type(m).__name__ in names
              and sum(getattr(p, "ds_numel", p.numel()) for p in m.parameters()) <= limit]
    if blocks:
        set_z3_leaf_modules(model, list({type(m) for m in blocks}))


def _with_lora(model, lora, key: str, keep_trained: tuple[str, ...] = (), skip_prefixes: tuple[str, ...] = ()):
    """`model` wrapped by PEFT with adapters on the linear modules `lora` targets (none under `skip_prefixes`);
    everything else frozen except the modules named in `keep_trained` (a critic's value head). Under ZeRO-3 the
    base weights stay partitioned."""
    if lora is None:
        return model
    model = with_adapters(model, lora, key, exclude=keep_trained, skip_prefixes=skip_prefixes)
    for name, p in model.named_parameters():
        if in_modules(name, keep_trained):
            p.requires_grad_(True)
    # Each adapted layer is one ZeRO-3 leaf: its parameters are fetched together at its forward, with no hooks
    # on its A, B and dropout submodules (with them, a 25M model's forward took 1.85x as long on CPU).
    from deepspeed.utils import set_z3_leaf_modules
    from peft.tuners.lora import LoraLayer

    set_z3_leaf_modules(model, [LoraLayer])
    model.enable_input_require_grads()
    return model


def parameter_counts(model) -> tuple[int, int]:
    """(trainable, all) parameters of a model, partitioned by ZeRO-3 or not."""
    trainable = total = 0
    for p in model.parameters():
        n = getattr(p, "ds_numel", None) or p.numel()
        total += n
        trainable += n if p.requires_grad else 0
    return trainable, total


def lr_factor(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """The multiple of the base learning rate at optimizer step `step` (0-based): linear warm-up over `warmup`
    steps, then constant or a linear/cosine decay that reaches `min_ratio` at step `total` - 1."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(total - 1 - warmup, 1)
    progress = min(1.0, (step - warmup) / span)
    shape = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * shape


def _scheduler(optimizer, cfg: JobConfig):
    t = cfg.trainer
    total = cfg.optimizer_steps
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, t.warmup_steps, total, t.lr_schedule, t.min_lr_ratio))


MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def _deepspeed():
    """deepspeed, with its Muon optimizer's module replaced by a placeholder class.

    DeepSpeed's ZeRO and bf16 optimizers import MuonWithAuxAdam only to check whether the optimizer they wrap is one;
    importing it decorates Muon's kernels with torch.compile, which imports torch's compiler stack: ~3 CPU-s at
    every rank's start (a third of a toy rank's engine build). hpc-rl hands DeepSpeed its own optimizer (never Muon),
    so the check is answered by a class nothing is an instance of."""
    import deepspeed

    if MUON_MODULE not in sys.modules:
        placeholder = types.ModuleType(MUON_MODULE, "hpc-rl's stand-in: hpc-rl never builds DeepSpeed's Muon")

        class MuonWithAuxAdam:  # noqa: D401 - never instantiated
            """Nothing hpc-rl builds is an instance of it."""

        placeholder.MuonWithAuxAdam = MuonWithAuxAdam
        sys.modules[MUON_MODULE] = placeholder
    return deepspeed


def freeze_vision_tower(model) -> int:
    """Freeze a vision-language model's vision tower (model.train_vision: false); the number of weights frozen."""
    n = 0
    for name, p in model.named_parameters():
        if name.startswith(VISION_TOWER):
            p.requires_grad_(False)
            n += 1
    return n


def build_actor(cfg: JobConfig, world_size: int, device_kind: str):
    deepspeed = _deepspeed()

    ds = ds_config.render(cfg, world_size, device_kind)
    model, keep = _from_pretrained(policy_auto_class(is_vision_model(cfg.model.path)), cfg.model.path, cfg, ds,
                                   device_kind)
    if is_vision_model(cfg.model.path) and not cfg.model.train_vision:
        freeze_vision_tower(model)
    model = _with_lora(model, cfg.model.lora, "model.lora", skip_prefixes=policy_skip(cfg))
    opt = make_optimizer(model, cfg.trainer.lr, cfg)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=_scheduler(opt, cfg), config=ds)
    engine._hpc_rl_keep = keep
    return engine


def build_critic(cfg: JobConfig, world_size: int, device_kind: str):
    """A token-classification model with one label: the value of every position."""
    deepspeed = _deepspeed()
    from transformers import AutoModelForTokenClassification

    ds = ds_config.render(cfg, world_size, device_kind)
    path = cfg.model.critic_path or cfg.model.path
    # transformers' token-classification head applies dropout 0.1 by default: in train mode the values of
    # the update would be noisy copies of the (eval-mode) old values that value clipping compares them with.
    model, keep = _from_pretrained(AutoModelForTokenClassification, path, cfg, ds, device_kind, num_labels=1,
                                   classifier_dropout=0.0)
    model = _with_lora(model, cfg.model.critic_lora, "model.critic_lora", keep_trained=CRITIC_HEAD)
    opt = make_optimizer(model, cfg.trainer.critic_lr or cfg.trainer.lr, cfg)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=_scheduler(opt, cfg), config=ds)
    engine._hpc_rl_keep = keep
    return engine


def build_reference(cfg: JobConfig, world_size: int, device_kind: str):
    """The frozen initial policy for KL, as a ZeRO-3 inference engine (no optimizer state)."""
    deepspeed = _deepspeed()

    ds = ds_config.render(cfg, world_size, device_kind, train=False)
    model, keep = _from_pretrained(policy_auto_class(is_vision_model(cfg.model.path)), cfg.model.path, cfg, ds,
                                   device_kind)
    for p in model.parameters():
        p.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=ds)
    engine.eval()
    engine._hpc_rl_keep = keep
    return engine


def build_reward_model(cfg: JobConfig, world_size: int, device_kind: str):
    """The reward model (sequence classifier, frozen) as a ZeRO-3 inference engine: partitioned over the trainer
    ranks like the reference model. Returns (engine, its tokenizer, the head's label to read)."""
    deepspeed = _deepspeed()
    from transformers import AutoModelForSequenceClassification

    from ..rewards.model import check_reward_model

    rm = cfg.reward.model
    label, tok = check_reward_model(rm)
    ds = ds_config.render(cfg, world_size, device_kind, train=False, dtype=rm.dtype)
    model, keep = _from_pretrained(AutoModelForSequenceClassification, rm.path, cfg, ds, device_kind, dtype=rm.dtype,
                                   trust_remote_code=rm.trust_remote_code, pad_token_id=tok.pad_token_id)
    model.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=ds)
    engine.eval()
    engine._hpc_rl_keep = keep
    return engine, tok, label


def zero3_owned(param, rank: int) -> torch.Tensor:
    """The elements of a ZeRO-3 parameter that partition `rank` holds, without the padding that evens out the last
    partitions: DeepSpeed allocates each partition with torch.empty and never writes its padding, so those values are
    whatever the memory held (a NaN there is no NaN of the model: a 1-element bias over 2 ranks is all padding on
    rank 1)."""
    size = param.ds_tensor.numel()
    real = max(0, min(size, int(param.ds_numel) - rank * size))
    return param.ds_tensor.view(-1)[:real]


def params_finite(engine) -> bool:
    """Whether this rank's part of the engine's trainable weights is finite (under ZeRO-3 its partition: the ranks
    together check every weight once). One device sync."""
    parts = []
    for p in engine.module.parameters():
        if not p.requires_grad:
            continue
        if hasattr(p, "ds_tensor"):
            group = getattr(p, "ds_process_group", None)
            parts.append(zero3_owned(p, torch.distributed.get_rank(group=group)))
        else:
            parts.append(p.data)
    parts = [t for t in parts if t.numel()]
    if not parts:
        return True
    return not bool(torch.stack([(~torch.isfinite(t)).any() for t in parts]).any())


def adapter_state_dict(engine) -> dict[str, torch.Tensor] | None:
    """The LoRA adapters of a PEFT-wrapped engine's model under their wire names (models.lora), gathered from
    ZeRO-3 (small: only the adapters). Collective; CPU tensors on rank 0, None elsewhere."""
    deepspeed = _deepspeed()

    from ..models.lora import wire_name

    named = [(wire_name(n), p) for n, p in engine.module.named_parameters() if wire_name(n)]
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
        out = {n: p.detach().to("cpu", copy=True) for n, p in named} if rank == 0 else None
    return out


def policy_state_dict(engine, lora: bool) -> dict[str, torch.Tensor] | None:
    """What a weight sync pushes: the adapters under LoRA, else the whole HF state dict (collective)."""
    return adapter_state_dict(engine) if lora else gather_state_dict(engine)


def gather_state_dict(engine, on_rank0_only: bool = True) -> dict[str, torch.Tensor] | None:
    """The full HF state dict of a ZeRO-3 engine's model, with bounded peak memory: on a CPU trainer in buckets of
    whole parameters, one collective each (zero3_gather), else module by module.

    Collective: every rank must call it. Returns CPU tensors on rank 0 (None elsewhere when on_rank0_only).
    """
    model = engine.module
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    mine = rank == 0 or not on_rank0_only
    # A tied parameter (an output layer sharing the embedding) is here under both names, as in the state dict.
    named = [(f"{mod_name}.{pname}" if mod_name else pname, p) for mod_name, module in model.named_modules()
             for pname, p in module.named_parameters(recurse=False)]
    out: dict[str, torch.Tensor] = {}
    if zero3_gather.usable([p for _, p in named]):
        unique = list({id(p): p for _, p in named}.values())
        whole = zero3_gather.gather_whole(unique, on_rank0_only)
        if mine:
            by_id = dict(zip(map(id, unique), whole))
            seen: set[int] = set()
            for key, p in named:  # each name its own tensor, as the module-by-module gather gives them
                out[key] = by_id[id(p)].clone() if id(p) in seen else by_id[id(p)]
                seen.add(id(p))
    else:
        out = gather_module_by_module(model, mine)
    if mine:
        persistent = set(model.state_dict(keep_vars=True))
        for name, buf in model.named_buffers():
            if name in persistent:
                out[name] = buf.detach().to("cpu", copy=True)
    if on_rank0_only and rank != 0:
        return None
    return out


def gather_module_by_module(model, mine: bool) -> dict[str, torch.Tensor]:
    """The parameters of a ZeRO-3 (or unpartitioned) model under their state-dict names, each module's gathered by
    DeepSpeed in turn; collective; empty where not `mine`."""
    deepspeed = _deepspeed()
    out: dict[str, torch.Tensor] = {}
    for mod_name, module in model.named_modules():
        params = list(module.named_parameters(recurse=False))
        if not params:
            continue
        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
            if mine:
                for pname, p in params:
                    out[f"{mod_name}.{pname}" if mod_name else pname] = p.detach().to("cpu", copy=True)
    return out
