"""Uniform allocation: every KV head of a row keeps the same number of entries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from criticalkv.allocators.base import Allocator
from criticalkv.core.view import LayerView


@dataclass
class UniformAllocator(Allocator):
    """Each head gets its row's budget (SnapKV, StreamingLLM, ... and the paper's CriticalKV-SnapKV)."""

    # Every head keeps its row's budget: when the rows' budgets are equal, the runtime knows each head's count
    # without reading the device (``Decision.width``).
    row_budget_per_head: ClassVar[bool] = True

    def allocate(
        self, scores: torch.Tensor, row_budgets: torch.Tensor, view: LayerView, protected: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Per-head budgets (b, h_kv) long from per-row budgets (b,); scores (b, h_kv, t) are not needed.

        One tensor for every layer of a forward given the same ``row_budgets`` (a method's plan shares them), so a
        selector derives what depends on the budgets alone once per forward (``LayerView.remember_for_tensors``);
        read-only.
        """
        h_kv = scores.shape[1]

        def expand() -> torch.Tensor:
            return row_budgets[:, None].expand(-1, h_kv).clone()  # (b, h_kv)

        return view.remember_for_tensors(("uniform budgets", h_kv), (row_budgets,), expand, shared_result=True)
