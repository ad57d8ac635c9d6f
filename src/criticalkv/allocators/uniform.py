"""Uniform allocation: every KV head of a row keeps the same number of entries."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from criticalkv.scorers.base import LayerView


@dataclass
class UniformAllocator:
    """Each head gets its row's budget (SnapKV, StreamingLLM, ... and the paper's CriticalKV-SnapKV)."""

    def allocate(
        self, scores: torch.Tensor, row_budgets: torch.Tensor, view: LayerView, protected: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Per-head budgets (b, h_kv) long from per-row budgets (b,); scores (b, h_kv, t) are not needed."""
        return row_budgets[:, None].expand(-1, scores.shape[1]).clone()
