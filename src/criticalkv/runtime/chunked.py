"""Chunked prefill: the prompt goes through the model ``chunk_size`` tokens at a time, and (with a compressor) every
layer's cache is compressed back to the cap after each chunk, so memory stays bounded whatever the prompt's length.

``rolling_budget`` reads the options of ``criticalkv.compress(..., chunk_size=, cap=, compress_every=)`` and of a
``ContextSession``; ``prefill_in_chunks`` runs the chunks; ``generate_in_chunks`` is what the model's ``generate``
does inside such a block.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.utils import ModelOutput

from criticalkv.budget import Budget
from criticalkv.cache.compressed_cache import CompressedCache
from criticalkv.cache.compressed_layer import CompressedLayer
from criticalkv.core.positions import forward_on_cache
from criticalkv.errors import BoundedMemoryError
from criticalkv.runtime.compressor import Compressor
from criticalkv.runtime.rolling import Rolling, check_rolling_method


def rolling_budget(
    method: object,
    budget: Budget | float | int | str,
    chunk_size: int | None,
    cap: int | None,
    compress_every: int | None,
) -> tuple[Budget, Rolling | None]:
    """The budget and the compression schedule of a call with these options (None: compress as usual, or not at
    all for ``method`` ``"full"``).

    Without ``chunk_size`` and ``compress_every`` nothing changes (``cap`` alone is refused). With either, ``cap``
    (entries per KV head) is every compression's budget (a fraction ``budget``, such as the default, is not read; an
    entry count other than the cap is refused); without ``cap`` an entry-count budget serves as the cap,
    ``1.0`` compresses nothing (the prompt is still prefilled in chunks), and a fraction is refused: a fraction of
    a prompt that no chunk sees whole.
    """
    budget = Budget.parse(budget)
    if chunk_size is None and compress_every is None:
        if cap is not None:
            raise BoundedMemoryError("cap applies with chunk_size or compress_every; alone, give budget=cap")
        return budget, None
    if method == "full":
        return budget, None
    if cap is not None and not budget.is_fraction and budget.value != cap:
        raise BoundedMemoryError(f"budget {budget} and cap={cap} both count entries per head: give one")
    if cap is None:
        if budget.keeps_everything:
            return budget, None
        if budget.is_fraction:
            raise BoundedMemoryError(
                f"budget {budget} is a fraction of the prompt, which a chunked prefill or a long generation never "
                "holds whole: give cap=K (entries per KV head)"
            )
        cap = int(budget.value)
    rolling = Rolling(cap, chunk_size, compress_every)
    return rolling.budget, rolling


def schedule_decoding(compressor: Compressor, budget: Budget, cap: int | None, compress_every: int) -> None:
    """Make a compressor whose context is compressed already (a loaded session's) compress its answers back to
    ``cap`` entries per KV head every ``compress_every`` generated tokens; without ``cap``, ``budget`` (the
    context's) when it is an entry count. Until the answer has given the window its queries, nothing is compressed
    (the context's own last queries are not stored)."""
    _, rolling = rolling_budget(compressor.method, budget if cap is None else Budget(cap), None, cap, compress_every)
    check_rolling_method(compressor.method)
    compressor.rolling = rolling


def prefill_in_chunks(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    cache: Cache,
    chunk_size: int,
    rolling: Rolling | None = None,
    guide_ids: torch.Tensor | None = None,
) -> ModelOutput:
    """Forward input_ids (b, t) after ``cache`` (empty or not), ``attention_mask`` (b, seen + t), ``chunk_size``
    tokens at a time; ``rolling`` (the installed compressor's): compress after each chunk. Returns the last
    chunk's output (the logits of the last position).

    ``guide_ids`` (b, g), with ``rolling``: every chunk but the last is compressed by a forward of these tokens
    placed right after it (normally the question, which ends the prompt): their queries are the window a scorer
    reads, their entries are never kept and leave the cache, so the next chunk follows at the right position. The
    last chunk is compressed by its own last queries (the prompt's question itself). Without a guide every chunk
    is scored by its own last queries."""
    t = input_ids.shape[1]
    seen = attention_mask.shape[1] - t
    if guide_ids is not None and rolling is not None:
        _check_guide(cache, guide_ids, input_ids.shape[0])
    out = None
    for start in range(0, t, chunk_size):
        end = min(start + chunk_size, t)
        guided = guide_ids is not None and rolling is not None and end < t
        if rolling is not None:
            rolling.prefilling, rolling.holding = not guided, guided
        try:
            out = forward_on_cache(model, input_ids[:, start:end], attention_mask[:, : seen + end], cache)
            if guided:
                rolling.prefilling, rolling.holding, rolling.guide = True, False, guide_ids.shape[1]
                guide_mask = torch.cat([attention_mask[:, : seen + end], torch.ones_like(guide_ids)], dim=1)
                forward_on_cache(model, guide_ids, guide_mask, cache)
                if any(layer.seen != seen + end for layer in cache.layers):
                    raise BoundedMemoryError("a layer kept its guide's entries: the cache no longer follows the prompt")
        finally:
            if rolling is not None:
                rolling.prefilling, rolling.holding, rolling.guide = False, False, 0
    return out


def _check_guide(cache: Cache, guide_ids: torch.Tensor, batch: int) -> None:
    """Refuse a guide that is not (b, g) token ids of the prompt's batch, or a cache ``check_guidable`` refuses."""
    if guide_ids.dim() != 2 or guide_ids.shape[0] != batch or guide_ids.shape[1] == 0:
        raise BoundedMemoryError(
            f"guide_ids must be (batch, g) token ids with g >= 1 and the prompt's batch {batch}, "
            f"got {tuple(guide_ids.shape)}"
        )
    check_guidable(cache)


def check_guidable(cache: Cache) -> None:
    """Refuse a cache whose layers are not all compressed ones: a sliding-window layer would keep a guide's
    entries."""
    if any(not isinstance(layer, CompressedLayer) for layer in cache.layers):
        raise BoundedMemoryError(
            "a guided chunked prefill needs every layer compressible: this model's sliding-window layers would keep "
            "the guide's entries (prefill without guide_ids)"
        )


def generate_in_chunks(compressor: Compressor, generate: Callable, args: tuple, kwargs: dict, config: object):
    """The model's ``generate`` inside a block with a bounded-memory schedule: with ``chunk_size``, the prompt but
    its last token prefilled in chunks into a compressed cache (or, given one to continue, the tokens after it), then
    ``generate`` continues from that cache (its first step reads the last token); embeddings are refused. Beam
    search with ``compress_every`` is refused: the beams reorder the cache, not the window's remembered queries."""
    rolling = compressor.rolling
    if rolling.every is not None and (kwargs.get("num_beams") or getattr(config, "num_beams", 1) or 1) > 1:
        raise BoundedMemoryError("beam search cannot compress while decoding (compress_every): use greedy or sampling")
    if rolling.chunk_size is None:
        return generate(*args, **kwargs)
    kwargs = dict(kwargs)
    if "input_ids" in kwargs:
        ids = kwargs.pop("input_ids")
    else:  # generate's first parameter, ``inputs``, or none (embeddings)
        ids, args = (args[0], args[1:]) if args else (None, args)
    if not isinstance(ids, torch.Tensor):
        raise BoundedMemoryError(
            "chunk_size prefills token ids chunk by chunk, and inputs_embeds would be prefilled whole: give input_ids"
        )
    given = kwargs.pop("cache", None)
    given = kwargs.pop("past_key_values", None) if given is None else given
    if given is not None and not isinstance(given, CompressedCache):
        if given.get_seq_length() > 0:
            raise BoundedMemoryError(
                f"chunk_size continues only a compressed cache (an earlier generate's past_key_values in this "
                f"block), not a {type(given).__name__}: its tokens were prefilled unbounded"
            )
        given = None  # an empty cache of the user's: the prefill fills a compressed one (the guard warned)
    mask = kwargs.pop("attention_mask", None)
    mask = torch.ones_like(ids) if mask is None else mask
    cache = compressor.new_cache() if given is None else given
    seen = cache.get_seq_length()  # a cache to continue holds the prompt's first tokens; the rest go in chunks
    if ids.shape[1] - 1 > seen:
        prefill_in_chunks(compressor.model, ids[:, seen:-1], mask[:, :-1], cache, rolling.chunk_size, rolling)
    return generate(ids, *args, attention_mask=mask, cache=cache, **kwargs)  # ids: generate's first, ``inputs``
