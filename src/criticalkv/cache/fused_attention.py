"""Attention over all segments of a compressed layer in one kernel call, and the rule that picks a path.

A compressed layer holds, per (row, KV head) segment, its own number of kept context entries (flat, back to
back) and a dense tail shared in length by every segment. Four paths compute the same attention:

* ``flash``: flash-attn's ``flash_attn_varlen_func``. Each segment is one variable-length sequence of its kept
  context followed by its tail, with one KV head and the G query heads of its group (flash-attn's own GQA), so
  keys are never repeated. ``cu_seqlens_k`` is ``CompressedLayer.offsets()`` shifted by the tail; flash-attn's
  bottom-right causal mask is exactly "every query reads the whole context and the tail up to itself".
* ``uniform``: every segment keeps the same count L (SnapKV, PyramidKV, StreamingLLM: any per-layer budget), so
  the flat context is already a (b, h_kv, L, d) tensor; it is viewed as one (no copy), the tail appended, and
  one ``scaled_dot_product_attention`` call runs with the G query heads folded into the query axis; no mask at a
  decode step (every query reads everything), the tail mask otherwise. The same work as a dense cache's decode.
* ``padded``: each segment's context gathered into a (b, h_kv, max_len + tail, d) tensor with a boolean mask,
  the G query heads folded into the query axis, one ``scaled_dot_product_attention`` call. Any device, any
  dtype, any tail mask (padded questions included).
* ``segments``: ``attention.segment_attention``, segment by segment over views of the stored entries (float32
  products and softmax); nothing copied or padded.

With Gemma 2's soft cap or gpt-oss's sinks, which SDPA does not take, ``uniform`` and ``padded`` write the same
products and softmax out (``explicit_attention``) and ``flash`` is never chosen (forcing it is refused).

``choose_path`` decides, in this order:

1. ``$CRITICALKV_ATTENTION`` (``auto``, ``flash``, ``uniform``, ``padded``, ``segments``) forces a path; a
   forced ``flash`` or ``uniform`` that cannot run raises ``CriticalKVError`` with the reason, never falls back.
2. ``flash`` when the query is on CUDA in float16/bfloat16, ``flash_attn`` imports, the head size is one
   flash-attn supports, and the tail mask is plain causal (no padded tail entries).
3. ``uniform`` when every segment holds the same number of context entries.
4. ``padded``: on CUDA, when the padded keys take at most ``CUDA_PADDED_MAX_BYTES``; on CPU, when the segments
   hold fewer than ``CPU_SEGMENT_ENTRIES`` stored entries on average (context and tail), the padded keys hold at
   most ``PADDING_FACTOR`` times the entries the layer stores, i.e. ``segments * (max_len + tail) <=
   PADDING_FACTOR * (kept + segments * tail)`` (the padding waste is ``segments * max_len - kept`` entries), and
   take at most ``CPU_PADDED_MAX_BYTES``.
5. ``segments`` otherwise: on CPU, segments long enough that reading them in place beats gathering them, budgets
   so uneven that padding would waste more than the factor allows, or a layer too large to pad; on CUDA, padded
   keys beyond the byte limit.

Why the CPU rule: the padded path gathers every stored entry into the padded tensor at every step (an
``index_select`` of d-wide rows, the bulk of its time), then attends; the per-segment loop reads each segment
where it lies but pays a dozen operator calls per segment. Measured on 2 x86 cores (one thread, float32, d = 64,
decoding one token, per-head counts spread 0.3-1.7x their mean), the loop took 0.11-0.5x the padded path's time
from 1000 entries per segment on (2 to 32 segments), about as long at 200, and 1.5-2.2x as long at 50 entries
with 3 or more segments.

Why no padding factor on CUDA: a GPU reads the padding at its memory bandwidth, while the per-segment loop
launches a few kernels per (row, KV head) in every layer at every step. On an H200 (Qwen2.5-0.5B's shape, random
weights, AdaKV and CriticalKV-AdaKV at budget 0.2, 8k tokens, docs/benchmarks.md) the loop decoded at 34-43 ms per
token at batch 1 and 68-72 ms at batch 4, the padded path at 31-33 ms at both (the loop of then, one SDPA call
over a copy of each segment; today's, with more operator calls per segment, is not timed on a GPU).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from criticalkv.cache.compressed_layer import CompressedLayer
from criticalkv.errors import CriticalKVError
from criticalkv.logits import soft_cap_, softmax_with_sinks_

__all__ = [
    "ATTENTION_ENV_VAR",
    "CPU_PADDED_MAX_BYTES",
    "CPU_SEGMENT_ENTRIES",
    "CUDA_PADDED_MAX_BYTES",
    "PADDING_FACTOR",
    "PATHS",
    "choose_path",
    "flash_reasons",
    "flash_varlen_attention",
    "one_call_attention",
    "padded_attention",
    "uniform_attention",
]

ATTENTION_ENV_VAR = "CRITICALKV_ATTENTION"
PATHS = ("auto", "flash", "uniform", "padded", "segments")
#: On CPU, the padded path runs when its padded key tensor holds at most this many times the layer's stored entries
PADDING_FACTOR = 4.0
#: On CPU, the padded path runs when its padded key tensor takes at most this many bytes (module docstring).
CPU_PADDED_MAX_BYTES = 4 * 2**20
#: On CPU, the padded path runs when the segments store fewer entries than this on average (module docstring).
CPU_SEGMENT_ENTRIES = 256
#: On CUDA, the padded path runs when its padded key tensor takes at most this many bytes.
CUDA_PADDED_MAX_BYTES = 2**30
#: Logits of one block of query rows (float32 elements: 16 MiB), in ``explicit_attention`` and in
#: ``criticalkv.cache.attention.segment_attention``, and the mask of one block in ``one_call_attention`` (all read it
#: when called).
LOGIT_BLOCK_ELEMENTS = 2**22
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256

VarlenKernel = Callable[..., torch.Tensor]


# --- one SDPA call over dense segments (the uniform and padded paths) --------------------------------------


def one_call_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor | None,
    tail_mask: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One SDPA call over every segment laid out densely: its context slots, then its tail.

    query (b, h_q, q, d); keys, values (b, h_kv, width + tail, d); valid (b, h_kv, width) bool, which context slots
    are real (None: all are); tail_mask (b, 1, q, tail) bool. The G query heads of a KV head are folded into the
    query axis (keys never repeated). The mask is one row broadcast over the queries when every query reads the
    whole tail (a decode step), and absent when moreover every context slot is real. Returns (b, q, h_q, d).
    With a soft cap (Gemma 2) or sinks (gpt-oss, (h_q,)), which SDPA does not take, the same products and softmax
    written out in float32 (``explicit_attention``).

    A tail some query may not read (a prefill chunk, a question) needs a mask of every folded row: the query rows
    then go in blocks whose mask holds at most ``LOGIT_BLOCK_ELEMENTS`` entries (SDPA turns a boolean mask into a
    float one of the same size), so that a chunk of C tokens over L kept entries never holds the
    (G * C) x (L + C) mask at once.
    """
    b, h_q, q, d = query.shape
    h_kv = keys.shape[1]
    g = h_q // h_kv
    tail = tail_mask.shape[-1]
    width = keys.shape[2] - tail
    if bool(tail_mask.all()):  # every query reads every tail entry: one call, one mask row (or none)
        mask = None
        if valid is not None:
            mask = torch.cat([valid, valid.new_ones(b, h_kv, tail)], dim=-1)[:, :, None]  # (b, h_kv, 1, width + tail)
        out = _folded_attention(query, keys, values, mask, scaling, softcap, sinks)
        return out.reshape(b, h_q, q, d).transpose(1, 2)  # SDPA on a GPU may return a non-contiguous (b, h, q, d)
    heads = 1 if valid is None else h_kv
    context = tail_mask.new_ones(b, 1, 1, width) if valid is None else valid[:, :, None]  # (b, 1 or h_kv, 1, width)
    step = max(1, LOGIT_BLOCK_ELEMENTS // (b * heads * g * (width + tail)))  # query rows a block
    out = query.new_empty(b, h_q, q, d)
    for start in range(0, q, step):
        rows = min(step, q - start)
        block_tail = tail_mask[:, :, None, start : start + rows].expand(b, 1, g, rows, tail)
        mask = torch.cat(
            [
                context.expand(b, heads, g * rows, width),
                block_tail.reshape(b, 1, g * rows, tail).expand(-1, heads, -1, -1),
            ],
            dim=-1,
        )  # (b, 1 or h_kv, G*rows, width + tail)
        block = _folded_attention(query[:, :, start : start + rows], keys, values, mask, scaling, softcap, sinks)
        out[:, :, start : start + rows] = block.reshape(b, h_q, rows, d)
    return out.transpose(1, 2)


def _folded_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """query (b, h_q, r, d) with its G query heads of a KV head folded into the query axis, against keys and values
    (b, h_kv, n, d) under mask (broadcastable to (b, h_kv, G*r, n) bool) or None: (b, h_kv, G*r, d)."""
    b, h_q, r, d = query.shape
    folded = query.reshape(b, keys.shape[1], h_q // keys.shape[1] * r, d)  # query heads of a KV head are adjacent
    if softcap is not None or sinks is not None:
        return explicit_attention(folded, keys, values, mask, scaling, softcap, sinks)
    return F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scaling)


def explicit_attention(
    folded: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """SDPA's contract written out, with the soft cap before the mask and the sinks in the softmax
    (``criticalkv.logits``): folded (b, h_kv, G*q, d) query heads of a KV head adjacent, keys and values
    (b, h_kv, n, d), mask broadcastable to (b, h_kv, G*q, n) bool or None; sinks (h_q,). Products and softmax in
    float32 (float64 for float64 inputs), blocks of query rows bounding the logits to ``LOGIT_BLOCK_ELEMENTS``; a
    row that reads nothing gets zeros, as from SDPA. Returns (b, h_kv, G*q, d) in the query's dtype."""
    b, h_kv, rows, d = folded.shape
    n = keys.shape[2]
    exact = torch.promote_types(folded.dtype, torch.float32)
    keys_t, values_x = keys.to(exact).transpose(-1, -2), values.to(exact)  # (b, h_kv, d, n), (b, h_kv, n, d)
    row_sinks = None  # (1, h_kv, G*q, 1): rows (g, q) of KV head k read sinks[k * G + g]
    if sinks is not None:
        g = sinks.numel() // h_kv
        row_sinks = sinks.to(exact).view(1, h_kv, g, 1).repeat_interleave(rows // g, dim=2)
    out = folded.new_empty(b, h_kv, rows, d)
    step = max(1, LOGIT_BLOCK_ELEMENTS // max(b * h_kv * n, 1))
    for start in range(0, rows, step):
        part = slice(start, start + step)
        logits = (folded[:, :, part].to(exact) * scaling) @ keys_t  # (b, h_kv, r, n)
        soft_cap_(logits, softcap)
        if mask is not None:
            logits.masked_fill_(~(mask if mask.shape[2] == 1 else mask[:, :, part]), float("-inf"))
        if row_sinks is None:
            weights = torch.softmax(logits, dim=-1).nan_to_num_(0.0)
        else:
            weights = softmax_with_sinks_(logits, row_sinks[:, :, part])
        out[:, :, part] = weights @ values_x
    return out


# --- the uniform path ------------------------------------------------------------------------------------------


def uniform_attention(
    query: torch.Tensor,
    layer: CompressedLayer,
    tail_keys: torch.Tensor,
    tail_values: torch.Tensor,
    tail_mask: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One SDPA call over a layer whose segments all keep the same count; same contract as ``padded_attention``.

    query (b, h_q, q, d); tail_keys, tail_values (b, h_kv, tail, d); tail_mask (b, 1, q, tail) bool. Returns
    (b, q, h_q, d). The layer is joined at the first call (``CompressedLayer.joined_states``: context and tail in
    one buffer, appends written in place), so when the tail is the layer's own (what its ``update`` returned) a
    decode step copies nothing. Any other tail is concatenated to the context for this call only. Transient
    memory: that concatenation, and, unless every query reads every entry, the mask of a block of query rows
    (``one_call_attention``).
    """
    width = layer.uniform_width()
    if width is None:
        raise CriticalKVError("the uniform attention path needs every segment to keep the same number of entries")
    own_keys, own_values = layer.tail_states()
    keys, values = layer.joined_states()  # (b, h_kv, L + tail, d)
    if not (_same_view(tail_keys, own_keys) and _same_view(tail_values, own_values)):
        keys = torch.cat([keys[:, :, :width], tail_keys], dim=2)  # (b, h_kv, L + tail', d)
        values = torch.cat([values[:, :, :width], tail_values], dim=2)
    return one_call_attention(query, keys, values, None, tail_mask, scaling, softcap, sinks)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors view the same memory the same way."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


# --- the padded path --------------------------------------------------------------------------------------------


def padded_segments(
    layer: CompressedLayer, tail_keys: torch.Tensor, tail_values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each segment's kept context, padded to the longest, then its tail: keys, values (b, h_kv, max_len + tail,
    d) and which context slots are real, (b, h_kv, max_len) bool. Padded slots hold a finite stored entry.

    One ``index_select`` per tensor from the flat context followed by the flat tail (the cheapest gather on CPU).
    """
    b, h_kv, tail, d = tail_keys.shape
    lengths = layer.lengths  # (b, h_kv)
    kept = layer.context_keys.shape[0]
    width = int(lengths.max()) if lengths.numel() else 0
    position = torch.arange(width, device=lengths.device)
    valid = position < lengths[..., None]  # (b, h_kv, max_len)
    starts = layer.offsets()[:-1].view_as(lengths)
    context_rows = torch.where(valid, starts[..., None] + position, 0)  # (b, h_kv, max_len) into the context
    tail_rows = kept + tail * torch.arange(b * h_kv, device=lengths.device).view(b, h_kv, 1)
    tail_rows = tail_rows + torch.arange(tail, device=lengths.device)  # (b, h_kv, tail) into the flat tail
    rows = torch.cat([context_rows, tail_rows], dim=-1).flatten()
    out = []
    for context, appended in ((layer.context_keys, tail_keys), (layer.context_values, tail_values)):
        source = torch.cat([context, appended.reshape(b * h_kv * tail, d)])  # (kept + segments * tail, d)
        out.append(source.index_select(0, rows).view(b, h_kv, width + tail, d))
    return out[0], out[1], valid


def padded_attention(
    query: torch.Tensor,
    layer: CompressedLayer,
    tail_keys: torch.Tensor,
    tail_values: torch.Tensor,
    tail_mask: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """All segments in one SDPA call over padded segments; same contract as ``segment_attention``.

    query (b, h_q, q, d); tail_keys, tail_values (b, h_kv, tail, d); tail_mask (b, 1, q, tail) bool.
    Returns (b, q, h_q, d). Transient memory: one copy of the stored entries (context and tail), the padded keys
    and values of (b * h_kv) x (max_len + tail) entries, and a (b, h_kv, 1, max_len + tail) bool mask when every
    query reads the whole tail (a decode step), else the mask of a block of query rows (``one_call_attention``).
    """
    keys, values, valid = padded_segments(layer, tail_keys, tail_values)  # (b, h_kv, max_len + tail, d)
    return one_call_attention(query, keys, values, valid, tail_mask, scaling, softcap, sinks)


def padding_fits(layer: CompressedLayer, tail: int) -> bool:
    """Whether the padded path may run on this layer (rule 4 of the module docstring): on CUDA its padded keys take
    at most ``CUDA_PADDED_MAX_BYTES``; on CPU the segments store fewer than ``CPU_SEGMENT_ENTRIES`` entries on
    average, and the padded keys hold at most ``PADDING_FACTOR`` x the entries the layer stores and take at most
    ``CPU_PADDED_MAX_BYTES``."""
    segments = layer.lengths.numel()
    width = int(layer.lengths.max()) if segments else 0
    padded = segments * (width + tail)
    keys = layer.context_keys
    padded_bytes = padded * keys.shape[-1] * keys.element_size()
    if keys.is_cuda:
        return padded_bytes <= CUDA_PADDED_MAX_BYTES
    stored = keys.shape[0] + segments * tail
    short = stored < CPU_SEGMENT_ENTRIES * segments
    return short and padded <= PADDING_FACTOR * max(stored, 1) and padded_bytes <= CPU_PADDED_MAX_BYTES


# --- the flash-attn path ----------------------------------------------------------------------------------------


@functools.cache
def _flash_kernel() -> tuple[VarlenKernel | None, str]:
    """flash-attn's ``flash_attn_varlen_func``, or None and why it cannot be imported (looked up once)."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as error:  # not installed, or installed without a usable CUDA build
        return None, f"flash_attn cannot be imported ({error})"
    return flash_attn_varlen_func, ""


def is_plain_causal(tail_mask: torch.Tensor) -> bool:
    """Whether a (b, 1, q, tail) mask is flash-attn's bottom-right causal mask (query i reads tail <= tail - q + i)."""
    q, tail = tail_mask.shape[-2:]
    causal = torch.ones(q, tail, dtype=torch.bool, device=tail_mask.device).tril(diagonal=tail - q)
    return bool(torch.equal(tail_mask, causal.expand_as(tail_mask)))


def flash_setup_reasons(device: torch.device, dtype: torch.dtype, head_size: int) -> list[str]:
    """Why the flash path cannot run for a model on ``device`` in ``dtype`` with heads of ``head_size`` (empty: it
    can, but for each call's mask): checked when a forced flash path is installed, and by every call."""
    reasons = []
    if device.type != "cuda":
        reasons.append(f"the model is on {device.type}, flash-attn needs CUDA")
    if dtype not in _FLASH_DTYPES:
        reasons.append(f"dtype {dtype} (flash-attn takes float16 or bfloat16)")
    if head_size > _FLASH_MAX_HEAD_DIM or head_size % 8:
        reasons.append(f"head size {head_size} (flash-attn takes multiples of 8 up to {_FLASH_MAX_HEAD_DIM})")
    if not reasons:  # checked last: importing flash_attn costs more
        kernel, why = _flash_kernel()
        if kernel is None:
            reasons.append(why)
    return reasons


def flash_reasons(query: torch.Tensor, tail_mask: torch.Tensor) -> list[str]:
    """Why the flash path cannot run on these inputs (empty: it can)."""
    reasons = flash_setup_reasons(query.device, query.dtype, query.shape[-1])
    if not reasons and not is_plain_causal(tail_mask):  # checked last: comparing the mask costs more
        reasons.append("the tail mask is not plain causal (padded tail entries)")
    return reasons


def varlen_inputs(
    layer: CompressedLayer, tail_keys: torch.Tensor, tail_values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Keys and values of every segment, its context then its tail, back to back: (total, 1, d) each, with
    ``cu_seqlens_k`` (segments + 1,) int32 and the longest segment. total = kept + segments * tail."""
    b, h_kv, tail, d = tail_keys.shape
    segments = b * h_kv
    counts = layer.lengths.flatten()  # (S,)
    kept = layer.context_keys.shape[0]
    cu_seqlens = layer.offsets() + tail * torch.arange(segments + 1, device=counts.device)  # (S + 1,)
    segment_of_row = torch.repeat_interleave(torch.arange(segments, device=counts.device), counts, output_size=kept)
    context_rows = torch.arange(kept, device=counts.device) + tail * segment_of_row  # (N,)
    tail_rows = (cu_seqlens[:-1] + counts)[:, None] + torch.arange(tail, device=counts.device)  # (S, tail)
    packed = []
    for context, appended in ((layer.context_keys, tail_keys), (layer.context_values, tail_values)):
        out = context.new_empty(kept + segments * tail, d)
        out.index_copy_(0, context_rows, context)
        out.index_copy_(0, tail_rows.flatten(), appended.reshape(segments * tail, d))
        packed.append(out[:, None])  # (total, 1, d)
    longest = int(counts.max()) + tail if segments else tail
    return packed[0], packed[1], cu_seqlens.to(torch.int32), longest


def flash_varlen_attention(
    query: torch.Tensor,
    layer: CompressedLayer,
    tail_keys: torch.Tensor,
    tail_values: torch.Tensor,
    scaling: float,
    kernel: VarlenKernel | None = None,
) -> torch.Tensor:
    """All segments in one flash-attn varlen call; the tail is read causally (``is_plain_causal`` must hold).

    query (b, h_q, q, d); tail_keys, tail_values (b, h_kv, tail, d). Returns (b, q, h_q, d). Segment s =
    row * h_kv + head is sequence s with its G query heads; ``kernel`` defaults to ``flash_attn_varlen_func``
    (any function of its signature and contract, e.g. a reference implementation in tests).
    """
    if kernel is None:
        kernel, why = _flash_kernel()
        if kernel is None:
            raise CriticalKVError(why)
    b, h_q, q, d = query.shape
    h_kv = layer.lengths.shape[1]
    g = h_q // h_kv
    segments = b * h_kv
    keys, values, cu_seqlens_k, longest = varlen_inputs(layer, tail_keys, tail_values)
    packed_query = query.reshape(b, h_kv, g, q, d).permute(0, 1, 3, 2, 4).reshape(segments * q, g, d)
    cu_seqlens_q = torch.arange(segments + 1, device=query.device, dtype=torch.int32) * q
    out = kernel(
        packed_query, keys, values, cu_seqlens_q, cu_seqlens_k, q, longest, softmax_scale=scaling, causal=True
    )  # (S * q, G, d)
    return out.view(b, h_kv, q, g, d).permute(0, 2, 1, 3, 4).reshape(b, q, h_q, d)


# --- the choice -------------------------------------------------------------------------------------------------


def requested_path() -> str:
    """The path ``$CRITICALKV_ATTENTION`` asks for (``auto`` when unset)."""
    path = os.environ.get(ATTENTION_ENV_VAR, "auto").strip().lower() or "auto"
    if path not in PATHS:
        raise CriticalKVError(f"{ATTENTION_ENV_VAR}={path!r}: choose one of {', '.join(PATHS)}")
    return path


def choose_path(
    query: torch.Tensor,
    layer: CompressedLayer,
    tail_mask: torch.Tensor,
    tail: int,
    path: str | None = None,
    logits_transformed: bool = False,
) -> str:
    """The attention path for a compressed layer: ``flash``, ``uniform``, ``padded`` or ``segments`` (module
    docstring). ``path`` overrides ``$CRITICALKV_ATTENTION``. A forced ``flash`` or ``uniform`` that cannot run
    raises ``CriticalKVError``. ``logits_transformed`` (a soft cap or sinks, which criticalkv's flash call does not
    pass on): never ``flash``.
    """
    path = requested_path() if path is None else path
    if path not in PATHS:
        raise CriticalKVError(f"attention path {path!r}: choose one of {', '.join(PATHS)}")
    if path == "flash":
        reasons = flash_reasons(query, tail_mask)
        if logits_transformed:
            reasons.append("this model soft-caps its logits or adds attention sinks")
        if reasons:
            raise CriticalKVError(f"the flash attention path cannot run: {'; '.join(reasons)}")
        return path
    if path == "uniform":
        if layer.uniform_width() is None:
            raise CriticalKVError(
                "the uniform attention path cannot run: the segments keep different numbers of entries"
            )
        return path
    if path != "auto":
        return path
    if not logits_transformed and not flash_reasons(query, tail_mask):
        return "flash"
    if layer.uniform_width() is not None:
        return "uniform"
    return "padded" if padding_fits(layer, tail) else "segments"
