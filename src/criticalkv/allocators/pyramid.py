"""PyramidKV (Cai et al., 2024, arXiv 2406.02069): lower layers spread their attention over the whole prompt and
need more entries, upper layers attend to a few and need fewer, so layer budgets decrease linearly with depth."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from criticalkv.allocators.base import Allocator
from criticalkv.core.view import LayerView
from criticalkv.models.families import compressed_layer_position


def largest_remainder(shares: torch.Tensor, totals: torch.Tensor) -> torch.Tensor:
    """Round non-negative ``shares`` (b, n) to integers summing to ``totals`` (b,) along the last axis.

    Each share is floored, then the units still missing go to the largest fractional parts (ties: lower index
    first). Requires ``sum(floor(shares)) <= totals <= sum(ceil(shares))`` per row, which holds when the shares
    sum to ``totals``; a share never moves by a whole unit, so an integer cap on the shares still holds.
    """
    floors = torch.floor(shares + 1e-9)
    fraction = (shares - floors).clamp(min=0)
    missing = (totals.double() - floors.sum(-1)).round().long()  # (b,)
    order = fraction.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(
        -1, order, torch.arange(shares.shape[-1], device=shares.device).expand_as(order)
    )
    return floors.long() + (rank < missing[:, None]).long()


def pyramid_budgets(
    row_budgets: torch.Tensor, lengths: torch.Tensor, n_protected: torch.Tensor, layers: int, beta: float
) -> torch.Tensor:
    """Budgets (b, layers) long of every layer, per row; each row's mean over layers is exactly its budget.

    The pyramid applies to the entries beyond the protected ones (``E = B - P``), as in the PyramidKV code where
    the observation window is added on top of the layer's capacity: the deepest layer keeps ``P + E / beta``,
    the first ``P + 2E - E / beta`` (capped at the row length, the excess moving to the upper layers), linear in
    between, then rounded by largest remainder so that the layers sum to ``layers * B``.
    """
    budgets = torch.minimum(row_budgets.long(), lengths.long()).double()  # (b,)
    window = torch.minimum(n_protected.double(), budgets)  # P, at most B
    extra = budgets - window  # E
    room = lengths.double() - window  # most entries a layer can add on top of P
    low = extra / beta
    high = 2 * extra - low
    capped = high > room
    high = torch.where(capped, room, high)
    low = torch.where(capped, 2 * extra - room, low)
    depth = torch.arange(layers, dtype=torch.float64, device=budgets.device)
    step = (high - low) / max(layers - 1, 1)  # (b,)
    shares = high[:, None] - depth[None, :] * step[:, None] if layers > 1 else extra[:, None]
    rounded = largest_remainder(shares.clamp(min=0), extra * layers)
    return window.long()[:, None] + rounded


@dataclass
class PyramidAllocator(Allocator):
    """Layer budgets decreasing linearly with depth (PyramidKV); every head of a layer gets the layer's budget.

    For a row with budget ``B`` (protected entries included), ``P`` protected entries and ``L`` compressed
    layers, the entries beyond the window, ``E = B - P``, follow kvpress's (and KVCache-Factory's) pyramid:
    ``min = E / beta``, ``max = 2E - min`` (if ``max`` exceeds the room ``n - P`` of an ``n``-token row, it is
    capped there and ``min = 2E - max``), layer ``l`` gets ``P + max - l (max - min) / (L - 1)``. The mean over
    layers is exactly ``B`` (largest-remainder rounding across layers) and each budget lies in ``[P, n]``.

    Differences from kvpress 0.5.5, on purpose: kvpress applies the pyramid to the whole budget including its
    window and falls back to uniform SnapKV whenever ``min < window`` (e.g. any 4k prompt at 25% with a 64-token
    window), and rounds each layer on its own, so its mean drifts from ``B``. Applying the pyramid to the entries
    beyond the window, as the PyramidKV code does, keeps the window in every layer and the pyramid shape at
    every budget.

    Parameters
    ----------
    beta
        Steepness: the deepest layer keeps ``1 / beta`` of the mean extra budget (20 in PyramidKV and kvpress;
        1 is uniform).
    """

    beta: float = 20

    def __post_init__(self) -> None:
        if not self.beta >= 1:
            raise ValueError(f"beta must be >= 1, got {self.beta}")

    def allocate(
        self,
        scores: torch.Tensor,
        row_budgets: torch.Tensor,
        view: LayerView,
        protected: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-head budgets (b, h_kv) long: this layer's pyramid budget for every head of a row."""
        b, h, _ = scores.shape
        position, layers = compressed_layer_position(view.module)
        lengths = view.lengths
        n_protected = (protected & view.valid).sum(-1) if protected is not None else torch.zeros_like(lengths)
        layer_budgets = pyramid_budgets(row_budgets, lengths, n_protected, layers, float(self.beta))
        return layer_budgets[:, position, None].expand(b, h).clone()
