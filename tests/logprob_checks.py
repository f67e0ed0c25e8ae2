"""Comparing a rollout server's log-probs with a local model's: the sequences, both sides and their difference."""

import torch

from hpc_rl.models import load_causal_lm

SEQS, LENS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15]], [2, 1]


def local_logprobs(model, seqs=SEQS, lens=LENS) -> list[list[float]]:
    """Raw log-probs of seqs[i][lens[i]:] under `model`, one unpadded sequence at a time."""
    out = []
    for seq, pl in zip(seqs, lens):
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1)
        out.append([lp[j - 1, seq[j]].item() for j in range(pl, len(seq))])
    return out


def served_logprobs(url: str, session, timeout: float = 60) -> list[list[float]]:
    """The server's /logprobs of SEQS (LENS)."""
    r = session.post(url + "/logprobs", json={"token_ids": SEQS, "prompt_lens": LENS}, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()["logprobs"]


def max_diff(got, want) -> float:
    return max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w))


def perturbed(model_dir, seed: int):
    """The model of `model_dir` with seeded noise on every weight: new weights of the same architecture."""
    m = load_causal_lm(model_dir).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return m


def multi_turn_check(run, model_dir, max_model_len: int, turns: int = 3, rows: int = 4) -> tuple[float, list]:
    """Trajectories of tests.envs:EchoEnv sampled by the run's server through the multi-turn loop, and the max
    |trainer - engine| log-prob over their assistant tokens (the trainer's forward: pack + policy_forward)."""
    from hpc_rl.models import load_tokenizer
    from hpc_rl.orchestrator.multi_turn import Limits, MultiTurnRollout
    from hpc_rl.rollout.client.rollout_client import RolloutClient
    from hpc_rl.rollout.environments.tools import ToolContext
    from hpc_rl.rollout.wire.sampling import SamplingParams
    from hpc_rl.train.experience import pack, policy_forward
    from tests.envs import EchoEnv

    tok = load_tokenizer(str(model_dir))
    client = RolloutClient(run, run.read_token())
    limits = Limits(max_turns=turns, max_total_tokens=max_model_len - 8, tool_timeout_s=30, max_new_tokens=3,
                    max_model_len=max_model_len)
    loop = MultiTurnRollout(EchoEnv, {"turns": turns}, tok, client, limits, ToolContext())
    params = SamplingParams(max_new_tokens=3, seed=5, stop_token_ids=[tok.eos_token_id])
    trajs, stats = loop.run([{"id": i, "prompt": f"{i} + {i} ="} for i in range(rows)], params, step=0)
    assert stats["tool_calls_per_sample"] >= 1 and stats["turns_per_sample"] >= 2, stats
    for t in trajs:
        assert len(t.response_ids) == len(t.mask) == len(t.logprobs)
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.mask) if m == 0)
    batch = pack([t.prompt_ids for t in trajs], [t.response_ids for t in trajs], tok.pad_token_id,
                 [t.mask for t in trajs])
    model = load_causal_lm(model_dir).eval()
    with torch.no_grad():
        mine, _ = policy_forward(model, batch)
    diff = 0.0
    for i, t in enumerate(trajs):
        for j, (lp, m) in enumerate(zip(t.logprobs, t.mask)):
            if m:
                diff = max(diff, abs(float(mine[i, j]) - lp))
    return diff, trajs


def check_each_token_is_its_versions(run, batches) -> int:
    """Rescore every response token of `batches` (a run's RolloutBatches) with the model of the policy version it
    reports (model.path for 0, else that step's checkpoint): each agrees with the engine's log-prob within 1e-4.
    Returns how many tokens came after a version change within their sample (checked against the newer version)."""
    from hpc_rl import checkpoints, config
    from hpc_rl.models.loading import load_tokenizer
    from hpc_rl.train.experience import pack, policy_forward

    cfg = config.load(run.job_yaml)
    pad = load_tokenizer(cfg.model.path).pad_token_id
    models: dict = {}
    moved = 0
    for b in batches:
        per_token = b.per_token_versions()
        assert [v[0] for v in per_token] == b.versions  # a sample's version: its first (oldest) token's
        packed = pack(b.prompts, b.responses, pad)
        for version in sorted({v for vs in per_token for v in vs}):
            if version not in models:
                path = cfg.model.path if version == 0 else checkpoints.step_dir(run, version) / "hf"
                models[version] = load_causal_lm(str(path), dtype="float32").eval()
            with torch.no_grad():
                lp, _ = policy_forward(models[version], packed)
            for i, vs in enumerate(per_token):
                for j, v in enumerate(vs):
                    if v == version:
                        assert abs(lp[i, j].item() - b.rollout_logprobs[i][j]) < 1e-4, (b.step, i, j, version)
                        moved += v != vs[0]
    return moved
