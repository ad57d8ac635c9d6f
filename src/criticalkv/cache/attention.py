"""Attention over compressed layers, registered in transformers' attention-function registry.

Dense (not yet compressed) layers go to the model's own attention implementation with transformers' mask,
so an uncompressed run is exactly the model's run. Compressed layers attend over their variable-length
segments through ``compressed_attention``: flash-attn's varlen kernel, one SDPA call over equal-length
segments or one padded SDPA call over all segments (``fused_attention``), or segment by segment over views of
the stored entries (``segment_attention``); ``fused_attention.choose_path`` says which, and
``$CRITICALKV_ATTENTION`` forces one.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from criticalkv.cache import fused_attention
from criticalkv.cache.compressed_layer import CompressedLayer, as_bool_mask
from criticalkv.cache.fused_attention import (
    choose_path,
    flash_varlen_attention,
    padded_attention,
    uniform_attention,
)
from criticalkv.errors import CriticalKVError
from criticalkv.logits import attention_sinks, logit_softcap, soft_cap_, softmax_with_sinks_

__all__ = [
    "MASKS",
    "as_bool_mask",
    "base_attention",
    "compressed_attention",
    "criticalkv_attention",
    "register",
    "segment_attention",
]

BASE_IMPLEMENTATIONS = ("sdpa", "eager")
MASKS = {"sdpa": sdpa_mask, "eager": eager_mask}


#: Attention inputs some models pass beyond the mask and scaling (softcapping, attention sinks, a position bias).
_EXTRA_ATTENTION_INPUTS = ("softcap", "s_aux", "sinks", "position_bias")


def implementation_name(base: str) -> str:
    """The registry name under which criticalkv wraps a base implementation (``criticalkv_sdpa``, ...)."""
    return f"criticalkv_{base}"


def segment_attention(
    query: torch.Tensor,
    layer: CompressedLayer,
    tail_keys: torch.Tensor,
    tail_values: torch.Tensor,
    tail_mask: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a compressed layer, segment by segment, over views of its stored entries (in float32: no copy).

    query (b, h_q, q, d); tail_keys, tail_values (b, h_kv, tail, d); tail_mask (b, 1, q, tail) bool, True where
    a query may read a tail entry (every query reads the whole context). Returns (b, q, h_q, d), the layout
    transformers' attention functions return. The G query heads of a KV head are folded into the query axis, so
    keys are never repeated. Each segment's logits come from its slice of the flat context and its tail; softmax
    and products run in float32 (as SDPA accumulates; float64 for float64 inputs), blocks of query rows bounding
    the logits to ``fused_attention.LOGIT_BLOCK_ELEMENTS``. A query that reads nothing gets zeros, as from SDPA.
    ``softcap`` (Gemma 2) caps the logits before the masks; ``sinks`` (gpt-oss, (h_q,)) take their share of each
    softmax (``criticalkv.logits``).
    """
    b, h_q, q, d = query.shape
    h_kv = layer.lengths.shape[1]
    g, tail, segments = h_q // h_kv, tail_keys.shape[2], b * h_kv
    exact = torch.promote_types(query.dtype, torch.float32)  # float32, or float64 for float64 inputs
    folded = query.reshape(segments, g * q, d).to(exact) * scaling  # (S, G*q, d): a KV head's query heads adjacent
    tail_k = tail_keys.reshape(segments, tail, d).to(exact)
    tail_v = tail_values.reshape(segments, tail, d).to(exact)
    readable = None  # (b, G*q, tail) bool where some query may not read some tail entry
    if not bool(tail_mask.all()):
        readable = tail_mask[:, 0, None].expand(b, g, q, tail).reshape(b, g * q, tail)

    # (S, G*q, 1): each folded row's sink logit, its query head's
    row_sinks = None if sinks is None else sinks.to(exact).view(h_kv, g, 1).repeat(b, 1, q).view(segments, g * q, 1)

    every_tail = None  # (S, G*q, tail): every tail's logits at once, when small (a decode step)
    if segments * g * q * tail <= fused_attention.LOGIT_BLOCK_ELEMENTS:
        every_tail = soft_cap_(torch.bmm(folded, tail_k.transpose(1, 2)), softcap)
        if readable is not None:
            every_tail = every_tail.view(b, h_kv, g * q, tail).masked_fill_(~readable[:, None], float("-inf"))
        every_tail = every_tail.view(segments, g * q, tail)

    def tail_logits(segment: int, rows: slice) -> torch.Tensor:  # (r, tail)
        if every_tail is not None:
            return every_tail[segment, rows]
        logits = soft_cap_(folded[segment, rows] @ tail_k[segment].T, softcap)
        return logits if readable is None else logits.masked_fill_(~readable[segment // h_kv, rows], float("-inf"))

    offsets = layer.offsets().tolist()
    context_keys, context_values = layer.context_keys, layer.context_values
    out = folded.new_empty(segments, g * q, d)
    for segment in range(segments):
        start, end = offsets[segment], offsets[segment + 1]
        keys = context_keys[start:end].to(exact)  # (n, d): a view in that dtype, a copy otherwise
        values = context_values[start:end].to(exact)
        step = max(1, fused_attention.LOGIT_BLOCK_ELEMENTS // max(end - start + tail, 1))
        for row in range(0, g * q, step):
            rows = slice(row, row + step)
            context_logits = soft_cap_(folded[segment, rows] @ keys.T, softcap)
            logits = torch.cat([context_logits, tail_logits(segment, rows)], dim=1)  # (r, n + tail)
            if row_sinks is None:
                weights = torch.softmax(logits, dim=-1)
            else:
                weights = softmax_with_sinks_(logits, row_sinks[segment, rows])
            if end == start:  # without context a query may read nothing: zeros, not NaN
                weights = weights.nan_to_num(0.0)
            context_weights, tail_weights = weights[:, : end - start], weights[:, end - start :]
            out[segment, rows] = context_weights @ values + tail_weights @ tail_v[segment]
    return out.to(query.dtype).view(b, h_q, q, d).transpose(1, 2)


def compressed_attention(
    query: torch.Tensor,
    layer: CompressedLayer,
    tail_keys: torch.Tensor,
    tail_values: torch.Tensor,
    tail_mask: torch.Tensor,
    scaling: float,
    path: str | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a compressed layer by the path ``choose_path`` picks (or ``path``: ``auto``, ``flash``,
    ``uniform``, ``padded``, ``segments``); shapes as in ``segment_attention``. Every path computes the same
    attention, with the model's soft cap (Gemma 2) and sinks (gpt-oss, (h_q,)) where it has them: the uniform and
    padded paths then write SDPA's products out in float32, and ``flash`` is not taken."""
    extras = softcap is not None or sinks is not None
    if sinks is not None and sinks.numel() != query.shape[1]:
        raise CriticalKVError(f"{sinks.numel()} attention sinks for {query.shape[1]} query heads")
    chosen = choose_path(query, layer, tail_mask, tail_keys.shape[2], path, logits_transformed=extras)
    if chosen == "flash":
        return flash_varlen_attention(query, layer, tail_keys, tail_values, scaling)
    if chosen == "uniform":
        return uniform_attention(query, layer, tail_keys, tail_values, tail_mask, scaling, softcap, sinks)
    if chosen == "padded":
        return padded_attention(query, layer, tail_keys, tail_values, tail_mask, scaling, softcap, sinks)
    return segment_attention(query, layer, tail_keys, tail_values, tail_mask, scaling, softcap, sinks)


def base_attention(module: nn.Module, base: str):
    """transformers' attention function ``base`` (sdpa, eager) for ``module``."""
    if base == "eager":  # each modeling file defines its own eager function (softcapping, sinks, ...)
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[base]


def check_logit_inputs(module: nn.Module, kwargs: dict) -> tuple[float | None, torch.Tensor | None]:
    """The module's soft cap and sinks as ``criticalkv.logits`` reads them, after refusing a call whose soft cap or
    sinks are not those: criticalkv's scorers and compressed attention would compute another attention than the
    model's."""
    softcap, sinks = logit_softcap(module), attention_sinks(module)
    passed_cap = kwargs.get("softcap")
    passed_sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    if (passed_cap is None) != (softcap is None) or (passed_sinks is None) != (sinks is None):
        raise CriticalKVError(
            f"{type(module).__name__} passes its attention function a soft cap or attention sinks that criticalkv "
            "does not apply to it: its scores and compressed attention would not be the model's"
        )
    return softcap, sinks


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
    if layer is not None:
        softcap, sinks = check_logit_inputs(module, kwargs)
    if layer is not None and layer.is_compressed:
        if dropout:
            raise CriticalKVError(
                f"attention dropout ({dropout}) is on (the model is in train mode) and criticalkv's compressed "
                "attention does not apply it: call model.eval() before generating"
            )
        mask = layer.tail_mask(attention_mask, query.shape[2])
        out = compressed_attention(query, layer, key, value, mask, scaling, softcap=softcap, sinks=sinks)
        weights = None
    else:
        base = base_attention(module, compressor.base_implementation)

        def run_base() -> tuple[torch.Tensor, torch.Tensor | None]:
            return base(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)

        probe = compressor.attention_probe
        if layer is not None and probe is not None:  # collection mode: the output as the model's own
            # the probe's own SDPA call takes the mask and scaling only: anything more goes to the model's function
            plain = not dropout and all(kwargs.get(name) is None for name in _EXTRA_ATTENTION_INPUTS)
            sdpa = compressor.base_implementation == "sdpa" and plain
            out, weights = probe.attend(module, query, key, value, attention_mask, scaling, run_base, sdpa)
        else:
            out, weights = run_base()
    rolling = compressor.rolling  # compressing again after each chunk / every N tokens (runtime.rolling)
    new_prompt = layer is not None and layer.fresh
    if new_prompt and not (rolling is not None and rolling.holding):  # held: the chunk's guide compresses it
        compressor.compress_layer(module, query, key, value, attention_mask, scaling, layer)
    if layer is not None and rolling is not None:
        rolling.observe(compressor, module, query, attention_mask, scaling, layer, new_prompt)
    return out, weights


def register() -> None:
    """Register ``criticalkv_sdpa`` and ``criticalkv_eager`` (idempotent). Nothing of transformers is patched."""
    for base in BASE_IMPLEMENTATIONS:
        AttentionInterface.register(implementation_name(base), criticalkv_attention)
        AttentionMaskInterface.register(implementation_name(base), MASKS[base])
