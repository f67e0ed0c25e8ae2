"""Token-budget micro-batches and the no-recompute shortcut give the losses and gradients of the padded path;
chunked log-probs equal the direct ones."""

import itertools
import random

import pytest
import torch

from hpc_rl import config
from hpc_rl.algos.losses import actor_loss, aggregate_count, micro_batch_weight
from hpc_rl.train import experience
from hpc_rl.train.experience import pack, policy_forward, token_logprobs
from hpc_rl.train.micro_batches import _cost, _cut, _greedy, _least_padding, plan, row_lengths, token_counts
from hpc_rl.train.trainer import needs_old_logprobs_forward


def _rows(seed: int, n: int, vocab: int = 40):
    rnd = random.Random(seed)
    prompts = [[rnd.randrange(3, vocab) for _ in range(rnd.randint(1, 6))] for _ in range(n)]
    responses = [[rnd.randrange(3, vocab) for _ in range(rnd.choice([0, 1, 2, 5, 9, 14]))] for _ in range(n)]
    return prompts, responses


def test_trim_cuts_to_the_longest_prompt_and_response_of_the_rows():
    b = pack([[1, 2, 3, 4], [5], [6, 7]], [[8], [9, 10, 11], [12]], pad_id=0)
    t = b.slice(torch.tensor([1, 2])).trim()
    assert t.prompt_len == 2 and t.responses.shape[1] == 3
    assert t.input_ids.tolist() == [[0, 5, 9, 10, 11], [6, 7, 12, 0, 0]]
    assert t.position_ids[0, 1:].tolist() == [0, 1, 2, 3]  # positions still count real tokens only


def test_plan_covers_every_row_once_within_the_budget_and_sorts_by_length():
    prompts, responses = _rows(0, 24)
    b = pack(prompts, responses, pad_id=0)
    rows = torch.arange(24)
    mbs = plan(b, rows, max_tokens=40, micro_size=0, collective=False)
    seen = sorted(i for m in mbs for i in m.rows.tolist())
    assert seen == list(range(24))
    lengths = row_lengths(b)
    for m in mbs:
        if len(m.rows) > 1:  # a row longer than the budget gets a micro-batch of its own
            assert m.computed_tokens <= 40, m.computed_tokens
        assert m.real_tokens == sum(sum(lengths[i]) for i in m.rows.tolist())
    totals = [sum(lengths[i]) for m in mbs for i in m.rows.tolist()]
    assert totals == sorted(totals)
    computed, real = token_counts(mbs)
    padded = b.input_ids.numel()
    assert real <= computed < padded  # less padding than the one padded batch


def test_cut_makes_exactly_k_nonempty_groups():
    lengths = [(2, 1), (2, 1), (3, 4), (3, 8), (5, 9), (6, 14)]
    assert len(_greedy(lengths, 1000)) == 1
    for k in range(1, 7):
        starts = _cut(lengths, k)
        assert len(starts) == k and starts[0] == 0 and starts == sorted(set(starts))


def _total(lengths, starts):
    bounds = starts + [len(lengths)]
    groups = [lengths[a:b] for a, b in zip(bounds, bounds[1:])]
    return sum(_cost(len(g), max(p for p, _ in g), max(r for _, r in g)) for g in groups), groups


def test_least_padding_cut_is_the_best_contiguous_cut_within_the_budget():
    rnd = random.Random(5)
    for _ in range(60):
        n = rnd.randint(1, 9)
        lengths = sorted(((rnd.randint(1, 4), rnd.randint(0, 20)) for _ in range(n)), key=lambda x: (sum(x), x[1]))
        cap = rnd.randint(8, 80)
        k = len(_greedy(lengths, cap)) + rnd.randint(0, 2)
        starts = _least_padding(lengths, k, cap)
        total, groups = _total(lengths, starts)
        assert starts[0] == 0 and len(starts) <= k
        assert all(len(g) == 1 or _cost(len(g), max(p for p, _ in g), max(r for _, r in g)) <= cap for g in groups)
        best = min(  # every way to cut the sorted rows into at most k groups within the cap
            (_total(lengths, [0, *cuts])[0] for m in range(0, min(k, n)) for cuts in itertools.combinations(range(1, n), m)
             if all(len(g) == 1 or _cost(len(g), max(p for p, _ in g), max(r for _, r in g)) <= cap
                    for g in _total(lengths, [0, *cuts])[1])), default=None)
        assert total == best


def test_fixed_micro_batches_hold_micro_size_rows():
    prompts, responses = _rows(1, 12)
    b = pack(prompts, responses, pad_id=0)
    mbs = plan(b, torch.arange(12), max_tokens=0, micro_size=4, collective=False)
    assert [len(m.rows) for m in mbs] == [4, 4, 4]


def test_micro_batch_weight_by_hand():
    mini = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    assert (aggregate_count(mini, "token_mean"), aggregate_count(mini, "seq_mean")) == (6.0, 3.0)
    assert aggregate_count(mini, "token_sum") == 0.0
    assert micro_batch_weight(mini[:2], 6.0, "token_mean") == pytest.approx(3 / 6)
    assert micro_batch_weight(mini[2:], 3.0, "seq_mean") == pytest.approx(1 / 3)
    assert micro_batch_weight(mini[2:3], 0.0, "token_mean") == 0.0
    assert micro_batch_weight(mini[:2], 6.0, "token_sum") == 1.0 and micro_batch_weight(mini[:2], 6.0, "token_sum", 2) == 2.0
    # Two ranks, this one with 3 of the mini-batch's 9 tokens (the other rank holds 3 more): DeepSpeed averages the
    # two ranks' gradients, so each rank's share is doubled: 2 x 3 / 9.
    assert micro_batch_weight(mini[:2], 9.0, "token_mean", 2) == pytest.approx(2 * 3 / 9)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_entropy_equal_the_direct_computation(monkeypatch, temperature):
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 50, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (3, 5))
    z = logits / temperature
    lp_ref = torch.log_softmax(z, -1).gather(-1, labels[..., None]).squeeze(-1)
    ent_ref = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    g_ref = torch.autograd.grad((lp_ref.sum() + 0.3 * ent_ref.sum()), logits)[0]
    monkeypatch.setattr(experience, "LOGIT_CHUNK_BYTES", 4 * 50 * 4)  # 4 tokens per chunk: 4 chunks, recomputed
    lp, ent = token_logprobs(logits, labels, temperature, with_entropy=True)
    g = torch.autograd.grad((lp.sum() + 0.3 * ent.sum()), logits)[0]
    torch.testing.assert_close(lp, lp_ref.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ent_ref.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_output_layer_equals_full_logits(tiny_model, monkeypatch, temperature):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float64)
    prompts, responses = _rows(4, 6, vocab=model.config.vocab_size)
    batch = pack(prompts, responses, pad_id=0)
    monkeypatch.setattr(experience, "LOGIT_CHUNK_BYTES", 4 * 4 * model.config.vocab_size)  # 4 tokens per chunk
    assert experience._lean_head(model) is not None
    lp, ent = policy_forward(model, batch, temperature, with_entropy=True)
    g = torch.autograd.grad(lp.sum() + 0.3 * ent.sum(), list(model.parameters()), allow_unused=True)
    assert "forward" not in model.lm_head.__dict__  # the output layer is itself again
    P = batch.prompt_len
    z = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
              position_ids=batch.position_ids).logits[:, P - 1:-1] / temperature
    lp_ref = torch.log_softmax(z, -1).gather(-1, batch.responses[..., None]).squeeze(-1)
    ent_ref = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    g_ref = torch.autograd.grad(lp_ref.sum() + 0.3 * ent_ref.sum(), list(model.parameters()), allow_unused=True)
    torch.testing.assert_close(lp, lp_ref.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ent_ref.float(), atol=1e-5, rtol=1e-5)
    for a_, b_ in zip(g, g_ref):
        if b_ is not None:
            torch.testing.assert_close(a_, b_, atol=1e-5, rtol=1e-4)


def _grads_and_loss(model, batch, a, micro_batches, old_from_forward: bool):
    """Sum of weighted micro-batch actor losses and its gradient, as Trainer._update forms them."""
    adv = torch.linspace(-1.0, 1.0, batch.size)[:, None].expand_as(batch.response_mask).contiguous()
    with torch.no_grad():
        old_full, _ = policy_forward(model, batch) if old_from_forward else (None, None)
    model.zero_grad()
    total = 0.0
    for mb in micro_batches:
        idx, w = mb.rows, mb.response_width
        mask = mb.batch.response_mask
        logp, ent = policy_forward(model, mb.batch, with_entropy=True)
        old = old_full[idx, :w] if old_from_forward else logp.detach()
        loss, _ = actor_loss(logp, ent, old, None, adv[idx, :w], mask, a, 0.0)
        weighted = loss * micro_batch_weight(mask, aggregate_count(batch.response_mask, a.loss_agg), a.loss_agg)
        weighted.backward()
        total += float(weighted.detach())
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "token_sum", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_token_budget_and_no_recompute_give_the_padded_paths_loss_and_gradients(tiny_model, agg):
    from transformers import AutoModelForCausalLM

    # float64 weights; the log-softmax runs in float32 (as in training), so sums agree to ~1e-7 relative.
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float64)
    model.eval()  # no dropout: both paths see the same function
    prompts, responses = _rows(2, 10, vocab=model.config.vocab_size)
    responses[3] = []  # an empty response: no tokens, its row must not count under seq_mean
    batch = pack(prompts, responses, pad_id=0)
    a = config.load_dict({"model": {"path": str(tiny_model)},
                          "algorithm": {"loss_agg": agg, "entropy_coef": 0.01}}).algorithm
    rows = torch.arange(batch.size)
    padded = plan(batch, rows, 0, batch.size, collective=False)
    assert len(padded) == 1
    budget = plan(batch, rows, 30, 0, collective=False)
    assert len(budget) >= 3
    ref_loss, ref_grads = _grads_and_loss(model, batch, a, padded, old_from_forward=True)
    for mbs, old_from_forward in ((budget, True), (padded, False), (budget, False)):
        loss, grads = _grads_and_loss(model, batch, a, mbs, old_from_forward)
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert grads.keys() == ref_grads.keys()
        for k in grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-4, atol=1e-7)
    # The test can fail: a mean of micro-batch means (no weights) is another loss.
    unweighted = sum(float(actor_loss(*_lp_ent(model, m), None, *_adv_mask(batch, m), a, 0.0)[0]) for m in budget)
    assert unweighted / len(budget) != pytest.approx(ref_loss, rel=1e-2)


def _lp_ent(model, mb):
    with torch.no_grad():
        logp, ent = policy_forward(model, mb.batch, with_entropy=True)
    return logp, ent, logp


def _adv_mask(batch, mb):
    adv = torch.linspace(-1.0, 1.0, batch.size)[:, None].expand_as(batch.response_mask)
    return adv[mb.rows, :mb.response_width], mb.batch.response_mask


class _Cfg:
    def __init__(self, **kw):
        self.__dict__.update(kw)


@pytest.mark.parametrize(("overrides", "expected"), [
    ({}, False),  # GRPO toy shape: one epoch, one optimizer step
    ({"algorithm": {"ppo_epochs": 2}}, True),
    ({"trainer": {"mini_batch_size": 32}}, True),
    ({"algorithm": {"name": "ppo", "group_size": 1, "kl": {"coef": 0.05, "in_reward": True}}}, True),
    ({"algorithm": {"name": "ppo", "group_size": 1}}, False),
])
def test_old_logprob_forward_is_skipped_only_where_it_cannot_change_the_result(overrides, expected):
    base = {"model": {"path": "model"}, "trainer": {"prompts_per_step": 8, "mini_batch_size": 64},
            "algorithm": {"group_size": 8}}
    for k, v in overrides.items():
        base[k] = {**base[k], **v}
    if base["algorithm"]["group_size"] == 1:  # PPO: one sample per prompt
        base["trainer"]["mini_batch_size"] = 8
    cfg = config.load_dict(base)
    use_ref = cfg.algorithm.kl.coef > 0
    assert needs_old_logprobs_forward(cfg, use_ref, "none", _Cfg(attention_dropout=0.0)) is expected
    # Dropout: train and eval mode differ, so the forward stays; LoRA's own dropout too.
    assert needs_old_logprobs_forward(cfg, use_ref, "none", _Cfg(attention_dropout=0.1)) is True
    cfg.model.lora = config.LoraConfig(dropout=0.0)
    assert needs_old_logprobs_forward(cfg, use_ref, "none", _Cfg(attention_dropout=0.0)) is expected
    cfg.model.lora = config.LoraConfig(dropout=0.05)
    assert needs_old_logprobs_forward(cfg, use_ref, "none", _Cfg(attention_dropout=0.0)) is True
    # Importance weights at another temperature need a temperature-1 forward before the update.
    cfg.rollout.temperature = 0.7
    assert needs_old_logprobs_forward(cfg, use_ref, "tis", _Cfg()) is True


def test_mini_batches_are_the_same_samples_at_any_number_of_ranks():
    """update.mini_batch_rows: each rank's share of mini-batch k, over all ranks, is one rank's mini-batch k."""
    from hpc_rl.train.update import mini_batch_rows

    n, mb = 24, 8
    one = mini_batch_rows(n, mb, 1, 0, seed=3, step=5).tolist()
    assert sorted(one) == list(range(n)) and one != list(range(n))  # shuffled, each sample once
    for world in (2, 4):
        per = mb // world
        shares = [mini_batch_rows(n, mb, world, r, seed=3, step=5).tolist() for r in range(world)]
        assert sorted(sum(shares, [])) == list(range(n))
        for k in range(n // mb):
            assert sum((s[k * per:(k + 1) * per] for s in shares), []) == one[k * mb:(k + 1) * mb]
    assert mini_batch_rows(n, mb, 1, 0, seed=3, step=6).tolist() != one  # another step, another order
