"""LookupEnv: the toy tool task (hpc_rl.data.toy lookup). The prompt `find K` names a key whose digit is hidden; an
assistant turn containing `look` calls the lookup tool, which answers the digit (once); the first turn without a
call is the answer. Only an answer given after the lookup counts (the digit is not reachable otherwise: a guess
scores 0); it is rewarded with the fraction of its first 4 non-space characters equal to the digit."""

from __future__ import annotations

from ...rewards.toy import repeat_digit
from .base import Environment, first_messages
from .tools import python_tool

CALL = "look"


class LookupEnv(Environment):
    """env_kwargs: sandboxed (default false): the lookup runs `print(D)` in the python tool's sandbox, a real
    tool's latency (bench/multi_turn.py)."""

    def __init__(self, sandboxed: bool = False):
        self.sandboxed = sandboxed

    def reset(self, row: dict) -> list[dict]:
        self.digit = str(row["ground_truth"])
        self.looked = False
        return first_messages(row)

    def step(self, message: dict):
        text = message["content"]
        if CALL in text and not self.looked:
            self.looked = True
            answer = python_tool({"code": f"print({self.digit})"}, self.context) if self.sandboxed else self.digit
            return [{"role": "tool", "content": answer}], None, False
        return None, repeat_digit("", text, self.digit) if self.looked else 0.0, True
