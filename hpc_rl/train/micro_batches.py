"""Micro-batches of one rank's samples: sorted by length, cut into groups of about the same number of computed
tokens (a token budget, as verl's dynamic batch size and OpenRLHF's dynamic batching), each trimmed to its own
longest prompt and response, so that little padding is computed.

Every trainer rank must run the same number of forwards and backwards (ZeRO-3 gathers parameters in each), so
the number of micro-batches is agreed over the ranks (the largest any rank needs) before the rows are cut.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .distributed import all_reduce_scalar
from .experience import Batch


@dataclass
class MicroBatch:
    """Rows of the rank's batch (indices into it) and those rows trimmed to their own prompt/response widths."""

    rows: torch.Tensor  # [b] long, on the batch's device
    batch: Batch  # [b, P' + R'], P' and R' the longest prompt and response among these rows
    real_tokens: int  # prompt + response tokens that are not padding

    @property
    def computed_tokens(self) -> int:
        return self.batch.input_ids.numel()

    @property
    def response_width(self) -> int:
        return self.batch.responses.shape[1]


def _cost(n: int, p: int, r: int) -> int:
    """Tokens a forward over n rows computes when the longest prompt is p and the longest response r."""
    return n * (p + max(r, 1))


def _greedy(lengths: list[tuple[int, int]], cap: int) -> list[int]:
    """Start index of each group when sorted rows are added to a group while its cost stays <= cap."""
    starts, n, p, r = [0], 0, 0, 0
    for i, (pi, ri) in enumerate(lengths):
        if n and _cost(n + 1, max(p, pi), max(r, ri)) > cap:
            starts.append(i)
            n, p, r = 0, 0, 0
        n, p, r = n + 1, max(p, pi), max(r, ri)
    return starts


def _cut(lengths: list[tuple[int, int]], k: int) -> list[int]:
    """Start indices of exactly k contiguous non-empty groups of the sorted rows, with the largest group cost as
    small as the greedy cut allows (binary search on the cap)."""
    lo = max(_cost(1, p, r) for p, r in lengths)
    hi = _cost(len(lengths), max(p for p, _ in lengths), max(r for _, r in lengths))
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_greedy(lengths, mid)) <= k:
            hi = mid
        else:
            lo = mid + 1
    return _split_to(_greedy(lengths, lo), len(lengths), k)


def _split_to(starts: list[int], n: int, k: int) -> list[int]:
    """Halve the largest group (by rows) until there are k groups (k <= n)."""
    groups = _group_bounds(starts, n)
    while len(groups) < k:
        j = max(range(len(groups)), key=lambda i: groups[i][1] - groups[i][0])
        a, b = groups[j]
        groups[j:j + 1] = [(a, (a + b) // 2), ((a + b) // 2, b)]
    return [a for a, _ in groups]


# Rows x groups x candidate group sizes above which the exact cut (_least_padding) gives way to the greedy one.
EXACT_CUT_LIMIT = 2_000_000


def _least_padding(lengths: list[tuple[int, int]], k: int, cap: int) -> list[int] | None:
    """Start indices of at most k contiguous groups of the sorted rows, each costing <= cap (a row costing more
    stays alone), with the fewest computed tokens in total (dynamic programming over cut points); None when
    the search would be too large (see EXACT_CUT_LIMIT)."""
    n = len(lengths)
    # The most rows a group under the cap can hold: the greedy first group's (the rows are sorted, so no
    # group further right may hold more).
    width = _group_bounds(_greedy(lengths, cap), n)[0][1]
    if n * k * width > EXACT_CUT_LIMIT:
        return None
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]  # best[g][j]: least cost of rows[:j] in g groups
    back = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0
    for g in range(1, k + 1):
        for j in range(1, n + 1):
            p = r = 0
            for i in range(j - 1, max(-1, j - 1 - width), -1):  # group rows[i:j], grown leftwards
                p, r = max(p, lengths[i][0]), max(r, lengths[i][1])
                c = _cost(j - i, p, r)
                if c > cap and j - i > 1:
                    break
                if best[g - 1][i] + c < best[g][j]:
                    best[g][j], back[g][j] = best[g - 1][i] + c, i
    g = min(range(1, k + 1), key=lambda x: (best[x][n], x))
    if best[g][n] == inf:
        return None
    starts, j = [], n
    while g:
        j = back[g][j]
        starts.append(j)
        g -= 1
    return starts[::-1]


def _group_bounds(starts: list[int], n: int) -> list[tuple[int, int]]:
    bounds = starts + [n]
    return list(zip(bounds, bounds[1:]))


def row_lengths(batch: Batch) -> list[tuple[int, int]]:
    """(prompt tokens, response tokens) of every row, padding not counted."""
    p = batch.attention_mask[:, :batch.prompt_len].sum(-1).tolist()
    r = batch.attention_mask[:, batch.prompt_len:].sum(-1).tolist()  # observation tokens are computed too
    return list(zip(p, r))


def plan(batch: Batch, rows: torch.Tensor, max_tokens: int, micro_size: int, collective: bool = True
         ) -> list[MicroBatch]:
    """Cut `rows` of `batch` into micro-batches: sorted by length, then groups of at most `micro_size` rows
    (max_tokens 0) or of at most ~`max_tokens` computed tokens (a longer row gets a group of its own); with
    `collective`, every rank ends with as many groups as the rank that needs the most (collective call)."""
    rows = rows.to("cpu")
    lengths_all = row_lengths(batch)
    order = sorted(rows.tolist(), key=lambda i: (lengths_all[i][0] + lengths_all[i][1], lengths_all[i][1]))
    lengths = [lengths_all[i] for i in order]
    n = len(order)
    if max_tokens:
        k = len(_greedy(lengths, max_tokens))
        if collective:
            k = int(all_reduce_scalar(float(k), "max"))
        k = min(k, n)
        # The fewest padded tokens within the budget, its largest groups split up to the agreed number (the
        # min-max cut where the exact search would be too large).
        starts = _least_padding(lengths, k, max_tokens)
        starts = _cut(lengths, k) if starts is None else _split_to(starts, n, k)
    else:
        starts = list(range(0, n, micro_size))
    bounds = starts + [n]
    device = batch.input_ids.device
    out = []
    for a, b in zip(bounds, bounds[1:]):
        idx = torch.tensor(order[a:b], dtype=torch.long, device=device)
        real = sum(p + r for p, r in lengths[a:b])
        out.append(MicroBatch(idx, batch.slice(idx).trim(), real))
    return out


def token_counts(micro_batches: list[MicroBatch]) -> tuple[int, int]:
    """(computed tokens, real tokens) of micro-batches: their padding share is 1 - real / computed."""
    return sum(m.computed_tokens for m in micro_batches), sum(m.real_tokens for m in micro_batches)
