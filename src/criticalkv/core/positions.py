"""Position ids of a left-padded batch, and the forward over new tokens after a cache that uses them."""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.utils import ModelOutput


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids (b, t) long from an attention mask (b, t): each real token's index among its row's real tokens,
    0 on the left padding. A forward over the last ``n`` tokens after a cache takes the last ``n`` columns."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def forward_on_cache(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: Cache, **kwargs: object
) -> ModelOutput:
    """The model's forward over new tokens ``input_ids`` (b, q) after what ``cache`` holds, ``attention_mask``
    (b, seen + q) covering both, with the position ids the mask gives (left padding counts no position); the
    logits of the last position only. ``kwargs`` go to the forward (``output_hidden_states=True``)."""
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions_from_mask(attention_mask)[:, -input_ids.shape[1] :],
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
        **kwargs,
    )
