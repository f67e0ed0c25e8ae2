"""Job checks (`hpc-rl doctor --job`): model folder, pad token, architectures, GPU placement, reward, agent, bind
address."""

from __future__ import annotations

import ipaddress
import json
import re
from pathlib import Path

from ..config.trainer import node_range
from ..errors import HpcRlError, first_line
from ..models.sft_built import is_sft_spec
from ..models.sft_built import parse as parse_sft_spec
from .base import FAIL, OK, WARN, Ctx, Result, check

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _model_dir(ctx: Ctx) -> Path | None:
    p = ctx.job.model.path
    return Path(p) if p and Path(p).is_dir() else None


def _hub_id(ctx: Ctx, name: str) -> str:
    """The hub id of a model folder named `name`: as the job file's own comments spell it (the recipes say
    `hf download Qwen/Qwen2.5-0.5B-Instruct ...`), else a placeholder that says what to put there."""
    try:
        text = Path(ctx.job_path).read_text() if ctx.job_path else ""
    except OSError:
        text = ""
    local_parent = Path(ctx.job.model.path).parent.name
    for found in re.findall(r"(?<![\w./-])([\w.-]+)/" + re.escape(name) + r"(?![\w.-])", text):
        if found not in (local_parent, ".", ".."):
            return f"{found}/{name}"
    return f"<hub org>/{name}"


@check("job:model", needs_job=True)
def check_model(ctx: Ctx) -> Result:
    m = ctx.job.model
    if m.tiny is not None:
        return Result("job:model", OK, "model.tiny: built offline at run time")
    if is_sft_spec(m.path):
        try:
            job, steps = parse_sft_spec(m.path, "model.path")
        except HpcRlError as e:
            return Result("job:model", FAIL, str(e), "name an existing SFT job: sft:JOB.yaml[@STEPS]")
        return Result("job:model", OK, f"model.path: built at run start by the SFT job {job.name}"
                      f"{f' ({steps} steps)' if steps else ''}, once per cache")
    p = Path(m.path)
    if not p.exists():
        return Result("job:model", FAIL, f"model.path: {m.path} does not exist here",
                      f"download the model first (compute nodes are often offline): "
                      f"`hf download {_hub_id(ctx, p.name)} --local-dir {m.path}`, or fix model.path")
    missing = []
    if not (p / "config.json").is_file():
        missing.append("config.json")
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        missing.append("tokenizer files (" + " or ".join(TOKENIZER_FILES) + ")")
    if not (p / "tokenizer_config.json").is_file():
        missing.append("tokenizer_config.json")
    if missing:
        return Result("job:model", FAIL, f"model.path: {p} lacks {', '.join(missing)}",
                      "save the model and its tokenizer there (model.save_pretrained + tokenizer.save_pretrained)")
    return Result("job:model", OK, f"{p}: config and tokenizer files present")


@check("job:pad-token", needs_job=True)
def check_pad_token(ctx: Ctx) -> Result:
    p = _model_dir(ctx)
    if p is None:
        return Result("job:pad-token", OK, "model.tiny: its tokenizer has <pad>" if ctx.job.model.tiny else
                      "skipped: no model folder (see job:model)")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(p), trust_remote_code=ctx.job.model.trust_remote_code)
    except Exception as e:  # any loader error is the user's folder
        return Result("job:pad-token", FAIL, f"the tokenizer in {p} does not load ({first_line(e)})",
                      "save a working tokenizer there (tokenizer.save_pretrained)")
    if tok.pad_token is not None:
        pid = tok.convert_tokens_to_ids(tok.pad_token)
        try:
            vocab = json.loads((p / "config.json").read_text()).get("vocab_size")
        except (OSError, ValueError):
            vocab = None
        if pid is None or (pid == tok.unk_token_id and tok.pad_token != tok.unk_token) or \
                (isinstance(vocab, int) and pid >= vocab):
            # e.g. Qwen2Tokenizer adds its class default '<|endoftext|>' to a vocab that lacks it
            return Result("job:pad-token", FAIL, f"pad token {tok.pad_token!r} (id {pid}) is not in the model's "
                          f"vocabulary (vocab_size {vocab}); {type(tok).__name__} added it as a default",
                          "set pad_token in tokenizer_config.json to a token of the vocabulary (e.g. the eos token)")
        return Result("job:pad-token", OK, f"pad token {tok.pad_token!r} (id {pid})")
    if tok.eos_token is not None:
        return Result("job:pad-token", WARN, f"the tokenizer has no pad token; eos {tok.eos_token!r} will be used",
                      "set pad_token in tokenizer_config.json to silence this (eos as pad is usually fine)")
    return Result("job:pad-token", FAIL, f"the tokenizer in {p} has neither a pad nor an eos token",
                  "set pad_token (and eos_token) in tokenizer_config.json")


@check("job:architectures", needs_job=True)
def check_architectures(ctx: Ctx) -> Result:
    """transformers must know the model's `architectures` (else it is too old for that model)."""
    p = _model_dir(ctx)
    if p is None or not (p / "config.json").is_file():
        return Result("job:architectures", OK, "model.tiny: Qwen2/Llama" if ctx.job.model.tiny else
                      "skipped: no config.json (see job:model)")
    cfg = json.loads((p / "config.json").read_text())
    archs = cfg.get("architectures") or []
    import transformers
    from packaging.version import Version

    have = transformers.__version__
    unknown = [a for a in archs if not hasattr(transformers, a)]
    need = cfg.get("transformers_version")
    if unknown and not ctx.job.model.trust_remote_code:
        return Result("job:architectures", FAIL, f"transformers {have} does not know {', '.join(unknown)} "
                      f"(config.json architectures{'; saved with transformers ' + need if need else ''})",
                      "upgrade transformers to a release that has it (and keep vLLM's range), "
                      "or set model.trust_remote_code: true for custom code")
    if need:
        try:
            newer = Version(need) > Version(have)
        except Exception:
            newer = False
        if newer:
            return Result("job:architectures", WARN, f"config.json was saved by transformers {need}, newer than {have}",
                          f"pip install 'transformers>={need}' if loading misbehaves")
    return Result("job:architectures", OK, f"transformers {have} knows {', '.join(archs) or '(none listed)'}")


@check("job:vision", needs_job=True)
def check_vision(ctx: Ctx) -> Result:
    """What a vision-language policy needs: pillow, its processor files, a tokenizer with the image tokens, an
    engine that takes images and the features it runs with."""
    from ..models.tiny import VISION_ARCHS
    from ..models.vision import VisionSpec, check_vision_job, is_vision_model

    name, job = "job:vision", ctx.job
    tiny_vl = job.model.tiny is not None and job.model.tiny.arch in VISION_ARCHS
    p = _model_dir(ctx)
    if not tiny_vl and not is_vision_model(p):
        return Result(name, OK, "skipped: a text policy")
    try:
        import PIL  # noqa: F401
    except ImportError:
        return Result(name, FAIL, "pillow is not installed: prompt images cannot be decoded", "pip install pillow")
    try:
        if not tiny_vl:
            from ..models import load_tokenizer

            VisionSpec.for_job(job, load_tokenizer(p, job.model.trust_remote_code))
        check_vision_job(job)
    except HpcRlError as e:
        return Result(name, FAIL, str(e), "fix the key it names (README: Vision-language policies)")
    what = f"model.tiny ({job.model.tiny.arch}): built offline with its image processor" if tiny_vl else \
        f"{p}: image processor and image tokens present"
    return Result(name, OK, f"{what}; images go to the HF engine (vLLM's multimodal inputs are not wired yet)")


@check("job:placement", needs_job=True)
def check_placement(ctx: Ctx) -> Result:
    """Trainer and rollout GPUs must not overlap, must exist, and must fit a shared node."""
    j = ctx.job
    t, r = j.trainer, j.rollout
    if t.device == "cpu":
        return Result("job:placement", OK, "trainer.device=cpu: no GPU placement")
    td, rd = [str(d) for d in t.local_devices], [str(d) for d in r.local_devices]
    overlap = sorted(set(td) & set(rd))
    if overlap:
        return Result("job:placement", FAIL, f"GPUs {overlap} are in both trainer.local_devices and rollout.local_devices",
                      "give the rollout servers GPUs the trainer does not use")
    gpus = ((ctx.nvidia_smi or {}).get("gpus") or [])
    if gpus and (td or rd):
        known = {g["index"] for g in gpus} | {g["uuid"] for g in gpus}
        missing = [d for d in td + rd if d not in known]
        if missing:
            return Result("job:placement", FAIL, f"local_devices name GPUs {missing} that this node does not have "
                          f"({len(gpus)} GPU(s))", "use indices from nvidia-smi -L")
    g = j.slurm.gpus_per_node
    if g and r.nodes == 0 and not j.algorithm.supervised:  # SFT starts no rollout server
        need = t.procs_per_node + r.tensor_parallel * r.servers_per_node
        if need > g:
            return Result("job:placement", FAIL, f"rollout.nodes=0 puts rollout servers on the trainer node: "
                          f"{t.procs_per_node} trainer + {r.tensor_parallel * r.servers_per_node} rollout GPUs "
                          f"> slurm.gpus_per_node={g}", "set rollout.nodes >= 1 or lower trainer.procs_per_node")
    return Result("job:placement", OK, f"trainer GPUs {td or 'auto'}, rollout GPUs {rd or 'auto'}: no overlap")


def sample_rows(job, n: int = 2) -> tuple[list[dict], str]:
    """Up to `n` rows of the job's prompt data (real rows when they load here), else synthetic rows, and why."""
    from ..data.datasets import load_rows
    from ..errors import HpcRlError

    try:
        rows = load_rows(job.data, job.seed)[:n]
        if rows:
            return rows, ""
        why = "the dataset is empty"
    except HpcRlError as e:
        why = str(e)
    return [{"prompt": "3 3 3", "ground_truth": "3", "answer": "3"},
            {"prompt": "7 7", "ground_truth": "7", "answer": "7"}][:n], why


@check("job:eval-data", needs_job=True)
def check_eval_data(ctx: Ctx) -> Result:
    """eval.source loads here (as the run would load it at its start), so a missing file is found before the job
    waits in the queue."""
    from ..data.datasets import load_rows
    from ..errors import HpcRlError

    job = ctx.job
    if not job.eval.enabled:
        return Result("job:eval-data", OK, "no evaluation (eval.source is null)")
    try:
        n = len(load_rows(job.eval_data, job.seed, "eval"))
    except HpcRlError as e:
        return Result("job:eval-data", FAIL, str(e), "fix eval.source (prepare the data first: hpc-rl data ...), or "
                      "set eval.source: null to train without held-out evaluations")
    if n == 0:
        return Result("job:eval-data", FAIL, f"eval.source {job.eval.source}: no prompts", "point eval.source at "
                      "held-out prompts")
    return Result("job:eval-data", OK, f"eval.source {job.eval.source}: {n} held-out prompts")


@check("job:reward", needs_job=True)
def check_reward(ctx: Ctx) -> list[Result]:
    """The reward `pkg.mod:fn` imports and returns one finite float per sample on sample rows (the trainer's own
    validation, hpc_rl.rewards.base.compute_rewards, run on the job's data)."""
    from ..errors import RewardError
    from ..rewards.base import compute_rewards, load_reward_fn

    rc = ctx.job.reward
    out = []
    rows, why = sample_rows(ctx.job)
    if why:
        out.append(Result("job:data", FAIL if not why.startswith("the dataset") else WARN,
                          why if why.startswith("data.") else f"data.source {ctx.job.data.source}: {why}",
                          "fix data.source (prepare the data first: hpc-rl data ...); the reward was checked on "
                          "synthetic rows"))
    if rc.monitor:
        try:
            load_reward_fn(rc.monitor, "reward.monitor")
        except RewardError as e:
            out.append(Result("job:reward-monitor", FAIL, str(e), "make the module importable and check the spelling"))
    if ctx.job.algorithm.supervised:
        return out + [Result("job:reward", OK, "SFT: no reward (the completions are the targets)")]
    if not rc.function:
        alone = "the judge (reward.judge)" if rc.judge is not None and rc.model is None else "the reward model"
        return out + [Result("job:reward", OK, f"no reward function: {alone} scores"
                             f"{' (see job:reward-model)' if rc.model is not None else ''}")]
    try:
        fn = load_reward_fn(rc.function)
    except RewardError as e:
        return out + [Result("job:reward", FAIL, str(e), "make the module importable and check the spelling")]
    prompts = [str(r.get("prompt", "")) for r in rows]
    completions = [" " + (p.split()[0] if p.split() else "x") for p in prompts]
    kind = "synthetic" if why else "data"
    try:
        values = compute_rewards(fn, rc, prompts, completions, rows)
    except RewardError as e:
        # a synthetic row may lack a field the function needs: that is not proof of a bug
        status = WARN if why and "missing" in str(e) else FAIL
        return out + [Result("job:reward", status, f"on {len(rows)} {kind} rows: {e}",
                             "return one finite float per sample: fn(prompt, completion, **row_fields) -> float "
                             "(batched: a 1-D sequence of B floats)")]
    return out + [Result("job:reward", OK, f"{rc.function} -> {[round(float(v), 4) for v in values]} on "
                          f"{len(rows)} {kind} rows")]


@check("job:agent", needs_job=True)
def check_agent(ctx: Ctx) -> Result:
    """rollout.agent imports, is `async def`, and the openai package its client needs is installed (or the verifiers
    environment of rollout.env loads, with what a Slurm node can run)."""
    from ..data.verifiers_tasks import is_verifiers
    from ..errors import ConfigError, RewardError
    from ..orchestrator.agents import check_openai_installed, load_agent
    from ..orchestrator.verifiers_env import VerifiersEnv

    spec, r = ctx.job.rollout.agent, ctx.job.rollout
    if is_verifiers(r.env):
        try:
            check_openai_installed("rollout.env")
            VerifiersEnv(r.env, r.env_kwargs, ctx.job.data.kwargs)
        except (ConfigError, RewardError) as e:
            return Result("job:agent", FAIL, str(e), "install the environment (pip install it, or put its module on "
                          "PYTHONPATH) and the envs extra (./install.sh --envs)")
        return Result("job:agent", OK, f"{r.env} loads; its harnesses run as plain processes")
    if not spec:
        return Result("job:agent", OK, "no rollout.agent")
    try:
        check_openai_installed()
        load_agent(spec)
    except (ConfigError, RewardError) as e:
        return Result("job:agent", FAIL, str(e), "make the module importable (pip install -e your package, or "
                      "PYTHONPATH), define the function with `async def`, and install the envs extra")
    return Result("job:agent", OK, f"{spec} is an async function; the openai package is installed")


def _weights_bytes(folder: Path, load_dtype: str | None) -> tuple[int, float]:
    """(parameters, bytes once loaded in `load_dtype`) of an HF folder, from its weight files and saved dtype."""
    cfg = json.loads((folder / "config.json").read_text())
    size = {"float32": 4, "bfloat16": 2, "float16": 2}
    saved = size.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"), 4)
    files = [f for f in folder.iterdir() if f.suffix in (".safetensors", ".bin", ".pt")]
    params = sum(f.stat().st_size for f in files) // saved
    return params, params * size.get(load_dtype or "float32", 4)


def _gib(b: float) -> str:
    return f"{b / 2**30:.1f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


@check("job:reward-model", needs_job=True)
def check_reward_model(ctx: Ctx) -> Result:
    """The reward model folder: a sequence-classification head of the right size, a usable pad token, and an
    estimate of its memory where it is placed (trainer ranks: ZeRO-3 shares with actor, critic and reference)."""
    from ..errors import HpcRlError
    from ..rewards.model import check_reward_model as check_folder

    j = ctx.job
    rm = j.reward.model
    name = "job:reward-model"
    if rm is None:
        return Result(name, OK, "no reward model")
    if rm.tiny is not None:
        return Result(name, OK, f"reward.model.tiny: the tiny reward model of {rm.tiny} is trained at run time")
    if not Path(rm.path).is_dir():
        return Result(name, FAIL, f"reward.model.path: {rm.path} does not exist here",
                      "download the reward model first (compute nodes are often offline) or fix reward.model.path")
    try:
        label, _ = check_folder(rm)
    except HpcRlError as e:
        return Result(name, FAIL, str(e), "fix reward.model as the message says")
    dtype = rm.dtype or j.model.dtype
    _, rm_bytes = _weights_bytes(Path(rm.path), dtype)
    where = f"head label {label}, {_gib(rm_bytes)} of weights in {dtype}"
    gpus = [g.get("memory_mib") for g in ((ctx.nvidia_smi or {}).get("gpus") or [])]
    if j.trainer.device == "cpu":
        return Result(name, OK, f"{rm.path}: {where}, on CPU ({rm.placement})")
    if not gpus or not all(gpus):
        return Result(name, OK, f"{rm.path}: {where}; GPU memory unknown here (no nvidia-smi): run "
                      "`hpc-rl doctor --job` on a compute node to check that it fits")
    gpu = min(gpus) * 2**20
    if rm.placement == "server":
        need = rm_bytes * 1.2  # activations of reward.model.batch_size sequences on top
        what = "a GPU of each reward node" if j.reward.nodes else "its own GPU on each rollout server"
        fix = "use a smaller or bfloat16 reward model (reward.model.dtype)"
    else:
        policy = _model_dir(ctx)
        world = j.fewest_ranks
        # ZeRO-3 per rank: actor and critic train (weights, gradients, fp32 Adam states: ~16 bytes a parameter in
        # mixed precision), the reference (weights only) and the reward model, each split over the ranks.
        p_params = _weights_bytes(policy, j.model.dtype)[0] if policy is not None else 0
        trained = 16 * p_params * (2 if j.algorithm.uses_critic else 1)
        ref = p_params * (2 if j.model.dtype != "float32" else 4) if j.algorithm.kl.coef > 0 or j.algorithm.kl.adaptive else 0
        need = (trained + ref + rm_bytes) / world * 1.2
        what = f"each of the {world} trainer GPUs (actor, critic, reference and reward model, ZeRO-3 shards)"
        fix = "use reward.model.placement: server (a GPU of its own on each rollout node) or more trainer GPUs"
    if need > 0.9 * gpu:
        return Result(name, FAIL, f"{rm.path}: {where}; about {_gib(need)} needed on {what}, but a GPU has "
                      f"{_gib(gpu)}", fix)
    return Result(name, OK, f"{rm.path}: {where}; about {_gib(need)} of {_gib(gpu)} on {what}")


def _lora_params(model, lora, key: str, keep: tuple[str, ...] = (), skip: tuple[str, ...] = ()) -> int:
    """Adapter parameters of `lora` on `model`: rank x (in + out) per adapted linear module (none under `skip`) (+ the
    kept heads)."""
    from ..models.lora import in_modules, resolve_targets

    mods = dict(model.named_modules())
    n = sum(lora.rank * (mods[t].in_features + mods[t].out_features)
            for t in resolve_targets(model, lora.target_modules, key, exclude=keep, skip_prefixes=skip))
    return n + sum(p.numel() for name, p in model.named_parameters() if in_modules(name, keep))


@check("job:trainer-memory", needs_job=True)
def check_trainer_memory(ctx: Ctx) -> Result:
    """Trainable parameters and the model-state memory of one trainer rank (ZeRO-3), with and without LoRA."""
    from ..errors import HpcRlError

    j = ctx.job
    name = "job:trainer-memory"
    if j.model.tiny is None and _model_dir(ctx) is None:
        return Result(name, OK, "skipped: no model folder (see job:model)")
    from ..models.lora import CRITIC_HEAD, meta_model, policy_skip

    try:
        actor = meta_model(j)
        critic = meta_model(j, critic=True) if j.algorithm.uses_critic else None
        p = sum(x.numel() for x in actor.parameters())
        c = sum(x.numel() for x in critic.parameters()) if critic is not None else 0
        lora_p = _lora_params(actor, j.model.lora, "model.lora", skip=policy_skip(j)) if j.model.lora else None
        lora_c = _lora_params(critic, j.model.critic_lora, "model.critic_lora", CRITIC_HEAD) \
            if critic is not None and j.model.critic_lora else None
    except (HpcRlError, OSError, ValueError) as e:
        return Result(name, FAIL, first_line(e), "fix model / model.lora as the message says")
    w = 2 if j.model.dtype != "float32" else 4
    world = j.fewest_ranks
    kl = j.algorithm.kl.coef > 0 or j.algorithm.kl.adaptive
    # ZeRO-3, per rank: a trained parameter costs ~16 bytes (weights, gradients, fp32 Adam moments and master
    # copy), a frozen one its weight; all split over the ranks. Activations come on top.
    full = (16 * (p + c) + (w * p if kl else 0)) / world
    parts = [f"actor {p:,}" + (f" + critic {c:,}" if c else "") + " parameters",
             f"all trained: ~{_gib(full)} of model state per trainer rank (ZeRO-3 over {world})"]
    if lora_p is not None or lora_c is not None:
        ta, tc = (lora_p if lora_p is not None else p), (lora_c if lora_c is not None else c)
        frozen = (p - ta if lora_p is not None else 0) + (c - tc if lora_c is not None else 0)
        # LoRA: no reference copy (the actor with adapters off)
        mine = (16 * (ta + tc) + w * frozen + (w * p if kl and lora_p is None else 0)) / world
        parts.append(f"LoRA: {ta + tc:,} trainable ({100 * (ta + tc) / (p + c):.2f}%), ~{_gib(mine)} per rank "
                     f"({100 * mine / full:.0f}% of all trained)")
    else:
        mine = full
    gpus = [g.get("memory_mib") for g in ((ctx.nvidia_smi or {}).get("gpus") or [])]
    msg = "; ".join(parts)
    if j.trainer.device != "cpu" and gpus and all(gpus) and mine > 0.9 * min(gpus) * 2**20:
        return Result(name, FAIL, f"{msg}; a GPU has {_gib(min(gpus) * 2**20)}",
                      "use model.lora, more trainer ranks, or a smaller model")
    return Result(name, OK, msg)


def _is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@check("job:rollout-bind", needs_job=True)
def check_rollout_bind(ctx: Ctx) -> Result:
    j = ctx.job
    nodes = node_range(j.trainer.nodes)[1] + j.rollout.nodes
    host = j.rollout.host
    if _is_loopback(host) and nodes > 1:
        return Result("job:rollout-bind", FAIL, f"rollout.host={host} is loopback but the job spans {nodes} nodes: "
                      "trainers on other nodes cannot reach the rollout servers", "set rollout.host: 0.0.0.0")
    return Result("job:rollout-bind", OK, f"rollout.host={host} ({nodes} node(s))")
