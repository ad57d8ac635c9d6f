"""The allocator contract."""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

import torch

from criticalkv.core.piece import Piece
from criticalkv.core.view import LayerView


@runtime_checkable
class Allocator(Piece, Protocol):
    """Splits a row's budget among the KV heads of a layer.

    ``allocate`` is the contract; the other members are optional capabilities with defaults, which an allocator
    inherits by deriving from ``Allocator`` and overrides where it differs (with ``window``, ``check_config`` and
    ``check_model`` of ``Piece``).

    Attributes
    ----------
    cross_layer
        True for one contest over every layer of a prefill (``allocate_layers``): the method is then deferred, its
        layers dense until the prefill ends. Default False.
    streaming
        True for an allocator that decides layer by layer with state carried between the layers of a prefill: the
        runtime passes ``allocate`` one scratch ``state`` dict per prefill as a fifth argument, and after each
        layer's selection calls ``settle``, whose shrink orders it applies to earlier layers. Default False.
    row_budget_per_head
        True when every head keeps its row's budget: the cache then gathers the kept entries without a host read.
        Default False.
    """

    cross_layer: ClassVar[bool] = False
    streaming: ClassVar[bool] = False
    row_budget_per_head: ClassVar[bool] = False

    def allocate(
        self, scores: torch.Tensor, row_budgets: torch.Tensor, view: LayerView, protected: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Per-head budgets (b, h_kv) long; they may differ per head but sum to h_kv * row_budgets[b].

        scores (b, h_kv, t) float32; row_budgets (b,) long; protected (b, t) bool, positions the selector keeps
        first (they count inside each head's budget).
        """
        ...

    def allocate_layers(
        self,
        scores: list[torch.Tensor],
        row_budgets: list[torch.Tensor],
        views: list[LayerView],
        protected: list[torch.Tensor],
    ) -> list[torch.Tensor]:
        """Per-head budgets (b, h_kv) long of every layer given, one list entry per layer (scores (b, h_kv, t),
        row_budgets (b,), protected (b, t)); called instead of ``allocate`` when ``cross_layer`` is True."""
        raise NotImplementedError(f"{type(self).__name__} allocates one layer at a time (cross_layer is False)")

    def settle(
        self, scores: torch.Tensor, keep: torch.Tensor, view: LayerView, protected: torch.Tensor | None, state: dict
    ) -> dict[int, torch.Tensor]:
        """After a layer's selection (keep (b, h_kv, t) bool), the shrink orders of earlier layers: model layer index
        -> (N,) bool mask over that layer's kept entries in storage order; called when ``streaming`` is True."""
        raise NotImplementedError(f"{type(self).__name__} carries no state between layers (streaming is False)")
