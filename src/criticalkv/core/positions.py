"""Position ids of a left-padded batch."""

from __future__ import annotations

import torch


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids (b, t) long from an attention mask (b, t): each real token's index among its row's real tokens,
    0 on the left padding. A forward over the last ``n`` tokens after a cache takes the last ``n`` columns."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)
