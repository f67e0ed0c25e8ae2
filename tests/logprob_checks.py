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
