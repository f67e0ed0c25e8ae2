"""Token ids of multi-turn conversations from the model's chat template, without re-tokenizing sampled turns.

The prompt is the template of the first messages with the generation prompt. Each observation is rendered as
the text the template adds after an assistant turn: render(base + obs, generation prompt) minus render(base), for a
fixed base conversation, tokenized on its own. The text the template closes an assistant turn with (e.g.
`<|im_end|>\n`) and the engine did not sample (the newline after the stop token, or all of it for a turn cut at
max_new_tokens) starts the observation, so the model reads what the template shows it.
"""

from __future__ import annotations

from ...errors import ConfigError

# For tokenizers without a chat template (base models): role-prefixed lines.
FALLBACK_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}assistant:{% endif %}")
_MARK = "\u2063hpc-rl-turn\u2063"  # an assistant content no template changes


class ChatFormat:
    """Renders the prompt and the observation turns of one tokenizer (and tools) as token ids."""

    def __init__(self, tokenizer, tools: list[dict] | None = None):
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.template = None if getattr(tokenizer, "chat_template", None) else FALLBACK_TEMPLATE
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]
        self._base = base
        before = self.render(base, generation_prompt=False)
        if _MARK not in before:
            raise ConfigError("rollout.env: the model's chat template drops assistant messages; it cannot format "
                              "multi-turn conversations")
        self._before = before
        close = before[before.rindex(_MARK) + len(_MARK):]  # e.g. "<|im_end|>\n"
        self._close = close
        self._stop_texts = {}

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        kw = {"chat_template": self.template} if self.template else {}
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt, **kw)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The first messages with the generation prompt, as token ids."""
        return self.encode(self.render(messages, generation_prompt=True))

    def observation_ids(self, observations: list[dict], last_token: int | None, stopped: bool) -> list[int]:
        """Token ids that follow a sampled assistant turn: the rest of its closing text, the observations, the
        next generation prompt. `last_token`/`stopped`: the turn's last sampled token and whether it was a stop."""
        after = self.render(self._base + list(observations), generation_prompt=True)
        if not after.startswith(self._before):
            raise ConfigError("rollout.env: the model's chat template renders earlier turns differently once "
                              "observations follow; multi-turn token ids would not match what the model saw")
        return self.encode(self._rest_of_close(last_token, stopped) + after[len(self._before):])

    def _rest_of_close(self, last_token: int | None, stopped: bool) -> str:
        if not stopped or last_token is None:
            return self._close
        text = self._stop_texts.get(last_token)
        if text is None:
            text = self._stop_texts[last_token] = self.tokenizer.decode([last_token])
        # Another stop token (e.g. <|endoftext|> where the template closes with <|im_end|>): close the turn.
        return self._close[len(text):] if self._close.startswith(text) else self._close
