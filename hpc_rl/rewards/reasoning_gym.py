"""The reward of reasoning-gym items (`data.source: reasoning_gym:TASK`): the task's own `score_answer` on the
completion's final answer, in [0, 1].

`answer_tag` (reward.kwargs, default "answer"): the answer is the text of the last `<answer>...</answer>` of the
completion, as reasoning-gym's system prompts ask for; a completion without one scores 0. `answer_tag: null` scores
the whole completion (stripped).
"""

from __future__ import annotations


def score(prompt, completion: str, reasoning_gym: dict | None = None, answer_tag: str | None = "answer",
          **_row) -> float:
    if reasoning_gym is None:
        raise ValueError("the row has no reasoning_gym item: this reward scores data.source reasoning_gym:TASK rows")
    from reasoning_gym import get_score_answer_fn
    from reasoning_gym.utils import extract_answer

    answer = extract_answer(completion, tag_name=answer_tag) if answer_tag else completion.strip()
    if answer is None:
        return 0.0
    return float(get_score_answer_fn(reasoning_gym["metadata"]["source_dataset"])(answer, reasoning_gym))
