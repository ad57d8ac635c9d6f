"""Bounded memory: compress every layer's cache again after each prefill chunk and every N generated tokens.

The first forward over an empty cache (the first chunk, or a whole prompt) is compressed as always, right after
each layer's attention. Afterwards a layer holds its kept context plus a tail (the next chunk, question or
generated tokens); ``Rolling.observe`` (called by the attention function once the layer has attended)
compresses context + tail back to the cap with the same method: the view it hands the method is the layer's held
entries, right-aligned (``cache.rolling.held_entries``), and the last query rows the layer saw (a rolling buffer
of ``Method.query_rows`` rows per layer: SnapKV's window is the chunk's, or the last generated tokens', last
queries). The most recent tokens are the view's last positions, which a window scorer protects.

A cross-layer allocator decides every layer of a forward together when that forward ends (``finish``); scorers
that score by forward passes over the whole finished prompt (reconstruction) are refused
(``check_rolling_method``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from criticalkv.budget import Budget
from criticalkv.cache.compressed_layer import CompressedLayer, as_bool_mask
from criticalkv.cache.rolling import held_entries, refill
from criticalkv.core.view import LayerView
from criticalkv.errors import BoundedMemoryError
from criticalkv.runtime.compressor import LayerRecord
from criticalkv.runtime.method import Method
from criticalkv.runtime.places import Places
from criticalkv.scorers.base import declares_non_negative


def check_rolling_method(method: Method) -> None:
    """Refuse a method that cannot compress a cache again and again, with the reason (``BoundedMemoryError``)."""
    scorer = method.scorer
    if getattr(scorer, "after_prefill", False):
        raise BoundedMemoryError(
            f"method {method.name!r} ({type(scorer).__name__}) scores by forward passes that repeat the whole finished "
            "prompt, which a chunked prefill never holds and decoding never finishes: use its surrogate "
            "('surrogate', 'critical-surrogate', ...) or a window scorer (snapkv, tova, defensive, ...)"
        )
    if getattr(method.allocator, "streaming", False):
        raise BoundedMemoryError(
            f"method {method.name!r} ({type(method.allocator).__name__}) shrinks earlier layers as later ones arrive, "
            "with state kept over one whole prefill; chunked or decoding compression would need that state across "
            "forwards: use the cross-layer allocator it approximates ('layer-defensive') or a per-layer one"
        )


@dataclass
class Rolling:
    """How often a cache is compressed back to ``cap`` entries per KV head.

    Parameters
    ----------
    cap
        Entries per KV head kept after each compression: the budget of every compression (``Budget(cap)``;
        head-wise and layer-wise allocators share out the same total, so a head may hold more than ``cap``
        while another holds less).
    chunk_size
        Prefill the prompt ``chunk_size`` tokens at a time, compressing after each chunk; None: one forward.
    every
        While decoding, compress again once ``every`` tokens were appended since the last compression; None:
        never (the answer's tokens are kept).
    """

    cap: int
    chunk_size: int | None = None
    every: int | None = None
    prefilling: bool = False  # a chunk's forward is running: compress after it whatever its length
    holding: bool = False  # a chunk's forward whose compression waits for its guide (prefill_in_chunks' guide_ids)
    guide: int = 0  # guide tokens at the end of the running forward: they score, are never kept, and leave the layer
    _rows: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)  # layer -> (b, h_q, r, d) last queries
    _checked: dict[int, int] = field(default_factory=dict, repr=False)  # layer -> its length when last compressed
    _pending: list = field(default_factory=list, repr=False)  # a cross-layer method's layers of this forward

    def __post_init__(self) -> None:
        for name in ("cap", "chunk_size", "every"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise BoundedMemoryError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.cap < 2:
            raise BoundedMemoryError(f"cap must be at least 2 entries per KV head, got {self.cap}")

    def saved(self) -> tuple[dict, dict]:
        """What ``restore`` puts back: the remembered queries and compression points (a session's context)."""
        return dict(self._rows), dict(self._checked)

    def restore(self, saved: tuple[dict, dict]) -> None:
        """Back to what ``saved`` returned."""
        self._rows, self._checked = (dict(part) for part in saved)
        self._pending = []

    @property
    def budget(self) -> Budget:
        """The budget of every compression: ``cap`` entries per KV head."""
        return Budget(self.cap)

    def remember(self, layer_idx: int, query: torch.Tensor, rows: int, fresh: bool) -> None:
        """Keep the last ``rows`` query rows (b, h_q, rows, d) the layer saw; ``fresh``: a new prompt starts."""
        earlier = None if fresh else self._rows.get(layer_idx)
        if earlier is not None and earlier.shape[:2] == query.shape[:2]:
            query = torch.cat([earlier, query], dim=2)
        self._rows[layer_idx] = query[:, :, -rows:].clone()
        if fresh:
            self._checked.pop(layer_idx, None)

    def due(self, layer: CompressedLayer, layer_idx: int) -> bool:
        """Whether the layer is compressed again now: after every prefill chunk; while decoding, once ``every``
        tokens were appended since its last compression."""
        if self.prefilling:
            return layer.tail > 0
        if self.every is None:
            return False
        return layer.seen - self._checked.get(layer_idx, layer.context_seen) >= self.every

    @torch.no_grad()
    def observe(
        self,
        compressor,
        module: nn.Module,
        query: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float,
        layer: CompressedLayer,
        new_prompt: bool,
    ) -> None:
        """Called by the attention function once a compressible layer has attended: remember its last queries, and
        unless this forward began a new prompt (``new_prompt``: compressed as every prefill is), compress its
        context + tail back to the cap when due (a cross-layer method: when the forward ends, ``finish``)."""
        method = compressor.method
        layer_idx = module.layer_idx
        self.remember(layer_idx, query, method.query_rows, fresh=new_prompt)
        if self.holding or new_prompt or layer.pending or not self.due(layer, layer_idx):
            return
        if self._rows[layer_idx].shape[2] < min(method.query_rows, layer.seen):
            return  # rows of another batch remembered (sessions stacked after their prefill): wait for a window
        start = time.process_time()
        self._checked[layer_idx] = layer.seen - self.guide
        item = self._view(module, attention_mask, scaling, layer, compressor.places)
        if method.deferred:
            self._pending.append(item)
        else:
            scores = [_scores(method, item, self.guide)]
            self._apply(compressor, [item], method.decide_layers([item[0]], self._budget(method, item), scores))
        compressor.compress_cpu_seconds += time.process_time() - start

    @torch.no_grad()
    def finish(self, compressor) -> None:
        """At the end of a forward: decide a cross-layer method's layers together."""
        if not self._pending:
            return
        items, self._pending = self._pending, []
        start = time.process_time()
        method = compressor.method
        width = max(item[0].keys.shape[2] for item in items)  # a cross-layer allocator reads one length for all
        items = [_pad_left(item, width) for item in items]
        scores = [_scores(method, item, self.guide) for item in items]
        budget = self._budget(method, items[0])
        self._apply(compressor, items, method.decide_layers([item[0] for item in items], budget, scores))
        compressor.compress_cpu_seconds += time.process_time() - start

    def _budget(self, method: Method, item: tuple) -> Budget:
        """The budget of a compression: the cap, plus, under a guide, the guide's positions the scorer protects (its
        window): they are kept first and then dropped, so the cap's entries are all the chunk's and the context's."""
        if not self.guide:
            return self.budget
        protected = method.scorer.protected(item[0])  # (b, T) bool
        return Budget(self.cap + int(protected[:, protected.shape[1] - self.guide :].sum(-1).max()))

    def _view(
        self,
        module: nn.Module,
        attention_mask: torch.Tensor | None,
        scaling: float,
        layer: CompressedLayer,
        places: Places | None,
    ) -> tuple:
        """The layer's held entries as a view: (view, layer, held (b, h_kv, T) bool); with their places in the
        prompt (``LayerView.places``) when the compressor follows them (``places``: its scorer reads them)."""
        keys, values, held = held_entries(layer)  # (b, h_kv, T, d), (b, h_kv, T)
        real = held.new_ones(held.shape[0], layer.tail)  # (b, tail)
        if attention_mask is not None:  # the tail's padding (a row whose real tokens start in this chunk)
            real = as_bool_mask(layer.tail_columns(attention_mask))[:, 0, -1]  # (b, tail)
            held[..., held.shape[-1] - layer.tail :] &= real[:, None, :]
        valid = held.any(dim=1)  # (b, T): a suffix of each row, as left padding (segments are right-aligned)
        query = self._rows[module.layer_idx]
        ragged = not bool((held == valid[:, None, :]).all())
        view = LayerView(module, query, keys, values, valid, scaling, held=held if ragged else None)
        if places is not None:
            view.places, view.seen = places.of(module.layer_idx, layer, real, self.guide)
        return view, layer, held

    def _apply(self, compressor, items: list[tuple], decisions: list) -> None:
        for (view, layer, held), decision in zip(items, decisions, strict=True):
            keep = None if decision.keep is None else decision.keep & held  # (b, h_kv, T)
            if self.guide:  # the guide's entries leave the layer, kept or not: the next chunk takes their positions
                keep = held.clone() if keep is None else keep
                keep[..., keep.shape[-1] - self.guide :] = False
            if keep is not None:
                refill(layer, view.keys, view.values, keep)
            if self.guide:
                layer.seen = layer.context_seen = layer.seen - self.guide
            if keep is not None and view.places is not None:
                compressor.places.remember(view.module.layer_idx, layer, view.places[keep], view.seen)
            kept = decision.budgets if keep is None else keep.sum(-1)  # (b, h_kv)
            record(compressor, LayerRecord(view.module.layer_idx, view.lengths, kept, decision.kept_whole, keep))


def _pad_left(item: tuple, width: int) -> tuple:
    """A held-entries item (view, layer, held) padded on the left to ``width`` positions (nothing held there)."""
    view, layer, held = item
    pad = width - view.keys.shape[2]
    if pad == 0:
        return item
    keys, values = (F.pad(x, (0, 0, pad, 0)) for x in (view.keys, view.values))  # (b, h_kv, width, d)
    held = F.pad(held, (pad, 0))
    ragged = None if view.held is None else held
    padded = LayerView(view.module, view.query, keys, values, F.pad(view.valid, (pad, 0)), view.scaling, held=ragged)
    if view.places is not None:
        padded.places, padded.seen = F.pad(view.places, (pad, 0)), view.seen
    return padded, layer, held


def _scores(method: Method, item: tuple, guide: int = 0) -> torch.Tensor:
    """The method's scores of a held-entries view, (b, h_kv, T). Where a row's heads hold different counts, the view
    says which positions each head holds (``LayerView.held``: the window's attention reads those alone), and a
    head's padding scores below every real entry (0 for scores >= 0 by the scorer's word), so that it is taken
    only where a head's budget exceeds what it holds; it is dropped after selection. The last ``guide`` positions
    (a guide's entries: their queries are the window, their keys part of its attention) score as padding does."""
    view, _, held = item
    scores = method.scores_of(view)
    if view.held is None and not guide:
        return scores
    low = 0.0 if declares_non_negative(method.scorer) else float(scores.min()) - 1.0
    candidates = held.clone()
    candidates[..., candidates.shape[-1] - guide :] = False
    return scores.masked_fill(~candidates, low)


def record(compressor, fresh: LayerRecord) -> None:
    """``fresh`` replaces the record of its layer in ``compressor.records`` (one per layer: the latest); its keep
    mask is dropped unless the compressor records them."""
    if not compressor.record_keep:
        fresh.keep = None
    records = compressor.records
    records[:] = [r for r in records if r.layer != fresh.layer] + [fresh]
