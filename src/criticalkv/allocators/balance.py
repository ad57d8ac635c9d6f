"""A cap on how unevenly head-adaptive budgets load the tensor-parallel ranks.

Head-adaptive allocators (AdaKV, HeadKV) give some KV heads more entries than others; under tensor parallelism
each rank holds a contiguous block of heads, so one rank may hold far more of the cache than the others, and the
fullest rank decides whether a device runs out of memory. ``cap_rank_imbalance`` moves entries from the heads of
over-full ranks to the heads of the others until no rank holds more than ``1 + max_imbalance`` times the mean.
"""

from __future__ import annotations

import math

import torch


def head_order(scores: torch.Tensor, valid: torch.Tensor, protected: torch.Tensor | None) -> torch.Tensor:
    """Each head's entries from most to least worth keeping, as values: (b, h, t) float32, sorted descending.

    Protected positions come first (+inf), padding last (-inf): ``order[b, h, k]`` is the value of the entry a
    head with budget ``k + 1`` adds last, the order in which the top-k selector fills a head.
    """
    value = scores.float().masked_fill(~valid[:, None, :], float("-inf"))
    if protected is not None:
        value = value.masked_fill((protected & valid)[:, None, :], float("inf"))
    return value.sort(dim=-1, descending=True).values


def _counts(chosen: torch.Tensor, t: int, heads: int) -> torch.Tensor:
    """How many flat (head * t + position) indices fall in each head: (heads,) long."""
    return torch.bincount(chosen // t, minlength=heads)


def cap_rank_imbalance(
    budgets: torch.Tensor,
    scores: torch.Tensor,
    valid: torch.Tensor,
    protected: torch.Tensor | None,
    ranks: int,
    max_imbalance: float,
) -> torch.Tensor:
    """Per-head budgets (b, h) whose per-rank sums stay within ``(1 + max_imbalance)`` of the per-rank mean.

    The heads are split into ``ranks`` contiguous blocks (tensor parallelism's split). For each row whose
    fullest block holds more than ``cap = max(ceil(m), floor((1 + max_imbalance) * m))`` entries, with ``m`` the
    row's total over ``ranks``:

    1. every over-full block gives up its excess: the entries it kept last (lowest in ``head_order``) go first,
       but no head drops below ``min(its budget, floor(total / h))``, the row's mean head budget, so heads at or
       below the mean (AdaKV's safeguard, the protected window) are never cut;
    2. the freed entries go to the best entries not yet kept in the heads of the other blocks, each block taking
       no more than its room under the cap, no head more than the row's real length.

    The row's total is unchanged, so the layer keeps as many entries as the allocator decided; rows already
    within the cap are unchanged. Both steps always succeed (the cap is at least the mean). The result depends
    only on the arguments, so every rank computes the same budgets from the same gathered scores.

    Parameters
    ----------
    budgets
        (b, h) long, an allocator's per-head budgets.
    scores
        (b, h, t) the scores the allocator ranked.
    valid, protected
        (b, t) bool: real positions, and positions kept first (None: none).
    ranks
        Number of contiguous head blocks; must divide ``h``.
    max_imbalance
        >= 0. 0 gives every block the same number of entries (up to rounding).
    """
    if max_imbalance < 0 or not math.isfinite(max_imbalance):
        raise ValueError(f"max_imbalance must be finite and >= 0, got {max_imbalance}")
    b, h, t = scores.shape
    if h % ranks:
        raise ValueError(f"{h} heads do not split into {ranks} blocks")
    per_rank = h // ranks
    out = budgets.clone()
    order = None
    lengths = valid.sum(-1)  # (b,)
    for row in range(b):
        total = int(out[row].sum())
        mean = total / ranks
        cap = max(math.ceil(mean - 1e-9), math.floor((1 + max_imbalance) * mean + 1e-9))
        held = out[row].view(ranks, per_rank).sum(-1)  # (ranks,)
        if int(held.max()) <= cap:
            continue
        if order is None:
            order = head_order(scores, valid, protected)
        ranked = order[row]  # (h, t)
        k = torch.arange(t, device=scores.device)[None, :]  # (1, t)
        floor = torch.minimum(out[row], torch.tensor(total // h, device=out.device))
        moved = 0
        for block in range(ranks):  # 1. cut each over-full block down to the cap
            excess = int(held[block]) - cap
            if excess <= 0:
                continue
            heads = slice(block * per_rank, (block + 1) * per_rank)
            kept = (k >= floor[heads, None]) & (k < out[row, heads, None])  # entries above the floor
            cut = ranked[heads].masked_fill(~kept, float("inf")).flatten().topk(excess, largest=False).indices
            out[row, heads] -= _counts(cut, t, per_rank)
            moved += excess
        room = (cap - out[row].view(ranks, per_rank).sum(-1)).clamp(min=0)  # (ranks,)
        open_ = (k >= out[row, :, None]) & (k < lengths[row])  # (h, t) entries a head could add, in order
        offers = ranked.masked_fill(~open_, float("-inf"))
        candidates = torch.full_like(offers, float("-inf"))  # each block's best entries, at most its room
        for block in range(ranks):
            heads = slice(block * per_rank, (block + 1) * per_rank)
            n = int(room[block])
            if n > 0:
                best = offers[heads].flatten().topk(min(n, per_rank * t)).indices
                candidates[heads].view(-1)[best] = offers[heads].flatten()[best]
        won = candidates.flatten().topk(moved).indices  # 2. the freed entries go to the best of those
        out[row] += _counts(won, t, h)
    return out
