"""Reward models: every pitfall of the issue is prevented or reported in one line; the math against hand values."""

import json
import logging

import numpy as np
import pytest
import torch

from hpc_rl import config
from hpc_rl.config import RewardConfig, RewardModelConfig
from hpc_rl.errors import ConfigError, ModelError, RewardError
from hpc_rl.rewards.base import combine_rewards
from hpc_rl.rewards.model import (
    HeadTap,
    RewardInputs,
    check_reward_model,
    label_to_read,
    last_token_index,
    load_reward_module,
    pad_right,
    read_head,
    same_tokenizer,
    score_sequences,
    select_scores,
    transform,
)

# ----------------------------------------------------------------------------- pooling and shapes


def test_last_token_index_with_left_and_right_padding():
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    left = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    assert last_token_index(right).tolist() == [2, 4, 0]
    assert last_token_index(left).tolist() == [4, 4, 4]


def test_shape_rules(caplog):
    assert select_scores(torch.tensor([1.0, 2.0]), 2, 0, 1).tolist() == [1.0, 2.0]
    with caplog.at_level(logging.WARNING, logger="hpc_rl"):
        assert select_scores(torch.tensor([[1.0], [2.0]]), 2, 0, 1).tolist() == [1.0, 2.0]
    assert "shape (B, 1); squeezed" in caplog.text
    # A head with 3 labels is read at label_index.
    assert select_scores(torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), 2, 2, 3).tolist() == [3.0, 6.0]
    for bad in (torch.zeros(2, 7), torch.zeros(2, 7, 1), torch.zeros(3)):
        with pytest.raises(RewardError) as e:
            select_scores(bad, 2, 0, 1)
        msg = str(e.value)
        assert f"shape {tuple(bad.shape)} for 2 samples" in msg and "AutoModelForSequenceClassification" in msg
        assert "\n" not in msg


def test_transform_scale_shift_by_hand():
    logits = np.array([-12.0, -10.0, -8.0])  # a binary head's raw logits, far below the rule rewards' [0, 1]
    raw = RewardModelConfig(transform="raw", scale=0.5, shift=-10.0)
    assert transform(logits, raw).tolist() == [-1.0, 0.0, 1.0]
    sig = RewardModelConfig(transform="sigmoid", scale=1.0, shift=-10.0)
    assert transform(logits, sig) == pytest.approx([1 / (1 + np.e ** 2), 0.5, 1 / (1 + np.e ** -2)])
    tanh = RewardModelConfig(transform="tanh", scale=2.0, shift=0.0)
    assert transform(np.array([0.5]), tanh) == pytest.approx([np.tanh(1.0)])


def test_weights_combine_and_every_part_is_logged():
    cfg = RewardConfig(function="hpc_rl.rewards.toy:repeat_digit", model=RewardModelConfig(path="x", scale=2.0),
                       weights={"function": 0.5, "model": 1.0}, monitor="hpc_rl.rewards.toy:repeat_digit")
    parts = {"function": [1.0, 0.0], "model_logits": [0.25, -0.5], "monitor": [1.0, 0.5]}
    total, stats = combine_rewards(parts, cfg)
    assert total.tolist() == [0.5 * 1.0 + 0.5, 0.0 - 1.0]
    assert stats["reward_function_mean"] == 0.5 and stats["reward_model_mean"] == pytest.approx(-0.25)
    assert stats["reward_model_logit_min"] == -0.5 and stats["reward_mean"] == pytest.approx(0.0)
    assert stats["reward_max"] == 1.0 and stats["monitor_mean"] == 0.75
    parts["model_logits"] = [0.0, float("nan")]
    with pytest.raises(RewardError, match="sample 1 scored nan"):
        combine_rewards(parts, cfg)


# ----------------------------------------------------------------------------- config and folder checks


def test_reward_config_errors_name_the_key():
    base = {"model": {"path": "m"}}
    with pytest.raises(ConfigError, match="neither reward.function nor reward.model"):
        config.load_dict({**base, "reward": {"function": None}})
    with pytest.raises(ConfigError, match="reward.weights.model: this job has no reward model"):
        config.load_dict({**base, "reward": {"weights": {"model": 2.0}}})
    with pytest.raises(ConfigError, match="reward.weights.critic: unknown part"):
        config.load_dict({**base, "reward": {"weights": {"critic": 2.0}}})
    with pytest.raises(ConfigError, match="exactly one of reward.model.path"):
        config.load_dict({**base, "reward": {"model": {"batch_size": 4}}})
    with pytest.raises(ConfigError, match="reward.model.transform: 'softmax' is not valid"):
        config.load_dict({**base, "reward": {"model": {"path": "r", "transform": "softmax"}}})
    # No GPU is given to two components: each rollout server needs tensor_parallel + 1 GPUs.
    with pytest.raises(ConfigError, match=r"\(rollout.tensor_parallel \+ 1\) x rollout.servers_per_node = 4 GPUs\) "
                                          "but a rollout node has 2"):
        config.load_dict({**base, "trainer": {"device": "cuda"}, "slurm": {"gpus_per_node": 2},
                          "rollout": {"servers_per_node": 2},
                          "reward": {"model": {"path": "r", "placement": "server"}}})


def _save_head(tmp_path, num_labels, arch="Qwen2ForSequenceClassification"):
    d = tmp_path / f"head{num_labels}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": [arch], "num_labels": num_labels,
                                               "id2label": {str(i): f"L{i}" for i in range(num_labels)}}))
    return d


def test_head_size_and_kind_checked_at_load(tmp_path):
    two = _save_head(tmp_path, 2)
    with pytest.raises(ConfigError) as e:
        label_to_read(read_head(two), None, two)
    assert "reward.model.label_index: the head of" in str(e.value) and "has 2 labels" in str(e.value)
    assert label_to_read(read_head(two), 1, two) == 1
    with pytest.raises(ConfigError, match="outside the head .* which has 2 label"):
        label_to_read(read_head(two), 5, two)
    lm = _save_head(tmp_path, 1, arch="Qwen2ForCausalLM")
    with pytest.raises(ModelError, match="is a Qwen2ForCausalLM, not a ...ForSequenceClassification: loading it "
                                         "would add an untrained head"):
        read_head(lm)
    with pytest.raises(ModelError, match="reward.model.path: .* does not exist"):
        read_head(tmp_path / "nowhere")


def test_reward_tokenizer_without_pad_gets_eos_with_a_warning(tiny_reward_model, tmp_path, caplog):
    import shutil

    d = tmp_path / "nopad"
    shutil.copytree(tiny_reward_model, d)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc.pop("pad_token", None)
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    with caplog.at_level(logging.WARNING, logger="hpc_rl"):
        from hpc_rl.rewards.model import load_reward_tokenizer

        tok = load_reward_tokenizer(RewardModelConfig(path=str(d)))
    assert tok.pad_token == tok.eos_token == "<eos>"
    assert "has no pad_token; using eos_token" in caplog.text
    assert check_reward_model(RewardModelConfig(path=str(d)))[0] == 0


# ----------------------------------------------------------------------------- the last real token


def _per_token(model, row):
    """The head's output at every position of one unpadded row."""
    seen = []
    h = model.score.register_forward_hook(lambda _m, _i, o: seen.append(o))
    with torch.no_grad():
        model(input_ids=torch.tensor([row]))
    h.remove()
    return seen[0][0, :, 0]


def test_scored_at_the_last_real_token_not_the_first_nor_before_eos(tiny_reward_model):
    cfg = config.load_dict({"model": {"path": str(tiny_reward_model)}})
    model, tok, label = load_reward_module(RewardModelConfig(path=str(tiny_reward_model)), cfg)
    eos = tok.eos_token_id
    rows = [[22, 18, 9, 19, 9, 9, eos], [22, 18, 5, 19], [22, 18, 7, 19, 7, 7, 7, 7, 7, eos]]
    tap = HeadTap(model, label)
    got = score_sequences(tap, rows, batch_size=3, pad_id=tok.pad_token_id, device="cpu")
    want = [float(_per_token(model, r)[-1]) for r in rows]
    assert got == pytest.approx(want, abs=1e-5)
    assert all(abs(float(_per_token(model, r)[0]) - w) > 1e-3 for r, w in zip(rows, want))
    # When pad is eos, transformers' own pooling reads the token before the final eos; this one does not.
    model.config.pad_token_id = eos
    ids, att = pad_right(rows, eos, "cpu")
    with torch.no_grad():
        hf = model(input_ids=ids, attention_mask=att).logits[:, 0]
        ours = tap(ids, att)
    assert ours.tolist() == pytest.approx(want, abs=1e-5)
    assert abs(float(hf[0]) - want[0]) > 1e-3


# ----------------------------------------------------------------------------- tokenizers


def _other_reward_model(tmp_path):
    """A reward model with its own tokenizer (another vocabulary, a chat template)."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from hpc_rl.models.tiny import train_tokenizer

    tok = train_tokenizer([f"user: copy {d} : assistant: {d} {d} {d} {d}" for d in "0123456789"], vocab_size=80)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=16, num_labels=1,
                      pad_token_id=tok.pad_token_id, architectures=["Qwen2ForSequenceClassification"])
    torch.manual_seed(0)
    d = tmp_path / "other-rm"
    Qwen2ForSequenceClassification(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_another_tokenizer_gets_the_text_with_its_chat_template(tiny_model, tiny_reward_model, tmp_path):
    from hpc_rl.models.loading import load_tokenizer

    policy_tok = load_tokenizer(tiny_model)
    same = RewardInputs(policy_tok, load_tokenizer(tiny_reward_model), max_length=64)
    assert same.same
    prompt_ids = policy_tok("copy 7 :", add_special_tokens=False)["input_ids"]
    response_ids = policy_tok(" 7 7", add_special_tokens=False)["input_ids"] + [policy_tok.eos_token_id]
    assert same(prompt_ids, response_ids, "copy 7 :", " 7 7") == prompt_ids + response_ids

    other_dir = _other_reward_model(tmp_path)
    other_tok = load_tokenizer(other_dir)
    assert not same_tokenizer(policy_tok, other_tok)
    bridge = RewardInputs(policy_tok, other_tok, max_length=64)
    ids = bridge(prompt_ids, response_ids, "copy 7 :", policy_tok.decode(response_ids, skip_special_tokens=True))
    want = other_tok.apply_chat_template([{"role": "user", "content": "copy 7 :"},
                                          {"role": "assistant", "content": " 7 7"}], tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert ids == want and ids != prompt_ids + response_ids
    assert other_tok.decode(ids) == "user: copy 7 :<eos>assistant:  7 7<eos>"
    # Scored like the text itself would be by that model.
    cfg = config.load_dict({"model": {"path": str(tiny_model)}})
    model, tok, label = load_reward_module(RewardModelConfig(path=str(other_dir)), cfg)
    tap = HeadTap(model, label)
    assert score_sequences(tap, [ids], 1, tok.pad_token_id, "cpu")[0] == pytest.approx(
        float(_per_token(model, want)[-1]), abs=1e-5)
    # Too long: the last max_length tokens are kept (the scored token is the last), and counted.
    short = RewardInputs(policy_tok, other_tok, max_length=5)
    assert short(prompt_ids, response_ids, "copy 7 :", " 7 7") == want[-5:] and short.truncated == 1


# ----------------------------------------------------------------------------- the tiny reward model


def test_tiny_reward_model_ranks_held_out_pairs(tiny_reward_model):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from hpc_rl.models.tiny_reward import preference_pairs, ranking_accuracy

    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model)
    tok = AutoTokenizer.from_pretrained(tiny_reward_model)
    held_out = preference_pairs(tok, 1000, seed=987_654)  # training used seeds near seed * 1_000_003 + step
    acc = ranking_accuracy(model, held_out, tok.pad_token_id)
    print(f"tiny reward model: {acc:.3f} of 1000 held-out pairs ranked correctly")
    assert acc >= 0.9


def test_reward_nodes_have_a_role_and_a_place_in_the_job():
    from hpc_rl.cluster.layout import describe, node_roles, role_of, total_nodes
    from hpc_rl.cluster.render import render

    cfg = config.load_dict({"model": {"path": "m"}, "trainer": {"nodes": 2}, "rollout": {"nodes": 1},
                            "reward": {"nodes": 2, "model": {"path": "r", "placement": "server"}}})
    assert total_nodes(cfg) == 5
    assert [role_of(cfg, i) for i in range(5)] == ["trainer", "trainer", "rollout", "reward", "reward"]
    assert [(n.role, n.role_index) for n in node_roles(cfg)][3:] == [("reward", 0), ("reward", 1)]
    assert describe(cfg)[4] == "node 4: reward 1 (1 reward server (the reward model only))"
    # hetjob: the reward nodes join the rollout component.
    cfg.slurm.layout = "hetjob"
    script = render(cfg, "/runs/x")
    trainer_part, rollout_part = script.split("#SBATCH hetjob")
    assert "#SBATCH --nodes=2" in trainer_part and "#SBATCH --nodes=3" in rollout_part.split("\n\n")[0]
    with pytest.raises(ConfigError, match="reward.nodes: nodes of their own serve a reward model"):
        config.load_dict({"model": {"path": "m"}, "reward": {"nodes": 1, "model": {"path": "r"}}})
    with pytest.raises(ConfigError, match="its last 1 GPU"):
        config.load_dict({"model": {"path": "m"}, "rollout": {"local_devices": [0], "tensor_parallel": 1},
                          "reward": {"nodes": 1, "model": {"path": "r", "placement": "server"}}})


def test_each_server_of_a_gpu_node_gets_its_own_gpus():
    from hpc_rl.launch import node_server_devices

    def cfg(**reward):
        return config.load_dict({"model": {"path": "m"}, "trainer": {"device": "cuda"},
                                 "slurm": {"gpus_per_node": 8}, "rollout": {"servers_per_node": 4, "tensor_parallel": 1},
                                 "reward": reward})

    rollout = [("rollout", k) for k in range(4, 8)]  # the second rollout node's servers
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    # A reward model on each server: 1 GPU for vLLM, the next for the reward model (rewards/serving.py: cuda:1).
    got = node_server_devices(cfg(model={"path": "r", "placement": "server"}), rollout, env)
    assert list(got.values()) == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]
    assert list(node_server_devices(cfg(), rollout, env).values()) == [["0"], ["1"], ["2"], ["3"]]
    # Without CUDA_VISIBLE_DEVICES, slurm.gpus_per_node; a reward node's server takes one.
    assert node_server_devices(cfg(nodes=1, model={"path": "r", "placement": "server"}), [("reward", 0)], {}) == \
        {("reward", 0): ["0"]}
    # CPU nodes: nothing to split.
    cpu = config.load_dict({"model": {"path": "m"}, "trainer": {"device": "cpu"}})
    assert node_server_devices(cpu, rollout, {}) is None
