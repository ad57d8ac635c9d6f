"""The allocator contract."""

from __future__ import annotations

from typing import Protocol

import torch

from criticalkv.core.view import LayerView


class Allocator(Protocol):
    """Splits a row's budget among the KV heads of a layer."""

    def allocate(
        self, scores: torch.Tensor, row_budgets: torch.Tensor, view: LayerView, protected: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Per-head budgets (b, h_kv) long; they may differ per head but sum to h_kv * row_budgets[b].

        scores (b, h_kv, t) float32; row_budgets (b,) long; protected (b, t) bool, positions the selector keeps
        first (they count inside each head's budget).
        """
        ...
