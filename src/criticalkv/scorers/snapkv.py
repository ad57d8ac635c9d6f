"""SnapKV (Li et al., 2024): attention of the last prompt tokens (the observation window) predicts which
entries later tokens will read."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from criticalkv.scorers.base import LayerView, last_positions, window_attention


@dataclass
class SnapKVScorer:
    """Observation-window attention, averaged over the window and the GQA group, smoothed along the keys.

    Parameters
    ----------
    window
        Number of last prompt tokens whose queries vote (32 in the paper's code, 64 in current kvpress).
        They are always kept and counted inside the budget.
    kernel
        Width of the average pool along the key axis (stride 1, same padding).
    """

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
        attn = window_attention(view, w)[..., : t - w]  # (b, h_kv, G, w, t-w): drop the window's own columns
        scores = attn.mean(dim=3)  # (b, h_kv, G, t-w)
        if t - w > 0:
            flat = scores.reshape(-1, 1, t - w)
            flat = F.avg_pool1d(flat, self.kernel, stride=1, padding=self.kernel // 2)
            scores = flat.view(b, h_kv, -1, t - w)
        scores = scores.mean(dim=2)  # (b, h_kv, t-w): mean over the GQA group
        # The window's own positions are protected; give them the row maximum so the scores stay readable.
        top = scores.amax(dim=-1, keepdim=True) if t > w else scores.new_zeros(b, h_kv, 1)
        return torch.cat([scores, top.expand(b, h_kv, w)], dim=-1)

    def protected(self, view: LayerView) -> torch.Tensor:
        return last_positions(view, self.window)
