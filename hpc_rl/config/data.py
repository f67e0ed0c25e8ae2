"""The data section: where the prompts come from."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DataConfig:
    """Prompt dataset: `toy:NAME`, a .jsonl/.parquet file, `hf:NAME` (an HF datasets name or folder), or
    `reasoning_gym:TASK[,TASK...]` (procedural tasks with their own scoring)."""

    # Where the prompts come from: toy:NAME, a .jsonl/.parquet file (relative: to the job file), hf:NAME, or
    # reasoning_gym:TASK[,TASK...].
    source: str = "toy:repeat_digit"
    # The split of an hf: dataset.
    split: str = "train"
    # The row field holding the prompt (a string, or a chat as a list of {role, content}).
    prompt_key: str = "prompt"
    # Longest prompt in tokens; a longer one is an error at load naming its row.
    max_prompt_tokens: int = 128
    # Number of rows a toy: dataset generates.
    toy_size: int = 2000
    # Settings of a reasoning_gym: source: size (rows), seed, system_prompt, and the task's config (a mix: {TASK: {...}},
    # weights: {TASK: w}).
    kwargs: dict = field(default_factory=dict)
    # Sample prompts in a seeded random order (false: in file order); either way a resume sees the same data.
    shuffle: bool = True
    # SFT (algorithm.name: sft): the row field holding the target completion of the prompt (a string); a row without
    # it whose prompt is a chat with assistant turns trains on those turns (the chat template's tokens of each).
    completion_key: str = "completion"
    # The row field holding a prompt's images (verl's `images`): a list of encoded bytes, file paths (relative: to
    # the data file) or {bytes, path}; `<image>` in the prompt marks where each goes. Needs a vision-language model.
    image_key: str = "images"
    # An image with more pixels than this is an error at load naming its row (before it is decoded).
    max_image_pixels: int = 16_777_216
    # SFT: the longest completion in tokens (everything after the prompt); a longer row is an error at load naming it.
    max_completion_tokens: int = 256
