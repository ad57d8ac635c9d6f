"""The scorer contract, and what a scorer sees of one layer right after its prefill attention."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from criticalkv.cache import CompressedCache, CompressedLayer
from criticalkv.core.piece import Piece
from criticalkv.core.view import LayerView
from criticalkv.logits import attention_sinks, logit_softcap, soft_cap_, softmax_with_sinks_


@runtime_checkable
class Scorer(Piece, Protocol):
    """Scores every cached entry of a layer; higher means more worth keeping.

    ``score`` and ``protected`` are the contract; the other members are optional capabilities with defaults, which a
    scorer inherits by deriving from ``Scorer`` (``class MyScorer(Scorer)``) and overrides where it differs (with
    ``window``, ``check_config`` and ``check_model`` of ``Piece``).

    Attributes
    ----------
    non_negative
        True when the scores are >= 0 by construction (attention probabilities, recency): a selector that multiplies
        scores by value norms (CriticalKV, DefensiveKV) then trusts them, where otherwise a ``Method`` checks the sign
        of every layer's scores (a host read per layer, on a GPU a wait for the device). Read from the class that
        says it (``declares_non_negative``): a subclass that computes the scores anew must say so again. Default
        False.
    supports_sliding_windows
        False refuses models with sliding-window layers (reconstruction: their caches cannot be rewound after its
        passes). Default True.
    after_prefill
        True when the scores come from passes over the finished prefill (``score_after_prefill``): the method is
        then deferred, its layers dense until the prefill ends. Default False.
    reads_places
        True when ``score`` reads ``LayerView.places``, where the entries of a cache compressed again (a chunked
        prefill, compression while decoding) stand in the prompt: the runtime then follows them through every
        compression. Default False (the views carry none).
    """

    non_negative: ClassVar[bool] = False
    supports_sliding_windows: ClassVar[bool] = True
    after_prefill: ClassVar[bool] = False
    reads_places: bool = False

    def score(self, view: LayerView) -> torch.Tensor:
        """Scores (b, h_kv, t), float32. Values at padding positions are ignored."""
        ...

    def protected(self, view: LayerView) -> torch.Tensor:
        """Positions always kept and counted inside the budget: (b, t) bool."""
        ...

    def score_after_prefill(self, context: PrefillContext) -> list[torch.Tensor]:
        """Scores (b, h_kv, t) float32 per pending layer, in layer order, from passes over the finished prefill;
        called instead of ``score`` when ``after_prefill`` is True (the default scorer has none)."""
        raise NotImplementedError(f"{type(self).__name__} scores each layer in its prefill (after_prefill is False)")


class ProbeSlot(Protocol):
    """Where a scorer that runs extra forwards after the prefill (``score_after_prefill``) leaves an attention
    probe, for the runtime's attention function to fill during those forwards (``Compressor.attention_probe``)."""

    attention_probe: object | None


@dataclass
class PendingLayer:
    """A dense layer of a deferred method, waiting for the end of the prefill."""

    layer: CompressedLayer
    view: LayerView  # keys/values are the layer's own storage; query holds only the method's last rows


@dataclass
class PrefillContext:
    """What a scorer with ``after_prefill`` gets to score a finished prefill (e.g. by extra forward passes)."""

    model: nn.Module  # the transformers model
    compressor: ProbeSlot  # the runtime's compressor
    cache: CompressedCache
    input_ids: torch.Tensor | None  # (b, t) the prefill's tokens
    attention_mask: torch.Tensor | None  # (b, t) the prefill's mask, None when every token is real
    pending: list[PendingLayer]  # the compressible layers, in layer order


_SCORING_METHODS = ("score", "score_after_prefill")


def follows_places(scorer: object) -> bool:
    """Whether ``scorer`` reads ``LayerView.places`` (``reads_places``; False for a scorer of one's own that does not
    derive from ``Scorer`` and does not say)."""
    return bool(getattr(scorer, "reads_places", False))


def declares_non_negative(scorer: object) -> bool:
    """Whether ``scorer``'s scores are >= 0 by its class's word (``non_negative = True``), given by the class that
    computes them or a subclass of it: a subclass that overrides ``score`` (e.g. shifting a built-in scorer's
    scores) below the class that said so is not trusted until it says so itself."""
    mro = type(scorer).__mro__
    owner = next((cls for cls in mro if "non_negative" in vars(cls)), None)
    if owner is None or not vars(owner)["non_negative"]:
        return False
    for name in _SCORING_METHODS:
        source = next((cls for cls in mro if name in vars(cls)), None)
        if source is not None and source not in owner.__mro__:  # owner below the class that computes them
            return False
    return True


def last_positions(view: LayerView, n: int) -> torch.Tensor:
    """The last ``n`` positions of every row: (b, t) bool. Left padding keeps real tokens at the end."""
    b, t = view.valid.shape
    mask = torch.zeros(b, t, dtype=torch.bool, device=view.valid.device)
    if n > 0:
        mask[:, max(t - n, 0) :] = True
    return mask & view.valid


def pool_along_keys(x: torch.Tensor, kernel: int) -> torch.Tensor:
    """An average pool of odd width ``kernel`` along the last dimension, stride 1, zero padding of ``kernel // 2``
    on each side, counted in the divisor: ``F.avg_pool1d``'s result to the bit (each window summed left to right,
    then divided by ``kernel``; a test checks it), as shifted adds, which on a CPU take about half the time of
    torch's pooling kernel on many short rows (DefensiveKV pools every window query's row). x (..., n) float."""
    n, half = x.shape[-1], kernel // 2
    total = torch.zeros_like(x)
    for offset in range(-half, half + 1):  # total[i] += x[i + offset] where i + offset is in range
        if abs(offset) < n:
            total[..., max(0, -offset) : n - max(0, offset)] += x[..., max(0, offset) : n - max(0, -offset)]
    return total.div_(kernel)


# Keys per product on a CPU. One product over every key writes the whole (G*w, t) float32 block, which at 16k keys
# (Qwen2.5-0.5B: 29 MB a layer) fills most of an L3 cache before the softmax reads it back; products over 512 keys
# at a time and the softmax written over the logits took the compression of a 16k prefill from 1.12 to 0.80 CPU s,
# the same values, no measurable change at 2k-8k (docs/benchmarks.md, "The window's attention on a CPU in blocks of
# keys").
CPU_KEY_CHUNK = 512


def window_logits(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``q @ keys^T``, (b, h_kv, r, t) from q (b, h_kv, r, d) and keys (b, h_kv, t, d): on a CPU, product by product
    over ``CPU_KEY_CHUNK`` keys at a time (each entry is the same dot product as in one product)."""
    t = keys.shape[2]
    if q.device.type != "cpu" or t <= CPU_KEY_CHUNK:
        return torch.matmul(q, keys.transpose(-1, -2))
    logits = q.new_empty(*q.shape[:-1], t)
    for start in range(0, t, CPU_KEY_CHUNK):
        part = slice(start, start + CPU_KEY_CHUNK)
        torch.matmul(q, keys[:, :, part].transpose(-1, -2), out=logits[..., part])
    return logits


def window_attention(view: LayerView, window: int) -> torch.Tensor:
    """Softmax attention of the last ``window`` queries over all keys, float32: (b, h_kv, G, w, t).

    Causal inside the window, padding keys masked (and a head's own padding, ``LayerView.held``), computed per KV
    head without repeating the keys; with the
    model's soft cap and attention sinks where it has them (``criticalkv.logits``).
    """
    b, h_kv, t, d = view.keys.shape
    g = view.groups
    w = min(window, t)
    if view.query.shape[2] < w:
        raise ValueError(f"the window's {w} queries are needed, the view holds the last {view.query.shape[2]}")
    # The last w query rows are the last w positions (a deferred layer keeps only its last rows of the query).
    # one copy: float32 laid out as (b, h_q, w, d), so the group's rows join without a second one (the attention's
    # queries arrive as a transposed (b, t, h_q, d) layout)
    q = view.query[:, :, -w:, :].to(torch.float32, memory_format=torch.contiguous_format)
    q = q.reshape(b, h_kv, g * w, d) * view.scaling  # (b, h_kv, G*w, d): a view, unless the queries were float32
    logits = window_logits(q, view.keys.float()).view(b, h_kv, g, w, t)  # (b, h_kv, G, w, t)
    soft_cap_(logits, logit_softcap(view.module))  # Gemma 2, before the masks as in the model
    # causal: only the window's own columns can lie ahead of a window query; (w, w): key after query
    ahead = view.remember_for_prefill(
        ("ahead", w), lambda: torch.ones(w, w, dtype=torch.bool, device=q.device).triu_(1)
    )
    logits[..., t - w :].masked_fill_(ahead, float("-inf"))
    if view.padded:
        logits.masked_fill_(~view.valid[:, None, None, None, :], float("-inf"))
    if view.held is not None:  # heads holding different entries: each reads its own
        logits.masked_fill_(~view.held[:, :, None, None, :], float("-inf"))
    sinks = attention_sinks(view.module)  # gpt-oss: (h_q,) logits sharing each softmax's denominator
    if sinks is not None:
        return softmax_with_sinks_(logits, sinks.float().view(1, h_kv, g, 1, 1))
    if logits.device.type == "cpu":
        return torch.softmax(logits, dim=-1, out=logits)  # in place: no second block to write and read back
    return torch.softmax(logits, dim=-1)
