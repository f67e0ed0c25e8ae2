"""On-policy distillation (algorithm.distill, services.teacher): the per-token advantage against hand-computed values,
the batch's teacher log-probs through select/concat/padding/checkpoints, the teacher server (scores like the local
model, refuses weights), the checks at load, and the toy job: a student distilled from the SFT-built teacher reaches
the toys' criterion in fewer steps than GRPO from the same student."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import requests
import torch

from hpc_rl import config
from hpc_rl.algos.distill import distill_advantages, reverse_kl, topk_forward_kl, without_unknown_tokens
from hpc_rl.config import TinyModelConfig
from hpc_rl.metrics import read_metrics
from hpc_rl.models.tiny import build_tiny_model
from hpc_rl.orchestrator.batch import RolloutBatch
from hpc_rl.rundir import create, read_json

from .runs import hpc_rl

REPO = Path(__file__).resolve().parent.parent


def test_the_advantage_is_the_negative_reverse_kl_per_token():
    student = torch.tensor([[-0.5, -2.0, -1.0], [-3.0, -0.1, 0.0]])
    teacher = torch.tensor([[-0.1, -6.0, -1.0], [-0.2, -0.1, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    torch.testing.assert_close(reverse_kl(student, teacher), torch.tensor([[-0.4, 4.0, 0.0], [-2.8, 0.0, 9.0]]))
    # -coef * (student - teacher): the teacher's likelier tokens up, its unlikely ones down; nothing past the mask
    got = distill_advantages(student, teacher, mask, coef=0.5)
    torch.testing.assert_close(got, torch.tensor([[0.2, -2.0, 0.0], [1.4, 0.0, 0.0]]))


def test_the_position_baseline_is_the_other_samples_mean_at_that_position():
    # reverse KL (teacher 0): three samples, the second one token shorter, only the first reaching position 3
    student = torch.tensor([[1.0, 2.0, 3.0, 5.0], [3.0, 0.0, 7.0, 7.0], [2.0, 4.0, 6.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    got = distill_advantages(student, torch.zeros_like(student), mask, coef=1.0, baseline="position")
    # position 0: 1 - (3+2)/2, 3 - (1+2)/2, 2 - (1+3)/2; position 2: 3 - 6, 6 - 3 (the second is masked); position 3:
    # no other sample there, nothing subtracted
    want = -torch.tensor([[-1.5, 0.0, -3.0, 5.0], [1.5, -3.0, 0.0, 0.0], [0.0, 3.0, 3.0, 0.0]])
    torch.testing.assert_close(got, want)
    # where every sample has a token, the advantages sum to 0
    torch.testing.assert_close(got[:, :2].sum(0), torch.zeros(2))


def test_the_topk_term_is_the_forward_kl_from_the_teachers_renormalized_top_k():
    import math

    log = math.log
    # the teacher's top 2 hold 0.5 and 0.25 (renormalized: 2/3, 1/3)
    teacher = torch.tensor([[[log(0.5), log(0.25)]] * 2 + [[log(0.5), log(0.125)]]])
    # the student: half and half; then exactly the teacher's proportions with 0.1 of its mass elsewhere
    student = torch.tensor([[[log(0.5), log(0.5)], [log(0.6), log(0.3)], [log(0.5), log(0.5)]]])
    got = topk_forward_kl(student, teacher)
    want = [2 / 3 * log(4 / 3) + 1 / 3 * log(2 / 3), -log(0.9),
            0.8 * log(0.8 / 0.5) + 0.2 * log(0.2 / 0.5)]  # at temperature 1 the third is 0.5, 0.125 -> 0.8, 0.2
    torch.testing.assert_close(got, torch.tensor([want]))
    # at temperature 2 the teacher's 0.5 and 0.125 become sqrt: 0.707, 0.354 -> 2/3, 1/3 again
    torch.testing.assert_close(topk_forward_kl(student, teacher, temperature=2.0)[0, 2], torch.tensor(want[0]))
    # a teacher id past the student's vocabulary (a further-padded embedding) is dropped: the rest renormalized
    ids, lp = without_unknown_tokens(torch.tensor([[[3, 9], [9, 4]]]), torch.tensor([[[log(0.5), log(0.25)]] * 2]), 8)
    assert ids.tolist() == [[[3, 0], [0, 4]]] and lp[0, 0, 1] == float("-inf") and lp[0, 1, 0] == float("-inf")
    s = torch.tensor([[[log(0.4), log(0.3)], [log(0.4), log(0.3)]]], requires_grad=True)
    got = topk_forward_kl(s, lp)
    torch.testing.assert_close(got, torch.tensor([[-log(0.4), -log(0.3)]]))  # all of q on the one known token
    got.sum().backward()
    assert torch.isfinite(s.grad).all() and s.grad[0, 0, 1] == 0 and s.grad[0, 1, 0] == 0


def test_the_students_topk_logprobs_come_from_the_same_forward(tmp_path):
    """policy_forward_top: the sampled tokens' log-probs and entropies as policy_forward's, the other tokens' as a full
    log-softmax gives them, with gradients (the chunked output layer); token_logprobs (models without it) alike."""
    from hpc_rl.models import load_causal_lm
    from hpc_rl.train import experience as ex

    corpus = [f"copy {a} {b} : {a} {b}" for a in range(10) for b in range(10)]
    model = load_causal_lm(build_tiny_model(TinyModelConfig(), corpus, tmp_path / "m"))
    b = ex.pack([[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]], pad_id=0)
    top = torch.tensor([[[1, 2, 3]] * 3, [[4, 5, 6]] * 3])
    lp, ent, top_lp = ex.policy_forward_top(model, b, top, temperature=0.7, with_entropy=True)
    want_lp, want_ent = ex.policy_forward(model, b, temperature=0.7, with_entropy=True)
    torch.testing.assert_close(lp, want_lp)
    torch.testing.assert_close(ent, want_ent)
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask,
                   position_ids=b.position_ids).logits[:, b.prompt_len - 1:-1].float()
    full = torch.log_softmax(logits / 0.7, -1)
    torch.testing.assert_close(top_lp, full.gather(-1, top), rtol=1e-5, atol=1e-5)
    top_lp.sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    got, _ = ex.token_logprobs(logits.detach(), top, 0.7)
    torch.testing.assert_close(got, full.detach().gather(-1, top), rtol=1e-5, atol=1e-5)


def _batch(n: int, teacher: bool) -> RolloutBatch:
    return RolloutBatch(step=0, prompts=[[1, 2]] * n, responses=[[3, 4, 5][:1 + i % 3] for i in range(n)],
                        loss_masks=[[1] * (1 + i % 3) for i in range(n)],
                        rollout_logprobs=[[-1.0] * (1 + i % 3) for i in range(n)], versions=[0] * n,
                        truncated=[False] * n, group_ids=[i // 2 for i in range(n)], prompt_ids=list(range(n)),
                        teacher_logprobs=[[-0.5 * i] * (1 + i % 3) for i in range(n)] if teacher else None)


def test_the_batch_carries_the_teachers_logprobs():
    b = _batch(4, teacher=True)
    assert b.select([3, 0]).teacher_logprobs == [[-1.5], [0.0]]
    both = RolloutBatch.concat([b, _batch(2, teacher=True)])
    assert both.teacher_logprobs == b.teacher_logprobs + [[0.0], [-0.5, -0.5]]
    padded = b.with_fillers(2, token=0)
    assert padded.teacher_logprobs[4:] == [[0.0], [0.0]]
    assert RolloutBatch.from_json(json.loads(json.dumps(b.to_json()))).teacher_logprobs == b.teacher_logprobs
    with pytest.raises(ValueError, match="teacher_logprobs has 1 entries for 4 samples"):
        _batch(4, teacher=False).__class__(**{**b.__dict__, "teacher_logprobs": [[0.0]]})
    with pytest.raises(ValueError, match="some batches have the teacher's log-probs"):
        RolloutBatch.concat([b, _batch(2, teacher=False)])
    # the teacher's top k (distill.top_k) go with their samples too
    top = RolloutBatch(**{**b.__dict__, "teacher_top_ids": [[[i, 9]] * len(r) for i, r in enumerate(b.responses)],
                          "teacher_top_logprobs": [[[-0.1, -2.0]] * len(r) for r in b.responses]})
    assert top.select([3, 0]).teacher_top_ids == [[[3, 9]], [[0, 9]]]
    padded = top.with_fillers(1, token=0)
    assert padded.teacher_top_ids[4:] == [[[]]] and padded.teacher_top_logprobs[4:] == [[[]]]
    assert RolloutBatch.concat([top, top]).teacher_top_ids == top.teacher_top_ids * 2
    back = RolloutBatch.from_json(json.loads(json.dumps(top.to_json())))
    assert back.teacher_top_ids == top.teacher_top_ids and back.teacher_top_logprobs == top.teacher_top_logprobs
    with pytest.raises(ValueError, match="some batches have the teacher's log-probs"):
        RolloutBatch.concat([top, b])
    from hpc_rl.train.experience import pad_top_rows

    torch.testing.assert_close(pad_top_rows(padded.teacher_top_ids[3:], 2, 2, torch.long),
                               torch.tensor([[[3, 9], [0, 0]], [[0, 0], [0, 0]]]))


def test_distillation_and_its_teacher_are_checked_at_load():
    toy = REPO / "jobs" / "toy-distill-cpu.yaml"
    cfg = config.load(toy)
    assert cfg.services.teacher.path.startswith("sft:") and cfg.algorithm.distill.only
    with pytest.raises(config.ConfigError, match="algorithm.distill: on-policy distillation needs a teacher"):
        config.load(toy, ["services.teacher=null"])
    with pytest.raises(config.ConfigError, match="services.teacher: a teacher serves on-policy distillation"):
        config.load(toy, ["algorithm.distill.coef=0", "algorithm.distill.only=false", "algorithm.distill.top_k=0"])
    with pytest.raises(config.ConfigError, match="algorithm.distill.top_k needs algorithm.distill.coef > 0"):
        config.load(toy, ["algorithm.distill.coef=0", "algorithm.distill.only=false"])
    with pytest.raises(config.ConfigError, match="the critic nothing to learn"):
        config.load(toy, ["algorithm.name=ppo"])
    with pytest.raises(config.ConfigError, match="algorithm.distill.top_k must be an integer from 0 .off. to 64; got 65"):
        config.load(toy, ["algorithm.distill.top_k=65"])


def test_a_teacher_with_another_tokenizer_is_refused_before_the_run_starts(tmp_path):
    other = build_tiny_model(TinyModelConfig(), [f"{i} + {i} = {2 * i}" for i in range(50)], tmp_path / "other")
    p = hpc_rl("run", REPO / "jobs" / "toy-distill-cpu.yaml", f"services.teacher.path={other}",
               f"output_dir={tmp_path / 'runs'}", cwd=REPO)
    err = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert err.startswith("hpc-rl: error: services.teacher.path: the tokenizer of ") and "is not the policy's" in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    # more top-k tokens than the teacher has
    p = hpc_rl("run", REPO / "jobs" / "toy-distill-cpu.yaml", "algorithm.distill.top_k=64",
               f"output_dir={tmp_path / 'runs'}", cwd=REPO)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1] == ("hpc-rl: error: algorithm.distill.top_k: 64 exceeds the 33 tokens of "
                                                 "the teacher's tokenizer; lower it")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


@pytest.mark.slow
def test_the_teacher_server_scores_like_its_model_and_refuses_weights(tmp_path):
    from safetensors.torch import save

    from hpc_rl.launch import start_rollout_server, stop_processes
    from hpc_rl.models import load_causal_lm

    corpus = [f"copy {a} {b} : {a} {b}" for a in range(10) for b in range(10)]
    student = build_tiny_model(TinyModelConfig(), corpus, tmp_path / "student")
    teacher = build_tiny_model(TinyModelConfig(init_std=0.2), corpus, tmp_path / "teacher")
    cfg = config.load_dict({"name": "t", "model": {"path": str(student)}, "data": {"max_prompt_tokens": 16},
                            "rollout": {"engine": "hf", "host": "127.0.0.1", "max_model_len": 32},
                            "services": {"teacher": {"path": str(teacher)}}, "algorithm": {"distill": {"coef": 1.0}}})
    run = create(tmp_path / "runs", "t")
    run.job_yaml.write_text(config.dump(cfg))
    proc = start_rollout_server(run, cfg, 0, kind="teacher")
    try:
        deadline = time.monotonic() + 120
        while not (info := read_json(run.rollout_file(0, "teacher"))) and time.monotonic() < deadline:
            assert proc.poll() is None, (run.logs / "teacher-0.log").read_text()[-2000:]
            time.sleep(0.2)
        s = requests.Session()
        s.headers["Authorization"] = "Bearer " + run.read_token()
        ids = [5, 6, 7, 8, 9, 10]
        got = s.post(info["url"] + "/logprobs", json={"token_ids": [ids], "prompt_lens": [3]}, timeout=60).json()
        model = load_causal_lm(teacher).eval()
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
        want = [float(lp[j - 1, ids[j]]) for j in range(3, len(ids))]
        assert got["logprobs"][0] == pytest.approx(want, abs=1e-5)  # the teacher's folder, not the policy's
        top = s.post(info["url"] + "/logprobs", json={"token_ids": [ids, ids[:4]], "prompt_lens": [3, 2], "top_k": 4},
                     timeout=60).json()
        assert top["logprobs"][0] == pytest.approx(want, abs=1e-5) and len(top["top_ids"][1]) == 2
        best = lp.topk(4, -1)
        assert top["top_ids"][0] == best.indices[2:5].tolist()  # positions 2..4 predict tokens 3..5
        torch.testing.assert_close(torch.tensor(top["top_logprobs"][0]), best.values[2:5].float(), atol=1e-4, rtol=0)
        bad = s.post(info["url"] + "/logprobs", json={"token_ids": [ids], "prompt_lens": [3], "top_k": 65}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"] == "top_k: must be <= 64, got 65", bad.text
        r = s.post(info["url"] + "/weights?version=1&bucket=0&final=1",
                   data=save({"lm_head.weight": torch.zeros(1)}), timeout=60)
        assert r.status_code == 400 and "teacher server (services.teacher): its weights never change" in r.text
    finally:
        stop_processes([proc])


@pytest.mark.slow
def test_a_student_distilled_from_the_sft_teacher_learns_in_half_the_steps_of_grpo(tmp_path):
    """jobs/toy-distill-cpu.yaml as users run it, from an empty directory (its sft: paths are the checkout's): its
    teacher and student built by the toy SFT job, the student reaches the toys' criterion (last-5 mean rule reward
    >= 0.8, trainer.stop_at) in at most half the steps GRPO on the rule reward takes from the same student at GRPO's
    own learning rate (measured: 13 against 36; GRPO at the job's 2e-3 does not reach it in 60); the teacher served
    every step with its top 8 and never took weights."""
    stop = "trainer.stop_at={reward_mean: 0.8}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    p = hpc_rl("run", REPO / "jobs" / "toy-distill-cpu.yaml", f"output_dir={tmp_path / 'distill'}", stop, cwd=elsewhere)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (run,) = list((tmp_path / "distill").iterdir())
    rows = read_metrics(run / "metrics.jsonl")
    rewards = [r["reward_mean"] for r in rows]
    kls = [r["distill/reverse_kl"] for r in rows]
    top = [r["distill/topk_kl"] for r in rows]
    assert sum(rewards[-5:]) / 5 >= 0.8 and len(rows) < 60, rewards
    assert all(r["teacher_seconds"] > 0 for r in rows) and kls[-1] < 0.5 * kls[0] and top[-1] < 0.5 * top[0], (kls, top)
    teacher_log = (run / "logs" / "teacher-0.log").read_text()
    assert "teacher server 0 serving" in teacher_log and "weights: loaded" not in teacher_log
    assert "1 teacher server(s)" in p.stdout + p.stderr

    p = hpc_rl("run", "jobs/toy-distill-cpu.yaml", f"output_dir={tmp_path / 'grpo'}", stop, "services.teacher=null",
               "algorithm.distill.coef=0", "algorithm.distill.only=false", "algorithm.distill.top_k=0", "trainer.lr=1e-3",
               cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (grpo_run,) = list((tmp_path / "grpo").iterdir())
    grpo = [r["reward_mean"] for r in read_metrics(grpo_run / "metrics.jsonl")]
    print(f"toy distillation: {len(rewards)} steps to a last-5 mean reward of 0.8 (reverse KL {kls[0]:.2f} -> "
          f"{kls[-1]:.2f}, top-8 KL {top[0]:.2f} -> {top[-1]:.2f}); GRPO from the same student: {len(grpo)} steps")
    assert len(rewards) <= 0.5 * len(grpo), (rewards, grpo)


@pytest.mark.slow
def test_distillation_with_asynchronous_rollouts(tmp_path):
    """rollout.async_steps 1: the batch generated a step ahead (by the previous policy version) is scored by the
    teacher when it is generated; every step has its teacher scores and a staleness of at most one version (the
    sampled-token formulation alone, distill.top_k 0)."""
    p = hpc_rl("run", "jobs/toy-distill-cpu.yaml", f"output_dir={tmp_path}", "rollout.async_steps=1", "trainer.steps=4",
               "eval.source=null", "checkpoint.every=0", "algorithm.distill.top_k=0", cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (run,) = list(tmp_path.iterdir())
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["teacher_seconds"] > 0 and r["policy_lag_max"] <= 1 for r in rows) and rows[-1]["policy_lag_max"] == 1


def test_teacher_nodes_follow_the_rollout_and_reward_nodes():
    from hpc_rl.cluster.layout import describe, role_of, total_nodes

    cfg = config.load(REPO / "jobs" / "toy-distill-cpu.yaml", ["trainer.nodes=2", "rollout.nodes=1",
                                                               "services.teacher.nodes=2",
                                                               "services.teacher.servers_per_node=2"])
    assert total_nodes(cfg) == 5
    assert [(n.index, n.role, n.role_index, n.procs) for n in cfg.node_roles()] == [
        (0, "trainer", 0, 2), (1, "trainer", 1, 2), (2, "rollout", 0, 1), (3, "teacher", 0, 2), (4, "teacher", 1, 2)]
    assert [role_of(cfg, i) for i in range(5)] == ["trainer", "trainer", "rollout", "teacher", "teacher"]
    assert describe(cfg)[4] == "node 4: teacher 1 (2 teacher server(s))"
    # where each role's servers run (the client names a missing server's node with it); a judge's nodes follow the
    # teacher's
    judged = config.load(REPO / "jobs" / "toy-distill-cpu.yaml", [
        "trainer.nodes=2", "rollout.nodes=1", "services.teacher.nodes=2", "services.teacher.servers_per_node=2",
        "services.judge={path: sft:jobs/toy-judge-sft-cpu.yaml, nodes: 1}",
        "reward.judge={template: '{{ completion }}', parser: yes_no}"])
    assert [judged.server_layout(r) for r in ("rollout", "teacher", "judge")] == [(2, 1, 1), (3, 2, 2), (5, 1, 1)]
    assert cfg.server_layout("reward") == (0, 0, 1)  # none of its own: beside trainer node 0
