"""SFT examples: each row of a dataset as prompt token ids, target token ids and a per-target-token loss mask.

Two row forms (as TRL's prompt-completion and conversational datasets):
- a prompt (string) and a completion (string, data.completion_key): the completion's tokens and an end-of-sequence
  token are trained;
- a chat: the prompt field is a list of messages with assistant turns (or a chat prompt plus a completion string,
  its answer): everything from the first assistant turn on is the target, and only the assistant turns' tokens (as
  the chat template renders them, end-of-turn included) carry loss.

A chat is tokenized one message at a time as growing prefixes of the whole rendering, so that each token's mask is
that of the message that added it; a template whose rendering of a prefix is not a prefix of the whole (one that
rewrites earlier turns) is refused naming the row.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import DataConfig
from ..errors import DataError
from .datasets import load_rows
from .toy import toy_completion


@dataclass
class SFTExample:
    """One training row as token ids."""

    prompt: list[int]  # the context, no loss
    target: list[int]  # what follows it: the completion, or the conversation from its first assistant turn on
    mask: list[int]  # per target token: 1 trained (completion, assistant turn), 0 context (a later user or tool turn)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _chat_text(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def encode_chat(tokenizer, messages: list[dict], where: str) -> SFTExample:
    """The conversation's tokens from its first assistant turn on, masked to the assistant turns."""
    first = next(i for i, m in enumerate(messages) if m.get("role") == "assistant")
    if first == 0:
        raise DataError(f"{where}: the conversation starts with an assistant turn; it needs a prompt before it")
    prompt = _ids(tokenizer, _chat_text(tokenizer, messages[:first], True))
    ids, mask = list(prompt), []
    for k in range(first, len(messages)):
        before_answer = k + 1 < len(messages) and messages[k + 1].get("role") == "assistant"
        upto = _ids(tokenizer, _chat_text(tokenizer, messages[:k + 1],
                                          before_answer and messages[k].get("role") != "assistant"))
        if upto[:len(ids)] != ids:
            raise DataError(f"{where}: the chat template renders the conversation up to message {k} differently from "
                            "its start (it rewrites earlier turns); SFT needs a template whose renderings grow by "
                            "appending, or rows of prompt + completion")
        added = upto[len(ids):]
        mask += [1 if messages[k].get("role") == "assistant" else 0] * len(added)
        ids = upto
    return SFTExample(prompt, ids[len(prompt):], mask)


def encode_row(row: dict, tokenizer, cfg: DataConfig, where: str) -> SFTExample:
    """One normalized row (hpc_rl.data.datasets.load_rows) as an SFTExample; DataError naming the row and field."""
    prompt, key = row["prompt"], cfg.completion_key
    completion = row.get(key)
    if completion is None and cfg.source.startswith("toy:"):
        completion = toy_completion(cfg.source[4:], row)
    if completion is not None and (not isinstance(completion, str) or not completion.strip()):
        raise DataError(f"{where}: field '{key}' is {completion!r}; SFT needs a non-empty completion string "
                        "(data.completion_key names the field)")
    if isinstance(prompt, list):
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(f"{where}: a chat row needs a tokenizer with a chat template; {cfg.source}'s model has "
                            "none: give rows of prompt + completion strings, or a model with a chat template")
        messages = list(prompt) + ([{"role": "assistant", "content": completion}] if completion is not None else [])
        if not any(m.get("role") == "assistant" for m in messages):
            raise DataError(f"{where}: no '{key}' field and no assistant turn in '{cfg.prompt_key}'; SFT needs a "
                            f"target: add a '{key}' string (or set data.completion_key) or assistant messages")
        return encode_chat(tokenizer, messages, where)
    if completion is None:
        raise DataError(f"{where}: no '{key}' field; SFT needs the completion of each prompt (set "
                        f"data.completion_key to the field that holds it; row has: {', '.join(map(str, row))})")
    target = _ids(tokenizer, completion)
    if not target or target[-1] != tokenizer.eos_token_id:
        target.append(tokenizer.eos_token_id)  # the model learns to stop
    return SFTExample(_ids(tokenizer, prompt), target, [1] * len(target))


class SFTDataset:
    """A dataset's rows as SFTExamples; over-long or empty rows are refused at load, naming the row."""

    def __init__(self, cfg: DataConfig, tokenizer, seed: int, section: str = "data"):
        self.rows = load_rows(cfg, seed, section)
        self.examples = []
        for i, row in enumerate(self.rows):
            where = f"{section}.source {cfg.source}: row {i}"
            ex = encode_row(row, tokenizer, cfg, where)
            if not ex.prompt:
                raise DataError(f"{where}: the prompt tokenizes to nothing; remove the row or fill in its prompt")
            if len(ex.prompt) > cfg.max_prompt_tokens:
                raise DataError(f"{where}: {len(ex.prompt)} prompt tokens, more than data.max_prompt_tokens="
                                f"{cfg.max_prompt_tokens}; raise it or filter long prompts")
            if len(ex.target) > cfg.max_completion_tokens:
                raise DataError(f"{where}: {len(ex.target)} completion tokens, more than data.max_completion_tokens="
                                f"{cfg.max_completion_tokens}; raise it or filter long rows")
            if not any(ex.mask):
                raise DataError(f"{where}: no token carries loss (the assistant turns render to nothing)")
            self.examples.append(ex)

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def trained_tokens(self) -> int:
        return sum(sum(e.mask) for e in self.examples)
