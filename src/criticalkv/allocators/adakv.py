"""AdaKV (Feng et al., 2024, arXiv 2407.11550): one layer-wide top-k over the scores of every KV head decides how
many entries each head keeps; heads whose scores are concentrated give budget to heads whose scores are spread."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from criticalkv.scorers.base import LayerView


def _descending_order(tier: torch.Tensor, secondary: torch.Tensor) -> torch.Tensor:
    """Indices that sort the last axis by ``tier`` then ``secondary``, both descending; ties keep index order.

    Two stable sorts make a lexicographic sort without packing both keys into one float.
    """
    by_secondary = secondary.argsort(dim=-1, descending=True, stable=True)
    by_tier = tier.gather(-1, by_secondary).argsort(dim=-1, descending=True, stable=True)
    return by_secondary.gather(-1, by_tier)


def _ranks(order: torch.Tensor) -> torch.Tensor:
    """Inverse permutation of ``order`` along the last axis: the rank of every element (0 = first)."""
    ranks = torch.empty_like(order)
    arange = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    return ranks.scatter_(-1, order, arange)


@dataclass
class AdaKVAllocator:
    """Per row, the global top ``h_kv * B`` entries of the layer's pooled scores, after a per-head safeguard.

    For each row ``b`` with budget ``B`` (entries per head, protected ones included):

    1. every head first reserves its own ``n_safe = max(1, floor(safeguard * B))`` best entries;
    2. protected positions (e.g. SnapKV's window) come next, the most recent first: kvpress gives the window
       a score above every other score, so it always survives the global cut;
    3. the remaining picks are the best scores pooled over all heads of the layer;

    and head ``h`` gets as many entries as picks landed in it. The budgets of a row sum to ``h_kv * B``
    exactly, each head keeps at least ``n_safe`` entries and at most its real (non-padding) length; padding
    is never picked. With the top-k selector each head then keeps exactly the entries picked here.

    Parameters
    ----------
    safeguard
        Share of ``B`` every head keeps whatever its scores (kvpress's ``alpha_safeguard``, 0.2). The reserve
        is at least one entry, also with ``safeguard=0`` (kvpress then reserves none and can empty a head).

    Notes
    -----
    The scores of different heads are compared as they are, as in AdaKV and kvpress: a scorer whose scores
    are not on a common scale across heads (e.g. unnormalised key norms) makes the allocation meaningless.
    """

    safeguard: float = 0.2

    def __post_init__(self) -> None:
        if not 0.0 <= self.safeguard <= 1.0:
            raise ValueError(f"safeguard must be in [0, 1], got {self.safeguard}")

    def allocate(
        self,
        scores: torch.Tensor,
        row_budgets: torch.Tensor,
        view: LayerView,
        protected: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-head budgets (b, h_kv) long from scores (b, h_kv, t) and per-row budgets (b,).

        ``protected`` (b, t) bool marks positions the selector keeps first; they rank above every score.
        """
        b, h, t = scores.shape
        valid = view.valid  # (b, t)
        budgets = torch.minimum(row_budgets.long(), view.lengths)  # (b,)
        prot = torch.zeros_like(valid) if protected is None else protected & valid
        # Tiers (higher first): 2 safeguard, 1 protected, 0 other real entries, -1 padding. Within the protected
        # tier the most recent come first (the selector keeps those when the budget cannot hold the window).
        tier = torch.where(prot, 1, torch.where(valid, 0, -1))[:, None, :].expand(b, h, t)  # (b, h, t)
        position = torch.arange(t, device=scores.device, dtype=torch.float64)
        secondary = torch.where(prot[:, None, :], position, scores.double())  # (b, h, t)

        # 1. each head's safeguard: the first n_safe of the head's own order
        n_safe = torch.floor(budgets.double() * self.safeguard + 1e-9).long().clamp(min=1)
        n_safe = torch.minimum(n_safe, budgets)  # (b,)
        head_rank = _ranks(_descending_order(tier, secondary))  # (b, h, t)
        safe = (head_rank < n_safe[:, None, None]) & valid[:, None, :]
        tier = torch.where(safe, 2, tier)

        # 2.-3. the global order over the pooled heads; the first h * B entries are kept
        order = _descending_order(tier.reshape(b, h * t), secondary.reshape(b, h * t))  # (b, h*t)
        picked = _ranks(order) < (h * budgets)[:, None]  # (b, h*t)
        return picked.view(b, h, t).sum(-1)
