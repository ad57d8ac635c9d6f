"""AdaKV (Feng et al., 2024, arXiv 2407.11550): one layer-wide top-k over the scores of every KV head decides how
many entries each head keeps; heads whose scores are concentrated give budget to heads whose scores are spread."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from criticalkv.allocators.balance import cap_rank_imbalance
from criticalkv.allocators.base import Allocator
from criticalkv.core.heads import every_head, head_shard
from criticalkv.core.view import LayerView, padding_or_protected


@dataclass
class AdaKVAllocator(Allocator):
    """Per row, the global top ``h_kv * B`` entries of the layer's pooled scores, after a per-head safeguard.

    For each row ``b`` with budget ``B`` (entries per head, protected ones included):

    1. every head first reserves its own ``n_safe = max(1, floor(safeguard * B))`` best entries, its protected
       positions (e.g. SnapKV's window, the most recent first) ranking first among them, as in kvpress, where the
       window carries the highest score; with ``safeguard_beside_window`` the reserve is the protected positions
       and ``n_safe`` best others beside them (at most ``B`` in all);
    2. the protected positions not reserved come next: kvpress gives the window a score above every other
       score, so it always survives the global cut;
    3. the remaining picks are the best scores pooled over all heads of the layer;

    and head ``h`` gets as many entries as picks landed in it. The budgets of a row sum to ``h_kv * B``
    exactly, each head keeps at least ``n_safe`` entries and at most its real (non-padding) length; padding
    is never picked. With the top-k selector each head then keeps exactly the entries picked here.

    Parameters
    ----------
    safeguard
        Share of ``B`` every head keeps whatever its scores (kvpress's ``alpha_safeguard``, 0.2). The reserve
        is at least one entry, also with ``safeguard=0`` (kvpress then reserves none and can empty a head).
    max_rank_imbalance
        Under tensor parallelism, no rank holds more than ``1 + max_rank_imbalance`` times the mean rank's
        entries of a layer (``criticalkv.distributed.cap_rank_imbalance``); None (default) leaves AdaKV's
        budgets as they are. No effect on one process.
    safeguard_beside_window
        False (kvpress 0.5's ``AdaKVPress``): the window counts toward the safeguard, so every head starts from
        ``max(n_safe, P)`` entries (P protected). True (the AdaKV authors' code, DefensiveKV's
        ``EfficientAdaSnapKVPress``): the ``n_safe`` best entries outside the window are reserved on top of it,
        every head starts from ``min(P + n_safe, B)``. The budgets differ only for heads that win fewer than
        ``P + n_safe`` entries with kvpress's rule (starved heads; at small budgets the window alone can exceed
        ``n_safe``, and then kvpress's safeguard reserves nothing beyond it).

    Notes
    -----
    The scores of different heads are compared as they are, as in AdaKV and kvpress: a scorer whose scores
    are not on a common scale across heads (e.g. unnormalised key norms) makes the allocation meaningless.
    Equal scores are ordered arbitrarily (``torch.topk``). The window is the same set of positions in every
    head, which is what lets the safeguard and the window be counted in closed form: only the safeguard
    entries outside the window and the pooled contest need a top-k (no sort of the whole layer).

    Under tensor parallelism each rank holds a block of the heads: the scores of every head are gathered (one
    ``all_gather`` per layer) and every rank runs this same allocation on the same tensor, so the ranks agree
    with each other and with one process (ties fall the same way), and each keeps its own heads' budgets.
    """

    safeguard: float = 0.2
    max_rank_imbalance: float | None = None
    safeguard_beside_window: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.safeguard <= 1.0:
            raise ValueError(f"safeguard must be in [0, 1], got {self.safeguard}")
        if self.max_rank_imbalance is not None and not self.max_rank_imbalance >= 0:
            raise ValueError(f"max_rank_imbalance must be >= 0 or None, got {self.max_rank_imbalance}")

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
        shard = head_shard(view)
        if shard is None:
            return self._allocate(scores, row_budgets, view, protected)
        every = every_head(view, scores)  # (b, h_kv, t): every rank's heads, in the model's order
        budgets = self._allocate(every, row_budgets, view, protected)  # (b, h_kv)
        if self.max_rank_imbalance is not None:
            budgets = cap_rank_imbalance(budgets, every, view.valid, protected, shard.size, self.max_rank_imbalance)
        return shard.local(budgets)

    def _allocate(
        self, scores: torch.Tensor, row_budgets: torch.Tensor, view: LayerView, protected: torch.Tensor | None
    ) -> torch.Tensor:
        """The allocation over every head in ``scores`` (b, h, t): (b, h) long."""
        b, h, t = scores.shape
        key = ("adakv counts", self.safeguard, self.safeguard_beside_window, h)
        counts = view.remember_for_tensors(
            key, (row_budgets, protected), lambda: self._counts(row_budgets, view, protected, h)
        )
        budgets, n_prot, base, extra_safe, pooled, k_safe, k_pooled, outside = counts
        others = scores.float().masked_fill(outside, float("-inf"))  # (b, h, t)
        if k_safe > 0:  # those safeguard entries are taken already: out of the pooled contest
            top = others.topk(k_safe, dim=-1).indices  # (b, h, k_safe)
            taken = torch.arange(k_safe, device=scores.device)[None, None, :] < extra_safe[:, None, None]
            others = others.scatter(-1, top, others.gather(-1, top).masked_fill(taken, float("-inf")))
        won = torch.zeros(b, h, dtype=torch.long, device=scores.device)
        if k_pooled > 0:
            winners = others.reshape(b, h * t).topk(k_pooled, dim=-1).indices  # (b, k_pooled), best first
            counts = (torch.arange(k_pooled, device=scores.device)[None, :] < pooled[:, None]).long()
            won.scatter_add_(1, winners // t, counts)
        # A window of at least B entries: every head keeps its B most recent window entries (the global order
        # walks the window position by position through all heads, so the cut falls on a whole position).
        return torch.where((n_prot >= budgets)[:, None], budgets[:, None], base[:, None] + won)

    def _counts(self, row_budgets: torch.Tensor, view: LayerView, protected: torch.Tensor | None, h: int) -> tuple:
        """What the allocation of a row takes from its budget and protected positions alone, the same in every layer
        of a forward (computed once per forward, its two top-k widths in one host read): B, P, each head's start
        and safeguard entries outside the window (b,) long, the pooled contest's size (b,) long, the two widths,
        and the positions out of the contest (b, 1, t) bool (padding, protected)."""
        valid = view.valid  # (b, t)
        budgets = torch.minimum(row_budgets.long(), view.lengths)  # B: (b,)
        prot = torch.zeros_like(valid) if protected is None else protected & valid
        n_prot = prot.sum(-1)  # P: (b,), the same positions in every head
        n_safe = torch.floor(budgets.double() * self.safeguard + 1e-9).long().clamp(min=1)
        n_safe = torch.minimum(n_safe, budgets)  # (b,)
        if self.safeguard_beside_window:  # the window, then the n_safe best others: min(P + n_safe, B) per head
            extra_safe = torch.minimum(n_safe, (budgets - n_prot).clamp(min=0))
            base = n_prot + extra_safe
        else:
            # Each head's own order starts with the window (most recent first), so its safeguard is the n_safe most
            # recent protected positions, plus its best other entries when the window is smaller than n_safe.
            # Safeguard and window together give every head max(n_safe, P) entries before the global cut.
            base = torch.maximum(n_safe, n_prot)  # (b,)
            extra_safe = (n_safe - n_prot).clamp(min=0)  # safeguard entries outside the window, per head
        # The pooled contest: the rest of the row's h * B entries go to the best remaining scores of any head.
        pooled = (h * (budgets - base)).clamp(min=0)  # (b,)
        k_safe, k_pooled = torch.stack([extra_safe.max(), pooled.max()]).tolist()  # one host read for both widths
        return budgets, n_prot, base, extra_safe, pooled, k_safe, k_pooled, padding_or_protected(view, protected)
