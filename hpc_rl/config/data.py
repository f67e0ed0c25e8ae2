"""The data section: where the prompts come from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DataConfig:
    """Prompt dataset: `toy:NAME`, a .jsonl/.parquet file, or `hf:NAME` (an HF datasets name or folder)."""

    # Where the prompts come from: toy:NAME, a .jsonl/.parquet file, or hf:NAME.
    source: str = "toy:repeat_digit"
    # The split of an hf: dataset.
    split: str = "train"
    # The row field holding the prompt (a string, or a chat as a list of {role, content}).
    prompt_key: str = "prompt"
    # Longest prompt in tokens; a longer one is an error at load naming its row.
    max_prompt_tokens: int = 128
    # Number of rows a toy: dataset generates.
    toy_size: int = 2000
    # Sample prompts in a seeded random order (false: in file order); either way a resume sees the same data.
    shuffle: bool = True
