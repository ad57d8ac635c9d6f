"""Key norm (Devoto et al., 2024): entries with a small key norm tend to receive more attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from criticalkv.core.view import LayerView
from criticalkv.scorers.base import Scorer


@dataclass
class KeyNormScorer(Scorer):
    """Score = -||k||_2 (kvpress's sign). The scores are negative: the CriticalKV selector refuses them."""

    def score(self, view: LayerView) -> torch.Tensor:
        return -view.keys.float().norm(dim=-1)  # (b, h_kv, t)

    def protected(self, view: LayerView) -> torch.Tensor:
        return torch.zeros_like(view.valid)
