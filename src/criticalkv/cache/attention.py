"""Attention over compressed layers, registered in transformers' attention-function registry.

Dense (not yet compressed) layers go to the model's own attention implementation with transformers' mask,
so an uncompressed run is exactly the model's run. Compressed layers use one ``scaled_dot_product_attention``
call per layer with a per-(batch, KV head) mask and no repetition of the keys for GQA.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from criticalkv.cache.compressed_layer import as_bool_mask
from criticalkv.errors import CriticalKVError

__all__ = ["as_bool_mask", "criticalkv_attention", "masked_attention", "register"]

BASE_IMPLEMENTATIONS = ("sdpa", "eager")
MASKS = {"sdpa": sdpa_mask, "eager": eager_mask}


def implementation_name(base: str) -> str:
    """The registry name under which criticalkv wraps a base implementation (``criticalkv_sdpa``, ...)."""
    return f"criticalkv_{base}"


def masked_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Grouped-query attention with a per-KV-head mask.

    query (b, h_q, q, d); keys, values (b, h_kv, n, d); mask (b, h_kv, q, n) bool. Returns (b, q, h_q, d),
    the layout transformers' attention functions return. The G query heads of a KV head are folded into the
    query axis, so keys are never repeated.
    """
    b, h_q, q, d = query.shape
    h_kv, n = keys.shape[1], keys.shape[2]
    g = h_q // h_kv
    folded = query.reshape(b, h_kv, g * q, d)
    folded_mask = mask[:, :, None].expand(b, h_kv, g, q, n).reshape(b, h_kv, g * q, n)
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=folded_mask, scale=scaling)
    return out.view(b, h_q, q, -1).transpose(1, 2)


def _base_attention(module: nn.Module, base: str):
    if base == "eager":  # each modeling file defines its own eager function (softcapping, sinks, ...)
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[base]


def criticalkv_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    compressor = module.__dict__.get("_criticalkv")
    if compressor is None:
        raise CriticalKVError("criticalkv attention runs only on a model prepared by criticalkv.compress")
    scaling = module.scaling if scaling is None else scaling
    layer = compressor.layer_for(module.layer_idx)
    if layer is not None and layer.is_compressed:
        mask = layer.physical_mask(attention_mask, query.shape[2])
        out, weights = masked_attention(query, key, value, mask, scaling), None
    else:
        base = _base_attention(module, compressor.base_implementation)
        out, weights = base(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if layer is not None and layer.fresh:
        compressor.compress_layer(module, query, key, value, attention_mask, scaling, layer)
    return out, weights


def register() -> None:
    """Register ``criticalkv_sdpa`` and ``criticalkv_eager`` (idempotent). Nothing of transformers is patched."""
    for base in BASE_IMPLEMENTATIONS:
        AttentionInterface.register(implementation_name(base), criticalkv_attention)
        AttentionMaskInterface.register(implementation_name(base), MASKS[base])
