"""Multi-turn pieces without a server: the calculator, chat formatting of observations, masks through packing and
GAE, the toy environment, config checks of rollout.env."""

import pytest
import torch

from hpc_rl.algos.advantages import discounted_returns, gae
from hpc_rl.config import ConfigError, TinyModelConfig, load_dict
from hpc_rl.data.toy import LOOKUP_CHAT_TEMPLATE, lookup_corpus, lookup_rows
from hpc_rl.models.tiny import train_tokenizer
from hpc_rl.rollout.environments.chat import FALLBACK_TEMPLATE, ChatFormat
from hpc_rl.rollout.environments.tool_env import ToolCallEnv
from hpc_rl.rollout.environments.tools import ToolContext, calculate, calculator_tool, is_error
from hpc_rl.rollout.environments.toy import LookupEnv
from hpc_rl.train.experience import pack
from hpc_rl.train.micro_batches import row_lengths

# Qwen2.5's ChatML shape, reduced: what matters is the turn closing text `<|im_end|>\n` after a sampled stop.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("expr,want", [("1 + 2 * 3", 7), ("(3 + 4) * 12 / 5", 16.8), ("2 ** 10", 1024),
                                       ("-7 // 2", -4), ("sqrt(16) + abs(-2)", 6.0), ("10 % 4", 2), ("2^3", 8)])
def test_calculator_values(expr, want):
    assert calculate(expr) == pytest.approx(want)


@pytest.mark.parametrize("expr,needle", [("__import__('os').system('id')", "not allowed"), ("(1).real", "not allowed"),
                                         ("2 ** 100000", "exponent"), ("1 / 0", "division"), ("x + 1", "not allowed"),
                                         ("1 +", "not an arithmetic"), ("9" * 300, "longer than")])
def test_calculator_refuses_with_one_line(expr, needle):
    out = calculator_tool({"expression": expr}, ToolContext())
    assert is_error(out) and needle in out and "\n" not in out


def test_tool_call_env_parses_hermes_calls():
    env = ToolCallEnv(tools=["calculator"])
    env.reset({"prompt": "what is 6 * 7?"})
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
    obs, reward, done = env.step({"role": "assistant", "content": call})
    assert obs == [{"role": "tool", "content": "42"}] and reward is None and not done
    obs, _, _ = env.step({"role": "assistant", "content": "<tool_call>{bad json</tool_call>"})
    assert is_error(obs[0]["content"]) and "not valid JSON" in obs[0]["content"]
    obs, _, _ = env.step({"role": "assistant", "content": '<tool_call>{"name": "shell", "arguments": {}}</tool_call>'})
    assert "no tool 'shell'" in obs[0]["content"]
    assert env.step({"role": "assistant", "content": "The answer is 42."}) == (None, None, True)
    with pytest.raises(ValueError, match="rollout.env_kwargs.tools"):
        ToolCallEnv(tools=["shell"])


def test_lookup_env_rewards_only_answers_after_the_lookup():
    row = lookup_rows(1, 0)[0]
    d = row["ground_truth"]
    env = LookupEnv()
    assert env.reset(row) == [{"role": "user", "content": row["prompt"]}]
    assert env.step({"role": "assistant", "content": f"{d} {d}"}) == (None, 0.0, True)  # a guess
    env.reset(row)
    assert env.step({"role": "assistant", "content": " look"}) == ([{"role": "tool", "content": d}], None, False)
    assert env.step({"role": "assistant", "content": f" {d} {d} x y"}) == (None, 0.5, True)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(lookup_corpus() + ["<|im_start|>user assistant tool seen<|im_end|>\n"])


def test_observation_ids_follow_the_template(tokenizer):
    tokenizer.chat_template = LOOKUP_CHAT_TEMPLATE
    fmt = ChatFormat(tokenizer)
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert fmt.prompt_ids([{"role": "user", "content": "find c"}]) == enc("find c :")
    obs = [{"role": "tool", "content": "7"}]
    # The sampled <eos> closed the turn: the observation is the tool's text only; a turn cut at max_new_tokens
    # gets the template's closing <eos> first.
    assert fmt.observation_ids(obs, tokenizer.eos_token_id, stopped=True) == enc(" = 7")
    assert fmt.observation_ids(obs, 5, stopped=False) == [tokenizer.eos_token_id] + enc(" = 7")


def test_observation_ids_with_chatml_and_without_a_template(tokenizer):
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    fmt = ChatFormat(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    obs = [{"role": "tool", "content": "seen"}]
    # Stopped on <|im_end|>: the newline the template puts after it starts the observation.
    assert fmt.observation_ids(obs, im_end, stopped=True) == enc("\n<|im_start|>tool\nseen<|im_end|>\n"
                                                                 "<|im_start|>assistant\n")
    assert fmt.observation_ids(obs, 5, stopped=False)[:1] == [im_end]
    tokenizer.chat_template = None
    fmt = ChatFormat(tokenizer)
    assert fmt.template == FALLBACK_TEMPLATE
    assert fmt.observation_ids(obs, tokenizer.eos_token_id, stopped=True) == enc("\ntool: seen\nassistant:")


def test_pack_masks_observations_and_lengths_count_them():
    b = pack([[5, 6], [7]], [[1, 2, 3, 4, 9], [1, 2]], pad_id=0, masks=[[1, 0, 0, 1, 1], [1, 1]])
    assert b.response_mask.tolist() == [[1, 0, 0, 1, 1], [1, 1, 0, 0, 0]]
    assert row_lengths(b) == [(2, 5), (1, 2)]
    assert b.trim().responses.shape[1] == 5  # an observation inside is not padding


def test_gae_skips_observation_tokens():
    # Tokens: a0 [obs] a1 a2, reward 1 on the last; gamma 0.9, lam 0.8; values 0.1 0.(obs) 0.3 0.4.
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    r = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    v = torch.tensor([[0.1, 9.0, 0.3, 0.4]])
    adv, ret = gae(r, v, mask, gamma=0.9, lam=0.8)
    d2 = 1.0 - 0.4                         # last token: r - V
    d1 = 0.0 + 0.9 * 0.4 - 0.3             # a1 -> a2
    d0 = 0.0 + 0.9 * 0.3 - 0.1             # a0 bootstraps from a1's value, across the observation
    a2, a1 = d2, d1 + 0.72 * d2
    a0 = d0 + 0.72 * a1
    assert adv.tolist()[0] == pytest.approx([a0, 0.0, a1, a2])
    assert ret[0, 1] == 0.0
    g = discounted_returns(r, mask, 0.5)
    assert g.tolist()[0] == pytest.approx([0.25, 0.0, 0.5, 1.0])  # the observation is not a step


def _job(**rollout):
    return {"name": "t", "model": {"tiny": TinyModelConfig().__dict__}, "rollout": rollout}


def test_config_checks_of_rollout_env():
    cfg = load_dict({**_job(env="hpc_rl.rollout.environments.toy:LookupEnv"), "reward": {"function": None}})
    assert cfg.rollout.env.endswith(":LookupEnv") and cfg.rollout.sandbox.require_isolation
    for rollout, needle in [({"env": "no_colon"}, "rollout.env"),
                            ({"env": "a:B", "max_turns": 0}, "rollout.max_turns"),
                            ({"env": "a:B", "max_total_tokens": 100000}, "rollout.max_total_tokens"),
                            ({"env": "a:B", "tool_timeout_s": 1, "sandbox": {"wall_s": 5}}, "rollout.sandbox.wall_s"),
                            ({"env": "a:B", "sandbox": {"memory_mb": 0}}, "rollout.sandbox.memory_mb")]:
        with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
            load_dict(_job(**rollout))
    with pytest.raises(ConfigError, match="reward.weights.environment"):
        load_dict({**_job(), "reward": {"weights": {"environment": 1.0}}})


def test_idle_seconds_of_overlapping_spans():
    from hpc_rl.metrics import idle_seconds

    # [0, 10] with requests in flight over 1-3, 2-5 and 7-(still running): busy 4 + 3 seconds.
    assert idle_seconds([(1, 3), (2, 5), (7, None)], 0, 10) == pytest.approx(3.0)
    assert idle_seconds([], 0, 2) == 2.0 and idle_seconds([(-5, 20)], 0, 2) == 0.0
