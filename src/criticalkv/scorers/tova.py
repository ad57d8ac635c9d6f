"""TOVA (Oren et al., 2024): the last token's attention, averaged over the layer's heads, decides."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from criticalkv.core.heads import head_shard
from criticalkv.core.view import LayerView
from criticalkv.scorers.base import Scorer, last_positions, window_attention


@dataclass
class TOVAScorer(Scorer):
    """Attention of the last prompt token, mean over all query heads of the layer (one score per position,
    shared by every KV head, as in kvpress). The last token itself is always kept."""

    non_negative: ClassVar[bool] = True  # attention probabilities, averaged (Scorer)

    def score(self, view: LayerView) -> torch.Tensor:
        b, h_kv, t, _ = view.keys.shape
        attn = window_attention(view, 1)[:, :, :, 0, :]  # (b, h_kv, G, t)
        shard = head_shard(view)
        if shard is not None:  # tensor parallelism: the mean runs over every rank's heads (one all_gather)
            attn = shard.gather(attn)
        scores = attn.mean(dim=(1, 2))  # (b, t): mean over every query head of the layer
        return scores[:, None, :].expand(b, h_kv, t).clone()

    def protected(self, view: LayerView) -> torch.Tensor:
        return last_positions(view, 1)
