"""DefensiveKV's scorer (Feng et al., ICLR 2026, arXiv 2510.13334): the worst case over the observation window
instead of its mean, so that an entry one query needs badly is not averaged away.

Also the window statistics DefensiveKV's cumulative-mass stage 1 reads (``window_statistics``): each head's mean
attention on the context and the attention mass the window puts on its own positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from criticalkv.core.view import LayerView
from criticalkv.scorers.base import Scorer, last_positions, pool_along_keys, window_attention

#: Where the "window mass" subtracted from stage 1's target is measured (docs/method.md, DefensiveKV).
MASS_SLICES = ("intended", "reference")


@dataclass
class WindowStatistics:
    """What DefensiveKV's stage 1 needs from one layer's observation-window attention.

    ``mean_attention`` is the plain (unpooled) attention of the window queries on each context position, averaged
    over the window queries and the GQA group; zero on the window's own positions and on padding. The two window
    masses are per row, averaged over every query head of the layer and the window queries, as in the reference
    code: ``intended`` is the mass on the window's own ``w`` positions, ``reference`` the mass on the ``w``
    context positions just before the window (the reference code slices after dropping the window's columns).
    """

    mean_attention: torch.Tensor  # (b, h_kv, t) float32
    own_mass: torch.Tensor  # (b, h_kv, G, w) float32: each window query's mass on the window's own positions
    before_mass: torch.Tensor  # (b, h_kv, G, w) float32: ... on the w context positions just before the window

    @classmethod
    def of(cls, attention: torch.Tensor, window: int) -> WindowStatistics:
        """From the window attention (b, h_kv, G, w, t) of ``window_attention`` with ``w = window``."""
        b, h_kv, _, w, t = attention.shape
        n = t - w  # context positions
        mean = attention.new_zeros(b, h_kv, t)
        mean[..., :n] = attention[..., :n].mean(dim=(2, 3))
        return cls(mean, attention[..., n:].sum(-1), attention[..., max(n - w, 0) : n].sum(-1))

    @property
    def window_mass_intended(self) -> torch.Tensor:
        """(b,) the mass on the window's own positions, averaged over the layer's query heads and window queries."""
        return self.own_mass.mean(dim=(1, 2, 3))

    @property
    def window_mass_reference(self) -> torch.Tensor:
        """(b,) the mass on the ``w`` context positions before the window, averaged likewise."""
        return self.before_mass.mean(dim=(1, 2, 3))

    def window_mass(self, mass_slice: str) -> torch.Tensor:
        """The window mass (b,) measured on ``"intended"`` or ``"reference"`` columns."""
        if mass_slice not in MASS_SLICES:
            raise ValueError(f"mass_slice must be one of {MASS_SLICES}, got {mass_slice!r}")
        return self.window_mass_intended if mass_slice == "intended" else self.window_mass_reference


def window_statistics(view: LayerView, window: int) -> WindowStatistics:
    """The layer's ``WindowStatistics`` for a ``window``-query observation window, computed once per view."""
    w = min(window, view.keys.shape[2])
    return view.remember(("defensive_window", w), lambda: WindowStatistics.of(window_attention(view, w), w))


@dataclass
class DefensiveScorer(Scorer):
    """Observation-window attention, pooled without losing mass, then the maximum over the window and the GQA
    group, floored at the head's mean.

    For each query row of the window (each query head of the group, each of the last ``w`` positions): its
    softmax attention on the context (the window's own columns dropped) is smoothed along the keys by an average
    pool (kernel ``kernel``, stride 1, zero padding), then rescaled so that the row's mass on the context is what
    it was before pooling. An entry's score is the maximum of these rows over the window queries and the G query
    heads of its KV head, and at least the mean of that maximum over the head's context positions:
    ``s_i = max(m_i, mean_j m_j)``. The window's own positions are protected (kept, counted in the budget).

    Parameters
    ----------
    window
        Number of last prompt tokens whose queries vote (32, the reference code's value).
    kernel
        Width of the average pool along the keys (5).

    Notes
    -----
    Computed in float32 (the reference casts the softmax back to the model dtype); per row, so padding columns
    neither count in the pooled mass nor in the head mean (the reference handles batch size 1 only).
    """

    non_negative: ClassVar[bool] = True  # attention probabilities, pooled, rescaled by masses and maxima (Scorer)

    window: int = 32
    kernel: int = 5

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel must be a positive odd number, got {self.kernel}")

    def score(self, view: LayerView) -> torch.Tensor:
        b, h_kv, t, _ = view.keys.shape
        w = min(self.window, t)
        n = t - w
        attention = window_attention(view, w)  # (b, h_kv, G, w, t)
        view.remember(("defensive_window", w), lambda: WindowStatistics.of(attention, w))  # for stage 1
        context = attention[..., :n]  # (b, h_kv, G, w, n)
        valid = view.valid[:, :n]  # (b, n)
        if n > 0:
            mass = context.sum(-1, keepdim=True)  # (b, h_kv, G, w, 1): each query row's mass on the context
            context = pool_along_keys(context, self.kernel).masked_fill_(~valid[:, None, None, None, :], 0.0)
            pooled_mass = context.sum(-1, keepdim=True)
            context.mul_(torch.where(pooled_mass > 0, mass / pooled_mass, torch.zeros_like(mass)))
        peak = context.amax(dim=(2, 3))  # (b, h_kv, n): worst case over the group's heads and the window
        counted = valid.sum(-1).clamp(min=1)[:, None, None]  # (b, 1, 1)
        floor = peak.masked_fill(~valid[:, None, :], 0.0).sum(-1, keepdim=True) / counted  # (b, h_kv, 1)
        scores = torch.maximum(peak, floor)
        # The window's own positions are protected; give them the row maximum so the scores stay readable.
        top = scores.amax(dim=-1, keepdim=True) if n > 0 else scores.new_zeros(b, h_kv, 1)
        return torch.cat([scores, top.expand(b, h_kv, w)], dim=-1)

    def protected(self, view: LayerView) -> torch.Tensor:
        return last_positions(view, self.window)
