"""Built-in toy tasks: prompts a random-init tiny model can learn by RL on a CPU in minutes.

lookup: multi-turn; the prompt `find K` names a key, its digit comes only from the lookup tool (LookupEnv).

copy_pair: the prompt is `copy A B :` and the completion should be `A B`; the reward (hpc_rl.rewards.toy:copy_pair)
is the fraction of the two digits right. 20 of the 100 digit pairs are held out: the train split never shows them,
the test split has only them, so a policy that scores on the test split copies digits it was never shown in that
pair. Chance is about 1/33 per digit, ~0.001 for both.

repeat_digit: the prompt is `copy D :` and the completion should repeat the digit D. The reward
(hpc_rl.rewards.toy:repeat_digit) is the fraction of the first 4 non-space characters of the
completion that equal D. A random policy over the ~33-token vocabulary scores about 0.03, so a
mean reward of 0.8 means the policy really reads the digit from the prompt.

colour_digit (a vision-language policy, model.tiny.arch: qwen2_vl): every prompt is the same `<image> colour :`; the
image is a 56x56 picture filled with one of ten colours, and the completion should repeat that colour's digit (its
index in COLOURS) as repeat_digit's does (its reward, hpc_rl.rewards.toy:repeat_digit). The answer is only in the
image, so a mean reward of 0.8 means the policy reads it through its vision tower.
"""

from __future__ import annotations

import random

from ..errors import DataError


def repeat_digit_rows(n: int, seed: int) -> list[dict]:
    """`n` rows {prompt, ground_truth, id}; digits drawn uniformly with a fixed seed."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        d = str(rng.randrange(10))
        rows.append({"id": i, "prompt": f"copy {d} :", "ground_truth": d})
    return rows


def repeat_digit_corpus() -> list[str]:
    """Lines that cover every symbol the task uses (the tiny tokenizer is trained on them)."""
    return [f"copy {d} : " + " ".join([d] * 4) for d in "0123456789"] + ["0123456789 :"]


# colour_digit's palette: digit d is drawn in COLOURS[d] (far apart in RGB, so that one patch tells them apart).
COLOURS = [(230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48),
           (145, 30, 180), (70, 240, 240), (240, 50, 230), (0, 0, 0), (255, 255, 255)]


def colour_image(d: int, size: int = 56, jitter: int = 0, seed: int = 0) -> bytes:
    """PNG bytes of a size x size picture filled with COLOURS[d] (each channel moved by up to `jitter`)."""
    import io

    from PIL import Image

    rng = random.Random(seed)
    colour = tuple(min(255, max(0, c + rng.randint(-jitter, jitter))) for c in COLOURS[d])
    buf = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buf, format="PNG")
    return buf.getvalue()


def colour_digit_rows(n: int, seed: int, split: str = "train") -> list[dict]:
    """`n` rows {prompt: `<image> colour :`, images: [PNG bytes], ground_truth: the colour's digit, id}; each picture's
    colour is moved a little at random, and the test split's pictures are drawn from other seeds than train's (the
    same ten colours: held-out pictures, not held-out answers)."""
    rng = random.Random(seed + (1 if split == "test" else 0))
    base = (seed * 7919) + (10**6 if split == "test" else 0)
    rows = []
    for i in range(n):
        d = rng.randrange(10)
        rows.append({"id": i, "prompt": "<image> colour :", "images": [colour_image(d, jitter=12, seed=base + i)],
                     "ground_truth": str(d)})
    return rows


def colour_digit_corpus() -> list[str]:
    return ["colour : " + " ".join([d] * 4) for d in "0123456789"] + ["0123456789 :"]


def copy_pair_held_out(a: int, b: int) -> bool:
    """The 20 held-out pairs: 2 per first digit and 2 per second digit (both splits cover every digit in both
    places), 2 of them doubles (train has doubles too)."""
    return (a + 2 * b) % 5 == 1


def copy_pair_rows(n: int, seed: int, split: str = "train") -> list[dict]:
    """`n` rows {prompt: `copy A B :`, ground_truth: `A B`, id} of the split's pairs (train: 80 pairs drawn
    uniformly with a fixed seed; test: each of the 20 held-out pairs once, whatever n)."""
    test = split == "test"
    pairs = [(a, b) for a in range(10) for b in range(10) if copy_pair_held_out(a, b) == test]
    if test:
        chosen = pairs
    else:
        rng = random.Random(seed)
        chosen = [rng.choice(pairs) for _ in range(n)]
    return [{"id": i, "prompt": f"copy {a} {b} :", "ground_truth": f"{a} {b}"} for i, (a, b) in enumerate(chosen)]


def copy_pair_corpus() -> list[str]:
    # No line of digits side by side: the tokenizer would learn multi-digit tokens the answers do not use.
    return [f"copy {a} {b} : {a} {b}" for a in range(10) for b in range(10)]


# copy_pair_judgments: what the toy judge (jobs/toy-judge-sft-cpu.yaml) learns to say of a copy_pair answer. The
# judge's template (jobs/toy-judge-cpu.yaml) sets each reference digit beside the answer's character in that place,
# `AX,BY ?` (as a judge prompt for math sets the extracted answer beside the reference), and the judge answers how many
# of the two are right (0, 1 or 2: the copy_pair rule's score times 2). The judge's tokenizer (model.tiny.vocab_size
# 128) has one token per digit pair `AX`, so a verdict is a property of one token a 2-layer model learns in a hundred
# steps; with each character its own token (`A B = X Y ?`) the model must learn token equality, which 1,600 steps did
# not teach it, and a policy rewarded by that judge was paid for its mistakes.
_ANSWER_CHARS = [str(d) for d in range(10)] * 3 + [":", "c", "o", "p", "y"]


def copy_pair_judgment_rows(n: int, seed: int) -> list[dict]:
    """`n` synthetic judgments {prompt: `AX,BY ?`, completion: ` 0`, ` 1` or ` 2` (the right ones among X, Y)}: each of
    X and Y is right half the time, otherwise another character a copy_pair policy writes (mostly a digit), and now
    and then missing (a policy that wrote one character or none)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        want = str(rng.randrange(10)), str(rng.randrange(10))
        wrote = [w if rng.random() < 0.5 else rng.choice([c for c in _ANSWER_CHARS if c != w]) for w in want]
        if rng.random() < 0.05:
            wrote = wrote[:rng.randrange(2)]
        right = sum(w == r for w, r in zip(wrote, want))
        rows.append({"id": i, "prompt": copy_pair_judge_prompt(want, wrote), "completion": f" {right}"})
    return rows


def copy_pair_judge_prompt(want, wrote) -> str:
    """The toy judge's question: each reference digit followed by the answer's character in its place."""
    return ",".join(w + x for w, x in zip(want, list(wrote) + ["", ""])) + " ?"


def copy_pair_judgment_corpus() -> list[str]:
    # Every digit pair once per place, so that BPE makes each a token of its own.
    return [f"{a}{x},{b}{y} ? {int(a == x) + int(b == y)}" for a in range(10) for x in range(10)
            for b, y in ((x, a), (a, x))] + [f"{a}{c},{a}{c} ? 0" for a in range(10) for c in ":copy"]


def lookup_rows(n: int, seed: int, split: str = "train") -> list[dict]:
    """`n` rows {prompt: `find K`, ground_truth: the digit hidden under key K, id}: the digit is drawn
    independently of the key, so only the lookup tool (hpc_rl.rollout.environments.toy:LookupEnv) reveals it.
    The test split asks for keys the train split never names (letters the tokenizer knows from `find` and
    `look`): held-out prompts whose answer, again, only the tool gives."""
    rng = random.Random(seed)
    keys = LOOKUP_KEYS if split == "train" else LOOKUP_HELD_OUT_KEYS
    return [{"id": i, "prompt": f"find {rng.choice(keys)}", "ground_truth": str(rng.randrange(10))}
            for i in range(n)]


def lookup_corpus() -> list[str]:
    return [f"find {k} : look = {d} : " + " ".join([d] * 4) for k in LOOKUP_KEYS for d in "0123456789"]


LOOKUP_KEYS = "abcdefgh"
LOOKUP_HELD_OUT_KEYS = "iklno"
# The tiny tokenizer's chat template for the lookup task: `find K :`, an assistant turn ends with its <eos>, a
# tool's answer reads ` = D` and the next turn follows it directly.
LOOKUP_CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}<eos>"
                        "{% elif m['role'] == 'tool' %} = {{ m['content'] }}{% else %}{{ m['content'] }} :"
                        "{% endif %}{% endfor %}")

def toy_completion(name: str, row: dict) -> str:
    """The completion a toy task's reward scores 1 (SFT's target for the toy rows): ` D D D D`, ` A B`."""
    if name in ("repeat_digit", "colour_digit"):
        return " " + " ".join([row["ground_truth"]] * 4)
    if name == "copy_pair":
        return " " + row["ground_truth"]
    raise DataError(f"data.source: toy:{name} has no completions for SFT (its answer comes from a tool); use "
                    "toy:repeat_digit or toy:copy_pair")


TOY_TASKS = {
    "repeat_digit": (repeat_digit_rows, repeat_digit_corpus),
    "colour_digit": (colour_digit_rows, colour_digit_corpus),
    "lookup": (lookup_rows, lookup_corpus),
    "copy_pair": (copy_pair_rows, copy_pair_corpus),
    "copy_pair_judgments": (copy_pair_judgment_rows, copy_pair_judgment_corpus),
}
# Toy tasks with a held-out split: its name -> what `split` values they take.
TOY_SPLITS = {"copy_pair": ("train", "test"), "lookup": ("train", "test"), "colour_digit": ("train", "test")}
TOY_CHAT_TEMPLATES = {"lookup": LOOKUP_CHAT_TEMPLATE}


def toy_chat_template(source: str) -> str | None:
    """The chat template a toy task's tiny tokenizer gets (None: the task formats plain text)."""
    return TOY_CHAT_TEMPLATES.get(source[4:]) if source.startswith("toy:") else None


def toy_rows(name: str, n: int, seed: int, split: str = "train", section: str = "data") -> list[dict]:
    """The rows of a toy task's split; the tasks without held-out prompts have one split (any name gives it)."""
    if name not in TOY_TASKS:
        raise DataError(f"{section}.source: unknown toy task 'toy:{name}'; available: "
                        + ", ".join(f"toy:{k}" for k in TOY_TASKS))
    if name not in TOY_SPLITS:
        return TOY_TASKS[name][0](n, seed)
    if split not in TOY_SPLITS[name]:
        raise DataError(f"{section}.split: toy:{name} has the splits {', '.join(TOY_SPLITS[name])}, not {split!r}")
    return TOY_TASKS[name][0](n, seed, split)


def toy_corpus(name: str) -> list[str]:
    return TOY_TASKS[name][1]()
