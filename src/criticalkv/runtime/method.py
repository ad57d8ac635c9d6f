"""A method = scorer + allocator + selector (design.md). Presets are named combinations."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from criticalkv.allocators import Allocator, UniformAllocator
from criticalkv.budget import Budget
from criticalkv.scorers import LayerView, Scorer
from criticalkv.selectors import Selector, TopKSelector


@dataclass
class Decision:
    """What a method decided for one layer."""

    keep: torch.Tensor | None  # (b, h_kv, t) bool, or None when every row is kept whole
    budgets: torch.Tensor  # (b, h_kv) long: entries kept per head
    kept_whole: torch.Tensor  # (b,) bool: rows too short to compress (shorter than the budget or the window)


@dataclass
class Method:
    """An eviction method as three independent choices.

    Examples
    --------
    >>> Method(SnapKVScorer(window=64), UniformAllocator(), CriticalSelector(alpha=0.25))  # doctest: +SKIP
    """

    scorer: Scorer
    allocator: Allocator = field(default_factory=UniformAllocator)
    selector: Selector = field(default_factory=TopKSelector)
    name: str = "custom"

    def decide(self, view: LayerView, budget: Budget) -> Decision:
        lengths = view.lengths  # (b,)
        row_budgets = budget.entries_for(lengths)  # (b,)
        protected = self.scorer.protected(view)  # (b, t)
        kept_whole = (row_budgets >= lengths) | (protected.sum(-1) >= lengths)
        h_kv = view.keys.shape[1]
        if bool(kept_whole.all()):
            return Decision(None, lengths[:, None].expand(-1, h_kv).clone(), kept_whole)
        scores = view.remember(("scores", repr(self.scorer)), lambda: self.scorer.score(view))
        scores = scores.clone()  # (b, h_kv, t), shared with other methods deciding on this view
        budgets = self.allocator.allocate(scores, row_budgets, view, protected)  # (b, h_kv)
        keep = self.selector.select(scores, budgets, protected, view)
        keep[kept_whole] = view.valid[kept_whole][:, None, :].expand(-1, h_kv, -1)
        budgets[kept_whole] = lengths[kept_whole][:, None]
        return Decision(keep, budgets, kept_whole)
