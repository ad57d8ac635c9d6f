"""Top-k: keep the highest-scored entries (SnapKV, H2O, TOVA, ... all select this way)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from criticalkv.scorers.base import LayerView
from criticalkv.selectors.base import keep_protected, take_top


@dataclass
class TopKSelector:
    """Protected entries first, then the best scores until each head's budget is full."""

    def select(
        self, scores: torch.Tensor, budgets: torch.Tensor, protected: torch.Tensor, view: LayerView
    ) -> torch.Tensor:
        keep = keep_protected(protected, budgets)
        return take_top(scores, keep, view.valid, budgets - keep.sum(-1))
