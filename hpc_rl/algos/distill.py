"""On-policy distillation: the student samples, the teacher scores every sampled token, and the per-token reverse KL
between them is the learning signal.

Sources: Thinking Machines, "On-Policy Distillation" (2025), https://thinkingmachines.ai/blog/on-policy-distillation/
(reverse_kl = sampled log-probs - teacher log-probs; advantages = -coef * reverse_kl, per token, no discounting);
verl's docs/algo/opd.md and its reverse-KL "distillation" advantage; Agarwal et al., "On-Policy Distillation of
Language Models" (GKD, https://arxiv.org/abs/2306.13649) for the on-policy reverse KL objective. The optional
per-position baseline is the leave-one-out baseline of RLOO (Kool et al. 2019, https://openreview.net/forum?id=r1lgTGL5DE;
Ahmadian et al. 2024, https://arxiv.org/abs/2402.14740) applied to each response position's token-level signal.
The top-k term (distill.top_k) is the teacher's top-k distribution matched at every position the student sampled:
NeMo-RL's DistillationLossFn with the teacher's top-k logits and its forward KL
(https://github.com/NVIDIA-NeMo/RL/blob/main/nemo_rl/algorithms/loss_functions.py), GKD's forward KL on the
student's own samples.
"""

from __future__ import annotations

import torch


def reverse_kl(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token log pi_student(x_t) - log pi_teacher(x_t) of the sampled tokens: the one-sample estimate of
    KL(student || teacher) at each position (the tokens are the student's samples)."""
    return student_logprobs - teacher_logprobs


def distill_advantages(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor,
                       coef: float, baseline: str = "none") -> torch.Tensor:
    """[B, T] per-token advantages -coef * reverse KL (0 outside the mask): a token the teacher finds likelier than
    the student did is pushed up, one it finds unlikely is pushed down. baseline "position": each token's reverse KL
    less the mean of the other samples' at the same position (none there: nothing subtracted)."""
    rkl = reverse_kl(student_logprobs, teacher_logprobs) * mask
    if baseline == "position":
        others = mask.sum(0, keepdim=True) - mask
        rkl = rkl - (rkl.sum(0, keepdim=True) - rkl) / others.clamp(min=1)
    return -coef * rkl * mask


def topk_forward_kl(student_top_logprobs: torch.Tensor, teacher_top_logprobs: torch.Tensor,
                    temperature: float = 1.0) -> torch.Tensor:
    """[B, T] per-position KL(q || p) over the teacher's top k tokens: q the teacher's distribution at `temperature`
    renormalized over its top k (teacher_top_logprobs [B, T, k], temperature-1 log-probs as the engines report
    them), p the student's log-probs of the same tokens ([B, T, k], at the sampling temperature, not renormalized).
    Zero only when the student puts all its mass on those k tokens in the teacher's proportions: mass outside them
    counts as distance (sum_k q (log q - log p) = KL(q || p/Z) - log Z, Z the student's mass on them)."""
    log_q = torch.log_softmax(teacher_top_logprobs.float() / temperature, dim=-1)
    q = log_q.exp()
    # A token the teacher gives no mass (-inf: see without_unknown_tokens) adds nothing, rather than 0 * inf.
    return torch.where(q > 0, q * (log_q - student_top_logprobs), 0.0).sum(-1)


def without_unknown_tokens(top_ids: torch.Tensor, top_logprobs: torch.Tensor,
                           vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k with the ids the student has no logit for (a teacher of the same tokenizer whose
    embedding is padded further, as Qwen2.5-7B's 152,064 rows against 0.5B's 151,936) dropped: id 0, log-prob -inf,
    so they weigh nothing in topk_forward_kl."""
    unknown = top_ids >= vocab
    return top_ids.masked_fill(unknown, 0), top_logprobs.masked_fill(unknown, float("-inf"))
