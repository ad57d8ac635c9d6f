"""StreamingLLM (Xiao et al., 2024): keep a few attention-sink tokens at the start and the most recent ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from criticalkv.core.view import LayerView
from criticalkv.scorers.base import Scorer


@dataclass
class StreamingScorer(Scorer):
    """Scores by recency; the first ``sinks`` real tokens of each row are always kept.

    Parameters
    ----------
    sinks
        Number of initial tokens kept as attention sinks (4, as in kvpress and the paper).
    """

    non_negative: ClassVar[bool] = True  # recency in (0, 1] (Scorer)

    sinks: int = 4

    def __post_init__(self) -> None:
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")

    def score(self, view: LayerView) -> torch.Tensor:
        b, h_kv, t, _ = view.keys.shape
        recency = torch.arange(1, t + 1, device=view.keys.device, dtype=torch.float32) / t  # (t,) in (0, 1]
        return recency.expand(b, h_kv, t).clone()

    def protected(self, view: LayerView) -> torch.Tensor:
        start = view.valid.shape[1] - view.lengths  # (b,) first real position under left padding
        pos = torch.arange(view.valid.shape[1], device=view.valid.device)
        return (pos[None, :] >= start[:, None]) & (pos[None, :] < start[:, None] + self.sinks)
