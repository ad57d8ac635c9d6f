"""SnapKV (Li et al., 2024): attention of the last prompt tokens (the observation window) predicts which
entries later tokens will read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from criticalkv.core.view import LayerView
from criticalkv.scorers.base import Scorer, last_positions, pool_along_keys, window_attention

AGGREGATES = ("mean", "max")


def shared_window_attention(view: LayerView, window: int) -> torch.Tensor:
    """``window_attention(view, window)`` computed once per view: (b, h_kv, G, w, t) float32. Do not modify it."""
    w = min(window, view.keys.shape[2])
    return view.remember(("window_attention", w), lambda: window_attention(view, w))


def window_head_scores(view: LayerView, window: int, kernel: int, aggregate: str = "mean") -> torch.Tensor:
    """SnapKV's statistic per query head, before the GQA mean: (b, h_kv, G, t - w) float32.

    The window's attention over the context (its own columns dropped), reduced over the ``w`` window queries by
    ``aggregate`` (``"mean"``, SnapKV; ``"max"``, as DefensiveKV does) and smoothed along the keys by an average
    pool of width ``kernel`` (stride 1, same padding; 1 leaves it unpooled). Computed once per view and settings.
    """

    def compute() -> torch.Tensor:
        t = view.keys.shape[2]
        w = min(window, t)
        attn = shared_window_attention(view, w)[..., : t - w]  # (b, h_kv, G, w, t-w): drop the window's columns
        scores = attn.mean(dim=3) if aggregate == "mean" else attn.amax(dim=3)  # (b, h_kv, G, t-w)
        if t - w > 0 and kernel > 1:
            scores = pool_along_keys(scores, kernel)
        return scores

    if aggregate not in AGGREGATES:
        raise ValueError(f"aggregate must be one of {AGGREGATES}, got {aggregate!r}")
    return view.remember(("window_head_scores", window, kernel, aggregate), compute)


@dataclass
class SnapKVScorer(Scorer):
    """Observation-window attention, averaged over the window and the GQA group, smoothed along the keys.

    Parameters
    ----------
    window
        Number of last prompt tokens whose queries vote (32 in the paper's code, 64 in current kvpress).
        They are always kept and counted inside the budget.
    kernel
        Width of the average pool along the key axis (stride 1, same padding).
    aggregate
        How the window queries' attention is reduced per entry: ``"mean"`` (SnapKV, the paper) or ``"max"``
        (an ablation; DefensiveKV's choice).
    """

    non_negative: ClassVar[bool] = True  # attention probabilities, pooled and averaged (Scorer)

    window: int = 32
    kernel: int = 5
    aggregate: str = "mean"

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel must be a positive odd number, got {self.kernel}")
        if self.aggregate not in AGGREGATES:
            raise ValueError(f"aggregate must be one of {AGGREGATES}, got {self.aggregate!r}")

    def score(self, view: LayerView) -> torch.Tensor:
        b, h_kv, t, _ = view.keys.shape
        w = min(self.window, t)
        scores = window_head_scores(view, w, self.kernel, self.aggregate).mean(dim=2)  # (b, h_kv, t-w): GQA mean
        # The window's own positions are protected; give them the row maximum so the scores stay readable.
        top = scores.amax(dim=-1, keepdim=True) if t > w else scores.new_zeros(b, h_kv, 1)
        return torch.cat([scores, top.expand(b, h_kv, w)], dim=-1)

    def protected(self, view: LayerView) -> torch.Tensor:
        return last_positions(view, self.window)
