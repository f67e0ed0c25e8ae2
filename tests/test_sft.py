"""SFT (algorithm.name: sft): which tokens carry loss (the completion's and the assistant turns', never the prompt's),
the loss against a hand computation, and the toy job end to end: it learns the held-out pairs, a resume from an
earlier checkpoint takes exactly the steps the straight run took, and the export loads with from_pretrained and
answers the held-out prompts."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from hpc_rl.config import DataConfig
from hpc_rl.data.sft import SFTDataset, encode_row
from hpc_rl.errors import DataError
from hpc_rl.metrics import read_metrics
from hpc_rl.models.tiny import train_tokenizer
from hpc_rl.train.experience import policy_forward
from hpc_rl.train.sft_update import pack_examples

from .runs import hpc_rl, only_run

REPO = Path(__file__).resolve().parent.parent
# Each turn is `<role> content`, an assistant turn closed by <eos>; the generation prompt is `<assistant>`.
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}{% if m['role'] == 'assistant' %}<eos>"
            "{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def tok():
    t = train_tokenizer(["<user> copy 1 2 : <assistant> 1 2", "<tool> 3 4 5 6 7 8 9 0"])
    t.chat_template = TEMPLATE
    return t


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_a_completion_is_the_target_and_the_prompt_carries_no_loss(tok):
    ex = encode_row({"prompt": "copy 1 2 :", "completion": " 1 2"}, tok, DataConfig(source="x.jsonl"), "row 0")
    assert ex.prompt == _ids(tok, "copy 1 2 :")
    assert ex.target == _ids(tok, " 1 2") + [tok.eos_token_id] and ex.mask == [1] * len(ex.target)
    batch = pack_examples([ex, ex], tok.pad_token_id)
    # The loss covers the response columns only: the target's tokens, the eos included.
    assert batch.response_mask.tolist() == [[1.0] * len(ex.target)] * 2
    assert batch.input_ids[0, :batch.prompt_len].tolist() == ex.prompt


def test_a_chat_trains_its_assistant_turns_only(tok):
    messages = [{"role": "user", "content": "copy 1 2 :"}, {"role": "assistant", "content": "1 2"},
                {"role": "tool", "content": "3 4"}, {"role": "assistant", "content": "3 4"}]
    ex = encode_row({"prompt": messages}, tok, DataConfig(source="x.jsonl"), "row 0")
    assert ex.prompt == _ids(tok, "<user> copy 1 2 :<assistant>")
    first, tool, second = _ids(tok, " 1 2<eos>"), _ids(tok, "<tool> 3 4<assistant>"), _ids(tok, " 3 4<eos>")
    assert ex.target == first + tool + second
    assert ex.mask == [1] * len(first) + [0] * len(tool) + [1] * len(second)
    # A chat prompt with a completion string: the completion is its assistant turn.
    one = encode_row({"prompt": messages[:1], "completion": "1 2"}, tok, DataConfig(source="x.jsonl"), "row 0")
    assert (one.prompt, one.target, one.mask) == (ex.prompt, first, [1] * len(first))


def test_a_template_that_rewrites_earlier_turns_and_rows_without_a_target_are_refused(tok):
    other = copy.deepcopy(tok)
    # Each rendering marks the last message: an earlier turn renders differently once a later one follows it.
    other.chat_template = ("{% for m in messages %}{% if loop.last %}<last>{% endif %}<{{ m['role'] }}> "
                           "{{ m['content'] }}{% endfor %}")
    messages = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"},
                {"role": "user", "content": "3"}, {"role": "assistant", "content": "4"}]
    with pytest.raises(DataError, match="renders the conversation up to message 1 differently"):
        encode_row({"prompt": messages}, other, DataConfig(source="x.jsonl"), "row 0")
    with pytest.raises(DataError, match="no 'completion' field and no assistant turn in 'prompt'"):
        encode_row({"prompt": messages[:1]}, tok, DataConfig(source="x.jsonl"), "row 0")


def test_the_loss_is_the_cross_entropy_of_the_target_tokens(tok):
    """policy_forward's log-probs under the mask are the model's next-token cross-entropy at the target positions,
    computed here by hand over the unpadded sequence: the prompt's tokens, the padding and the masked tool turn add
    nothing."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)).eval()
    rows = [{"prompt": [{"role": "user", "content": "copy 1 2 :"}, {"role": "assistant", "content": "1 2"},
                        {"role": "tool", "content": "3"}, {"role": "assistant", "content": "3"}]},
            {"prompt": "copy 1 :", "completion": " 1"}]
    examples = [encode_row(r, tok, DataConfig(source="x.jsonl"), "row") for r in rows]
    batch = pack_examples(examples, tok.pad_token_id)
    with torch.no_grad():
        logp, _ = policy_forward(model, batch)
    got = float(-(logp * batch.response_mask).sum() / batch.response_mask.sum())
    nll, count = 0.0, 0
    for ex in examples:
        ids = torch.tensor([ex.prompt + ex.target])
        with torch.no_grad():
            logits = model(ids).logits[0]
        for j, (token, m) in enumerate(zip(ex.target, ex.mask)):
            if m:
                pos = len(ex.prompt) + j - 1  # the logits that predict target token j
                nll -= float(torch.log_softmax(logits[pos].double(), -1)[token])
                count += 1
    assert count == int(batch.response_mask.sum()) == 2 + 1 + 1 + 1 + 1 + 1  # ' 1 2 <eos>', ' 3 <eos>', ' 1 <eos>'
    assert got == pytest.approx(nll / count, abs=1e-5)


def test_the_toy_dataset_has_its_answers_as_completions(tok):
    from hpc_rl.data.toy import copy_pair_corpus

    t = train_tokenizer(copy_pair_corpus())
    data = SFTDataset(DataConfig(source="toy:copy_pair", toy_size=4, max_prompt_tokens=16, max_completion_tokens=8),
                      t, seed=1)
    for row, ex in zip(data.rows, data.examples):
        assert t.decode(ex.target, skip_special_tokens=True) == " " + row["ground_truth"]


@pytest.mark.slow
def test_toy_sft_learns_the_held_out_pairs_resumes_exactly_and_exports(tmp_path):
    """jobs/toy-sft-cpu.yaml as users run it (two ranks, ZeRO-3): the training loss and the held-out pairs' loss fall;
    a copy of the run resumed from its step-20 checkpoint takes the same steps 21-30 (the same rows, the same
    optimizer state: losses and final weights equal); the export loads with from_pretrained, and its greedy answers
    to the 20 held-out prompts score >= 0.8 by the task's rule reward (the toys' criterion)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpc_rl.data.toy import copy_pair_rows
    from hpc_rl.rewards.toy import copy_pair

    p = hpc_rl("run", REPO / "jobs" / "toy-sft-cpu.yaml", cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run = only_run(tmp_path)
    rows = read_metrics(run / "metrics.jsonl")
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    evals = {int(r["eval/step"]): r["eval/loss"] for r in rows if "eval/loss" in r}
    assert list(losses) == list(range(1, 31)) and list(evals) == [0, 10, 20, 30], rows
    assert losses[30] < 0.05 < 1.0 < losses[1], losses
    assert evals[30] < 0.05 and evals[30] < evals[10] < evals[0], evals
    log = (run / "logs" / "trainer-0.log").read_text()
    assert "SFT, no rollout servers" in p.stdout + p.stderr and "summary: 30 steps" in log, log[-2000:]
    assert not (run / "rendezvous" / "rollout-0.json").exists()

    # Resume a copy of the run from its step-20 checkpoint.
    twin = tmp_path / "resumed" / run.name
    shutil.copytree(run, twin, symlinks=True)
    shutil.rmtree(twin / "checkpoints" / "step_30")
    (twin / "checkpoints" / "latest").write_text("step_20")
    p = hpc_rl("run", REPO / "jobs" / "toy-sft-cpu.yaml", "--resume", twin, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    again = {r["step"]: r["loss"] for r in read_metrics(twin / "metrics.jsonl") if "loss" in r}
    assert list(again) == list(range(1, 31))
    assert all(abs(again[s] - losses[s]) < 1e-6 for s in range(21, 31)), (again, losses)
    straight = load_file(run / "checkpoints" / "step_30" / "hf" / "model.safetensors")
    resumed = load_file(twin / "checkpoints" / "step_30" / "hf" / "model.safetensors")
    assert max(float((straight[k] - resumed[k]).abs().max()) for k in straight) < 1e-6

    out = tmp_path / "exported"
    p = hpc_rl("export", run, out, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    model, tok = AutoModelForCausalLM.from_pretrained(out).eval(), AutoTokenizer.from_pretrained(out)
    scores = []
    for row in copy_pair_rows(0, 1, "test"):
        ids = torch.tensor([tok(row["prompt"], add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
        text = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
        scores.append(copy_pair(row["prompt"], text, row["ground_truth"]))
    print(f"toy SFT: loss {losses[1]:.3f} -> {losses[30]:.4f}, held-out loss {evals[0]:.3f} -> {evals[30]:.4f}, "
          f"held-out greedy reward {sum(scores) / len(scores):.3f}")
    assert sum(scores) / len(scores) >= 0.8, scores
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
