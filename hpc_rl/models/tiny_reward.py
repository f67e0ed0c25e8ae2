"""A tiny reward model of a toy task, built offline: a sequence-classification Qwen2 trained in seconds on CPU
with the Bradley-Terry loss on synthetic preference pairs (the completion the task's rule scores higher is
preferred), saved as a normal HF folder and loaded like any real reward model.

The completions are token sequences of the kind the tiny policy samples (the task's tokens, the prompt's digit
more or less often, an eos or not), so the reward model sees at training what it scores during RL.
"""

from __future__ import annotations

import random
from pathlib import Path

from ..errors import ConfigError
from ..rewards.toy import repeat_digit

# Small enough to train in ~10 s on one core; wide enough to compare each response token with the prompt's digit.
HIDDEN, LAYERS, HEADS, HEAD_DIM, MLP = 64, 2, 2, 32, 128
TRAIN_STEPS, PAIRS_PER_STEP, LR = 400, 64, 2e-3
MAX_COMPLETION_TOKENS = 6


def _token_groups(tok) -> tuple[list[int], dict[str, list[int]]]:
    """(every token a policy can sample, the tokens that read as each digit)."""
    vocab = [i for i in range(len(tok)) if i not in (tok.pad_token_id, tok.unk_token_id)]
    digits: dict[str, list[int]] = {}
    for i in vocab:
        digits.setdefault(tok.decode([i]).strip(), []).append(i)
    return vocab, digits


def completion_tokens(tok, digit: str, rng: random.Random, groups=None) -> list[int]:
    """A completion like the tiny policy samples: 1-6 tokens, the digit's tokens with a drawn probability, the
    others from the whole vocabulary or (half the time) one wrong digit's tokens, as a policy that collapsed onto
    the wrong digit samples; sometimes ending with eos."""
    vocab, digits = groups or _token_groups(tok)
    wrong = digits[rng.choice([w for w in "0123456789" if w != digit])] if rng.random() < 0.5 else vocab
    p = rng.random()
    n = rng.randint(1, MAX_COMPLETION_TOKENS)
    ids = [rng.choice(digits[digit]) if rng.random() < p else rng.choice(wrong) for _ in range(n)]
    if rng.random() < 0.5 and ids[-1] != tok.eos_token_id:
        ids.append(tok.eos_token_id)
    return ids


def preference_pairs(tok, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """`n` (chosen, rejected) token sequences (prompt + completion) of repeat_digit with different rule scores."""
    rng = random.Random(seed)
    groups = _token_groups(tok)
    pairs = []
    while len(pairs) < n:
        d = str(rng.randrange(10))
        prompt = f"copy {d} :"
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        a, b = completion_tokens(tok, d, rng, groups), completion_tokens(tok, d, rng, groups)
        sa = repeat_digit(prompt, tok.decode(a, skip_special_tokens=True), d)
        sb = repeat_digit(prompt, tok.decode(b, skip_special_tokens=True), d)
        if sa == sb:
            continue
        chosen, rejected = (a, b) if sa > sb else (b, a)
        pairs.append((p_ids + chosen, p_ids + rejected))
    return pairs


def pooled_scores(model, sequences: list[list[int]], pad_id: int):
    """[B] scores at each sequence's last real token (with gradients; the trainer reads them the same way)."""
    import torch

    from ..rewards.model import last_token_index, pad_right

    ids, att = pad_right(sequences, pad_id, "cpu")
    hidden = model.model(input_ids=ids, attention_mask=att).last_hidden_state
    per_token = model.score(hidden)[..., 0]
    return per_token[torch.arange(len(sequences)), last_token_index(att)]


def ranking_accuracy(model, pairs, pad_id: int) -> float:
    """Fraction of pairs whose chosen sequence scores higher than the rejected one."""
    import torch

    with torch.no_grad():
        c = pooled_scores(model, [p[0] for p in pairs], pad_id)
        r = pooled_scores(model, [p[1] for p in pairs], pad_id)
    return float((c > r).float().mean())


def _config(tok):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=LAYERS,
                       num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=HEAD_DIM,
                       max_position_embeddings=512, num_labels=1, pad_token_id=tok.pad_token_id,
                       eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, tie_word_embeddings=False,
                       architectures=["Qwen2ForSequenceClassification"])


def _train(tok, cfg, seed: int):
    """The reward model trained with the Bradley-Terry loss on fresh preference pairs every step."""
    import torch
    from transformers import Qwen2ForSequenceClassification

    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only add overhead
    try:
        model.train()
        for step in range(TRAIN_STEPS):
            batch = preference_pairs(tok, PAIRS_PER_STEP, seed * 1_000_003 + step)  # fresh pairs: no overfitting
            s = pooled_scores(model, [p[0] for p in batch] + [p[1] for p in batch], tok.pad_token_id)
            loss = -torch.nn.functional.logsigmoid(s[:PAIRS_PER_STEP] - s[PAIRS_PER_STEP:]).mean()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for g in opt.param_groups:
                g["lr"] = LR * min(1.0, (step + 1) / 20) * (1 - step / TRAIN_STEPS)
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def build_tiny_reward_model(task: str, corpus: list[str], out_dir: str | Path, seed: int = 0) -> Path:
    """Train the tiny reward model of toy task `task` (tokenizer trained on `corpus`, as the tiny policy's) and
    save it into `out_dir` atomically; an existing folder is kept."""
    from transformers import AutoTokenizer

    from .tiny import atomic_folder, train_tokenizer

    if task != "toy:repeat_digit":
        raise ConfigError(f"reward.model.tiny: no tiny reward model for {task!r}; the toy tasks with one: "
                          "toy:repeat_digit")
    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    with atomic_folder(out) as tmp:
        # Trained on the tokenizer as it loads from the finished folder: with a qwen2 config.json next to it,
        # transformers rebuilds its pipeline and tokenizes the prompts differently from the trained object.
        raw = train_tokenizer(corpus)
        raw.save_pretrained(tmp)
        cfg = _config(raw)
        cfg.save_pretrained(tmp)
        tok = AutoTokenizer.from_pretrained(tmp)
        _train(tok, cfg, seed).save_pretrained(tmp)
    return out


def cached_tiny_reward_model(task: str, corpus: list[str], out_dir: str | Path, seed: int = 0) -> Path:
    """build_tiny_reward_model through the cache (its ~400 training steps take 15-100 s at every run's start)."""
    from .tiny import build_cached

    corpus = list(corpus)
    return build_cached("reward-model", {"task": task, "corpus": corpus, "seed": seed}, out_dir,
                        lambda out: build_tiny_reward_model(task, corpus, out, seed))
