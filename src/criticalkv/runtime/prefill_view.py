"""The ``LayerView`` of a layer's prefill, as its attention function receives it, and the facts the layers of one
forward share (the padding mask's valid positions)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from criticalkv.cache import attention
from criticalkv.core.view import LayerView
from criticalkv.errors import PaddingError


@dataclass
class PrefillFacts:
    """The padding mask of one forward's layers and what is derived from it, shared by the layers that see the same
    mask. The runtime starts a new one with every forward. The mask is held by a weak reference (held, an 8k-token
    mask would outlive its forward): a mask freed since, whatever tensor now has its address, is another mask."""

    mask: weakref.ref | None = None  # None: no mask (every position valid)
    valid: torch.Tensor | None = None  # (b, t) bool
    shared: dict = field(default_factory=dict)  # LayerView.prefill

    def serve(self, attention_mask: torch.Tensor | None, keys: torch.Tensor) -> bool:
        """Whether these facts hold for a layer given ``attention_mask`` and keys (b, h_kv, t, d): the same mask,
        and valid positions of the keys' batch, length and device."""
        if self.valid is None or self.valid.shape != (keys.shape[0], keys.shape[2]) or self.valid.device != keys.device:
            return False
        if attention_mask is None or self.mask is None:
            return attention_mask is None and self.mask is None
        return self.mask() is attention_mask


def require_left_padding(valid: torch.Tensor) -> None:
    """Refuse a row with padding after a real token, valid (b, t) bool: scorers read a row's observation window
    (its last tokens) at the end of the tensor, and the last query's mask row is what tells the real keys."""
    late = valid[:, :-1] & ~valid[:, 1:]  # (b, t-1): a real position followed by padding
    if bool(late.any()):
        row = int(late.any(dim=-1).nonzero()[0])
        raise PaddingError(
            f"row {row} of the batch has padding after a real token; criticalkv needs left padding "
            "(tokenizer.padding_side = 'left')"
        )


def prefill_view(
    module: nn.Module,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    facts: PrefillFacts | None = None,
) -> LayerView:
    """The LayerView of a layer's prefill, as its attention function receives it.

    With ``facts`` (one per forward), layers that see the same mask share its valid positions and the facts
    derived from them (``LayerView.prefill``); a layer with another mask, length or device replaces them.
    """
    b, _, t, _ = keys.shape
    if facts is not None and facts.serve(attention_mask, keys):
        return LayerView(module, query, keys, values, facts.valid, scaling, prefill=facts.shared)
    if attention_mask is None:
        valid = torch.ones(b, t, dtype=torch.bool, device=keys.device)
    else:  # the last query sees every real key; padding columns are masked in its row; a copy, not a view, which
        # would keep the whole (b, 1, t, t) mask alive with the facts after the forward (b t^2 bytes: 32 MiB at 4k)
        valid = attention.as_bool_mask(attention_mask)[:, 0, -1, :t].clone()
        require_left_padding(valid)
    if facts is None:
        return LayerView(module, query, keys, values, valid, scaling)
    facts.mask = None if attention_mask is None else weakref.ref(attention_mask)
    facts.valid, facts.shared = valid, {}
    return LayerView(module, query, keys, values, valid, scaling, prefill=facts.shared)
