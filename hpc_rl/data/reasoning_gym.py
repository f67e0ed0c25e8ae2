"""reasoning-gym tasks as prompts: `data.source: reasoning_gym:TASK` (or `TASK,TASK,...`, a mix of equal weight) with
`data.kwargs`: `size` (rows, default 1000), `seed` (default: the job's seed; eval's default differs, so that its items
are other items), `system_prompt` (a name of reasoning-gym's SYSTEM_PROMPTS, default "default", any other text, or
null: the question alone as plain text), and the task's own config (for a mix: `{TASK: {config}}` and
`weights: {TASK: w}`). Rows keep the item (`reasoning_gym`: question, answer, metadata) for
`hpc_rl.rewards.reasoning_gym:score`, which scores with the task's own `score_answer`.

reasoning-gym generates its items procedurally and offline: nothing is downloaded on a compute node.
"""

from __future__ import annotations

import difflib

from ..errors import DataError, first_line
from .extras import import_extra

DEFAULT_SIZE = 1000
# Added to the job's seed for held-out items (eval.source) when eval.kwargs does not set its own seed.
EVAL_SEED_OFFSET = 1_000_003


def _import(section: str):
    return import_extra("reasoning_gym", f"{section}.source", "reasoning_gym: tasks need the reasoning-gym package",
                        DataError)


def task_names(spec: str, section: str = "data") -> list[str]:
    """The tasks of `reasoning_gym:A,B`; DataError naming an unknown one and the closest known names."""
    from reasoning_gym.factory import DATASETS

    names = [t.strip() for t in spec.split(",") if t.strip()]
    if not names:
        raise DataError(f"{section}.source: reasoning_gym: names no task; e.g. reasoning_gym:leg_counting")
    for n in names:
        if n not in DATASETS:
            near = difflib.get_close_matches(n, sorted(DATASETS), n=3) or sorted(DATASETS)[:3]
            raise DataError(f"{section}.source: unknown reasoning-gym task {n!r}; did you mean {', '.join(near)}? "
                            f"({len(DATASETS)} tasks: python -c \"import reasoning_gym.factory as f; "
                            "print(sorted(f.DATASETS))\")")
    return names


def reasoning_gym_rows(spec: str, kwargs: dict, seed: int, section: str = "data") -> list[dict]:
    """The rows of `reasoning_gym:SPEC`: prompt (a chat with the system prompt, or the question), ground_truth (the
    answer as text) and the item itself."""
    rg = _import(section)
    names = task_names(spec, section)
    kw = dict(kwargs or {})
    size = kw.pop("size", DEFAULT_SIZE)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise DataError(f"{section}.kwargs.size: expected a positive integer (rows to generate), got {size!r}")
    item_seed = kw.pop("seed", seed + (EVAL_SEED_OFFSET if section == "eval" else 0))
    system = kw.pop("system_prompt", "default")
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if system is not None and not isinstance(system, str):
        raise DataError(f"{section}.kwargs.system_prompt: expected a name ({', '.join(SYSTEM_PROMPTS)}), a text or "
                        "null")
    system_text = None if system is None else SYSTEM_PROMPTS.get(system, system)
    if len(names) > 1:
        weights = kw.pop("weights", {}) or {}
        unknown = sorted(set(kw) - set(names)) + sorted(set(weights) - set(names))
        if unknown:
            raise DataError(f"{section}.kwargs.{unknown[0]}: not a task of the mix {spec!r}; a mix takes "
                            "{TASK: {config}}, weights: {TASK: w}, size, seed and system_prompt")
    try:
        if len(names) == 1:
            ds = rg.create_dataset(names[0], size=size, seed=item_seed, **kw)
        else:
            from reasoning_gym.composite import DatasetSpec

            specs = [DatasetSpec(n, float(weights.get(n, 1.0)), dict(kw.get(n) or {})) for n in names]
            ds = rg.create_dataset("composite", size=size, seed=item_seed, datasets=specs)
        items = list(ds)
    except Exception as e:  # the task's config class refuses a field or a value (TypeError, ValueError, assert)
        raise DataError(f"{section}.kwargs: reasoning-gym {spec!r} refused its config: {type(e).__name__}: "
                        f"{first_line(e)}") from None
    rows = []
    for item in items:
        q = item["question"]
        prompt = [{"role": "system", "content": system_text}, {"role": "user", "content": q}] if system_text else q
        rows.append({"prompt": prompt, "ground_truth": str(item["answer"]),
                     "reasoning_gym": {"question": q, "answer": item["answer"], "metadata": item["metadata"]}})
    return rows
