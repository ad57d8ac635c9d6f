"""Top-k: keep the highest-scored entries (SnapKV, H2O, TOVA, ... all select this way)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from criticalkv.core.view import LayerView
from criticalkv.selectors.base import Selector, add_top, keep_protected, largest, open_places


@dataclass
class TopKSelector(Selector):
    """Protected entries first, then the best scores until each head's budget is full."""

    def select(
        self, scores: torch.Tensor, budgets: torch.Tensor, protected: torch.Tensor, view: LayerView
    ) -> torch.Tensor:
        def start() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
            keep = keep_protected(protected, budgets)  # (b, h_kv, t)
            candidates, need = open_places(keep, view.valid, budgets - keep.sum(-1))  # (b, h_kv, t), (b, h_kv)
            return keep, candidates, need, int(largest(need))

        keep, candidates, need, k = view.remember_for_tensors("topk start", (budgets, protected), start)
        return add_top(scores, keep, candidates, need, k)
