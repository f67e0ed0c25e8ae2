"""Geometry3K (hiyouga/geometry3k: a diagram and a question per row) as verl's multimodal parquet, as verl's
examples/data_preprocess/geo3k.py writes it: prompt (the problem, with its `<image>`, and verl's instruction to
think in <think> tags and box the answer), images (encoded bytes), reward_model.ground_truth, extra_info."""

from __future__ import annotations

from ..errors import DataError
from .images import IMAGE_PLACEHOLDER, decode, encoded_bytes

HUB_NAME = "hiyouga/geometry3k"
SPLITS = ("train", "validation", "test")
REWARD = "hpc_rl.rewards.geometry3k:compute_score"
INSTRUCTION = (r"You FIRST think about the reasoning process as an internal monologue and then provide the final "
               r"answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE "
               r"put in \boxed{}.")


def to_verl_row(raw: dict, split: str, index: int, where: str) -> dict:
    """One Geometry3K row ({problem, answer, images}) in verl's format; DataError naming the row when malformed."""
    problem, answer, images = raw.get("problem"), raw.get("answer"), raw.get("images")
    if not isinstance(problem, str) or not problem.strip() or not isinstance(answer, (str, int, float)):
        raise DataError(f"{where}: row {index} needs a string 'problem' and an 'answer' (Geometry3K format); it has "
                        f"{', '.join(map(str, raw)) or 'none'}")
    if not isinstance(images, list) or not images:
        raise DataError(f"{where}: row {index} has no 'images' (a list of the problem's diagrams)")
    encoded = []
    for j, item in enumerate(images):
        at = f"{where}: row {index} field 'images'[{j}]"
        data = encoded_bytes(item, at, None)
        decode(data, at)
        encoded.append({"bytes": data, "path": None})
    if IMAGE_PLACEHOLDER not in problem:  # a diagram the text does not place: before the question, as verl's rows
        problem = IMAGE_PLACEHOLDER * len(encoded) + problem
    if problem.count(IMAGE_PLACEHOLDER) != len(encoded):
        raise DataError(f"{where}: row {index} has {len(encoded)} image(s) but {problem.count(IMAGE_PLACEHOLDER)} "
                        f"{IMAGE_PLACEHOLDER} in 'problem'")
    return {
        "data_source": HUB_NAME,
        "prompt": [{"role": "user", "content": f"{problem} {INSTRUCTION}"}],
        "images": encoded,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"split": split, "index": index, "answer": str(answer), "question": raw["problem"]},
    }
