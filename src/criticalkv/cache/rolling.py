"""A compressed layer's entries (kept context + tail) as one padded block, and compressing that block again.

Chunked prefill and compression while decoding compress a layer more than once: its kept context plus what was
appended since (a chunk, generated tokens) goes back down to the budget. ``held_entries`` lays every segment's
entries out right-aligned in one (b, h_kv, T, d) block, T = the longest segment's count: the tail occupies the
last columns of every segment, so the most recent tokens line up across heads (a scorer's window is the last
columns), and a shorter segment (head-wise budgets) has padding on its left, flagged in ``held``.
``refill`` stores the entries a keep mask over that block flags as the layer's new context.
"""

from __future__ import annotations

import torch

from criticalkv.cache.compressed_layer import CompressedLayer


def held_entries(layer: CompressedLayer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys, values (b, h_kv, T, d) and ``held`` (b, h_kv, T) bool of every entry the layer holds, right-aligned.

    A dense layer (never compressed) gives its whole tail, every entry held (padding is the caller's to mask).
    """
    tail_keys, tail_values = layer.tail_states()  # (b, h_kv, tail, d)
    b, h, tail, d = tail_keys.shape
    if not layer.is_compressed:
        return tail_keys, tail_values, torch.ones(b, h, tail, dtype=torch.bool, device=tail_keys.device)
    rows, held_context = _context_rows(layer)  # (b, h_kv, L) each
    width = rows.shape[-1]
    keys, values = [], []
    for flat, tail_part in ((layer.context_keys, tail_keys), (layer.context_values, tail_values)):
        if flat.shape[0] == 0:  # nothing kept: zeros under the padding flags
            context = tail_part.new_zeros(b, h, width, d)
        else:
            context = flat.index_select(0, rows.flatten()).view(b, h, width, d)
            context = context.masked_fill(~held_context[..., None], 0.0)
        (keys if tail_part is tail_keys else values).append(torch.cat([context, tail_part], dim=2))
    held = torch.cat([held_context, held_context.new_ones(b, h, tail)], dim=2)  # (b, h_kv, L + tail)
    return keys[0], values[0], held


def held_places(layer: CompressedLayer, context: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """(b, h_kv, T) long, laid out as ``held_entries``' block: a compressed layer's per-entry values ``context`` (N,)
    (in storage order, like its keys) and the tail's ``tail`` (b, tail), the same for every head; 0 on padding."""
    rows, held_context = _context_rows(layer)  # (b, h_kv, L) each
    b, h, _ = rows.shape
    placed = context[rows.flatten()].view(b, h, -1) if context.numel() else rows.new_zeros(b, h, rows.shape[-1])
    placed = placed.masked_fill(~held_context, 0)
    return torch.cat([placed, tail[:, None, :].expand(-1, h, -1).to(placed.dtype)], dim=2)


def _context_rows(layer: CompressedLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """Each right-aligned column's row in the flat context storage (0 on padding) and whether the column holds an
    entry, (b, h_kv, L) each, L = the longest segment's count."""
    counts = layer.lengths  # (b, h_kv)
    b, h = counts.shape
    width = int(counts.max()) if counts.numel() else 0
    column = torch.arange(width, device=counts.device)  # (L,)
    start = width - counts[..., None]  # (b, h_kv, 1): first held column of each segment
    held_context = column >= start  # (b, h_kv, L)
    # flat row of each held column: the segment's offset plus its index among the segment's entries
    rows = layer.offsets()[:-1].view(b, h, 1) + (column - start)  # (b, h_kv, L)
    return rows.masked_fill(~held_context, 0), held_context


def refill(layer: CompressedLayer, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor) -> None:
    """Make the entries ``keep`` (b, h_kv, T) bool flags of ``keys``/``values`` (b, h_kv, T, d) (``held_entries``'s
    block) the layer's compressed context, in their order; the tail is emptied and everything else freed."""
    b, h, _, d = keys.shape
    segment, position = keep.reshape(b * h, -1).nonzero(as_tuple=True)  # (N,) each, segment after segment
    layer.context_keys = keys.reshape(b * h, -1, d)[segment, position]  # (N, d), a new buffer
    layer.context_values = values.reshape(b * h, -1, d)[segment, position]
    layer.lengths = keep.sum(-1)  # (b, h_kv)
    layer.keys = keys.new_empty((b, h, 0, d))
    layer.values = values.new_empty((b, h, 0, d))
    layer.tail = 0
    layer.context_seen = layer.seen
    layer.fresh = layer.pending = False
