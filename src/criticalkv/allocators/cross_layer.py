"""Cross-layer allocation (Layer-DefensiveKV): one contest over every layer's entries sets each layer's and each
head's budget, so layers whose scores are concentrated give budget to layers whose scores are spread.

This module holds the reference form, which scores every layer before it allocates (``cross_layer``: the runtime
keeps every layer dense until the end of the prefill), and the per-layer shares both cross-layer allocators
build on; ``cross_layer_bounded`` holds the form that compresses as it goes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from criticalkv.allocators.base import Allocator
from criticalkv.core.heads import every_head, head_shard
from criticalkv.core.stages import every_layer
from criticalkv.core.view import LayerView
from criticalkv.selectors.base import keep_protected
from criticalkv.selectors.defensive import take_ordered


@dataclass
class LayerShare:
    """What one layer brings to a cross-layer contest.

    Each head first reserves ``base`` entries: its protected positions (the most recent first) and then its own
    best scores, ``max(n_safe, P)`` in all but never more than the row budget ``B``. The other real entries
    compete for the pooled budget; the layer adds ``room = h_kv * (B - base)`` entries to the pool. A row kept
    whole (``B >= n`` or ``P >= n``) reserves every real entry and adds nothing.
    """

    reserved: torch.Tensor  # (b, h_kv, t) bool
    contest: torch.Tensor  # (b, h_kv, t) float32: scores of the competing entries, -inf elsewhere
    base: torch.Tensor  # (b,) long: reserved entries per head
    room: torch.Tensor  # (b,) long: entries this layer adds to the pooled budget
    whole: torch.Tensor  # (b,) bool: rows kept whole

    @classmethod
    def of(
        cls,
        scores: torch.Tensor,
        row_budgets: torch.Tensor,
        view: LayerView,
        protected: torch.Tensor | None,
        safeguard: float,
    ) -> LayerShare:
        """The share of a layer with scores (b, h_kv, t), row budgets (b,) and protected positions (b, t)."""
        _, h, _ = scores.shape
        valid = view.valid  # (b, t)
        lengths = view.lengths  # (b,)
        prot = torch.zeros_like(valid) if protected is None else protected & valid
        n_prot = prot.sum(-1)  # (b,)
        budgets = torch.minimum(row_budgets.long(), lengths)  # B: (b,)
        whole = (row_budgets >= lengths) | (n_prot >= lengths)
        n_safe = torch.minimum(torch.floor(budgets.double() * safeguard + 1e-9).long().clamp(min=1), budgets)
        base = torch.where(whole, lengths, torch.minimum(torch.maximum(n_safe, n_prot), budgets))  # (b,)
        per_head = base[:, None].expand(-1, h)
        reserved = keep_protected(prot, per_head)
        reserved = take_ordered(scores.float(), reserved, valid, per_head - reserved.sum(-1))
        reserved = torch.where(whole[:, None, None], valid[:, None, :], reserved)
        competing = valid[:, None, :] & ~reserved & ~prot[:, None, :]
        contest = scores.float().masked_fill(~competing, float("-inf"))
        room = torch.where(whole, 0, h * (budgets - base)).clamp(min=0)
        return cls(reserved, contest, base, room, whole)


def contest_winners(values: torch.Tensor, room: torch.Tensor) -> torch.Tensor:
    """The ``room[b]`` best finite ``values`` (b, m) of each row: (b, m) bool.

    Ties go to the lower index (a stable sort), so a contest is a strict order over (value, index); the bounded
    allocator relies on it to reproduce the reference contest exactly.
    """
    ordered = values.sort(dim=-1, descending=True, stable=True)
    slots = torch.arange(values.shape[-1], device=values.device)[None, :] < room[:, None]
    take = slots & torch.isfinite(ordered.values)
    return torch.zeros_like(take).scatter(-1, ordered.indices, take)


@dataclass
class CrossLayerAllocator(Allocator):
    """Layer-DefensiveKV's reference allocation: one contest over the entries of every layer and head.

    Per row, with ``L`` compressed layers of ``h`` KV heads and a budget of ``B`` entries per head, the model keeps
    ``L h B`` entries: every head reserves its ``LayerShare.base`` entries (its protected positions first, at
    least one entry), and the remaining ``L h (B - base)`` go to the best scores pooled over all layers and heads.
    A head's budget is its reserve plus the contest entries that landed in it; layers' budgets differ, and their
    sum is exactly ``L h B``.

    ``cross_layer`` makes the method deferred: every layer stays dense until the whole prefill is scored, so the
    peak memory is the full cache's (``BoundedCrossLayerAllocator`` reaches the same allocation without that).

    Parameters
    ----------
    safeguard
        Share of ``B`` each head reserves from its own best entries (at least one). 0, the reference code's
        choice: it has no reserve, but its window carries the layer's top score and so is reserved in practice.

    Notes
    -----
    Row budgets, protected positions and lengths are those of one prompt, the same in every layer: the first
    layer's stand for all (on a pipeline stage, for the layers other stages hold too).

    The reference code compares the scores of different layers as they are; so does this allocator, which is
    meaningful for DefensiveKV's ranking (attention times value shares normalised per token across heads).
    The reference code gives the window the layer's top score, so a window could in theory lose to another
    layer's entries; here protected positions are always reserved.
    """

    safeguard: float = 0.0
    cross_layer: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.safeguard <= 1.0:
            raise ValueError(f"safeguard must be in [0, 1], got {self.safeguard}")

    def allocate_layers(
        self,
        scores: list[torch.Tensor],
        row_budgets: list[torch.Tensor],
        views: list[LayerView],
        protected: list[torch.Tensor],
    ) -> list[torch.Tensor]:
        """Per-head budgets (b, h_kv) long of every layer given, from their scores (b, h_kv, t).

        Under tensor parallelism each layer's scores are taken over every rank's heads (``every_head``); on a
        pipeline stage, the other stages' layers join the contest (``every_layer``). The budgets returned are
        this process's heads of the layers given.
        """
        every = every_layer([every_head(v, s) for s, v in zip(scores, views, strict=True)], views)  # layer order
        shares = [LayerShare.of(s, row_budgets[0], views[0], protected[0], self.safeguard) for s in every.values()]
        b, h, t = shares[0].contest.shape
        values = torch.cat([share.contest.reshape(b, h * t) for share in shares], dim=1)  # (b, L h t)
        room = torch.stack([share.room for share in shares]).sum(0)  # (b,)
        won = contest_winners(values, room).view(b, len(shares), h, t).sum(-1)  # (b, L, h)
        budgets = dict(zip(every, (share.base[:, None] + won[:, index] for index, share in enumerate(shares))))
        out = []
        for view in views:
            shard = head_shard(view)
            layer_budgets = budgets[view.module.layer_idx]
            out.append(layer_budgets if shard is None else shard.local(layer_budgets))
        return out
