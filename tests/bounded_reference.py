"""A slow reference for bounded-memory runs (chunked prefill, compression while decoding): the full model replays
every forward of the compressed run on transformers' own cache, each layer reading only the token positions the
compressed cache held when that forward began (plus the forward's own tokens), with dense SDPA."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import criticalkv.runtime.rolling as rolling_module
from criticalkv.cache import CompressedLayer
from criticalkv.cache.attention import as_bool_mask

_ALLOWED: dict[int, torch.Tensor] = {}  # layer -> (b, h_kv, n) bool: positions held before the running forward


def _masked_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    b, h_kv, n, _ = key.shape
    q = query.shape[2]
    if attention_mask is None:
        logical = (
            torch.ones(q, n, dtype=torch.bool, device=key.device).tril(diagonal=n - q)[None, None].expand(b, 1, q, n)
        )
    else:
        logical = as_bool_mask(attention_mask)[:, :, :, :n].expand(b, 1, q, n)
    allowed = _ALLOWED.get(module.layer_idx)
    columns = torch.ones(b, h_kv, n, dtype=torch.bool, device=key.device)
    if allowed is not None:
        columns[:, :, : allowed.shape[-1]] = allowed
    mask = (logical & columns[:, :, None, :]).repeat_interleave(query.shape[1] // h_kv, dim=1)
    g = query.shape[1] // h_kv
    out = F.scaled_dot_product_attention(
        query, key.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1), attn_mask=mask, scale=scaling
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("test_bounded", _masked_attention)
AttentionMaskInterface.register("test_bounded", sdpa_mask)


class Tracker:
    """Follows which token positions every compressed layer holds, and records each forward of the model: its
    inputs, its last logits and the positions held when it began (``before``: layer -> (b, h_kv, seen) bool; read
    by a pre-hook, as a deferred method compresses in a forward hook that may run after the tracker's).
    ``held(i)``: what forward ``i`` left (the next one's ``before``, the cache's own after the last)."""

    def __init__(self, model, monkeypatch) -> None:
        self.positions: dict[int, torch.Tensor] = {}  # id(layer) -> (b, h_kv, context_seen) bool
        self.forwards: list[dict] = []
        real_compress, real_refill = CompressedLayer.compress, rolling_module.refill

        def compress(layer, keep, width=None):
            self.positions[id(layer)] = keep.clone()
            return real_compress(layer, keep, width)

        def refill(layer, keys, values, keep):
            self.positions[id(layer)] = self._refilled(layer, keep)
            return real_refill(layer, keys, values, keep)

        monkeypatch.setattr(CompressedLayer, "compress", compress)
        monkeypatch.setattr(rolling_module, "refill", refill)
        self.cache = None
        self.handles = [
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.register_forward_hook(self._record, with_kwargs=True),
        ]

    def _held(self, layer: CompressedLayer) -> torch.Tensor:
        """(b, h_kv, seen) bool: the positions the layer holds now."""
        b, h = layer.lengths.shape if layer.is_compressed else layer.keys.shape[:2]
        held = torch.ones(b, h, layer.seen, dtype=torch.bool)
        if layer.is_compressed:
            positions = self.positions[id(layer)]  # a guided chunk's refill also flagged its guide's positions, after
            assert not bool(positions[..., layer.context_seen :].any())  # context_seen: never kept
            held[:, :, : layer.context_seen] = positions[..., : layer.context_seen]
        return held

    def _refilled(self, layer: CompressedLayer, keep: torch.Tensor) -> torch.Tensor:
        """The positions a refill keeps: ``keep`` runs over the right-aligned held entries (cache.rolling)."""
        held = self._held(layer)
        out = torch.zeros_like(held)
        b, h, _ = held.shape
        for i in range(b):
            for j in range(h):
                where = held[i, j].nonzero().flatten()  # ascending positions, right-aligned in keep
                picked = keep[i, j, keep.shape[-1] - len(where) :]
                out[i, j, where[picked]] = True
        return out

    def _snapshot(self, cache) -> dict[int, torch.Tensor]:
        return {i: self._held(layer) for i, layer in enumerate(cache.layers) if layer.is_initialized}

    def _before(self, model, args, kwargs) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        self.forwards.append({"before": {} if cache is None else self._snapshot(cache)})

    def _record(self, model, args, kwargs, output) -> None:
        self.cache = kwargs.get("cache", kwargs.get("past_key_values"))
        self.forwards[-1].update(
            ids=kwargs["input_ids"],
            mask=kwargs.get("attention_mask"),
            positions=kwargs.get("position_ids"),
            logits=output.logits[:, -1].float().clone(),
        )

    def held(self, index: int) -> dict[int, torch.Tensor]:
        """layer -> (b, h_kv, seen) bool: the positions held when forward ``index`` (and its hooks) ended."""
        if index in (-1, len(self.forwards) - 1):
            return self._snapshot(self.cache)
        return self.forwards[index + 1]["before"]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()

    def replay(self, model) -> list[torch.Tensor]:
        """The reference's last logits (b, vocab) of every recorded forward, in order."""
        base = model.config._attn_implementation
        model.set_attn_implementation("test_bounded")
        cache = DynamicCache(config=model.config)
        out = []
        try:
            with torch.no_grad():
                for forward in self.forwards:
                    seen = forward["mask"].shape[1] - forward["ids"].shape[1] if forward["mask"] is not None else None
                    if seen is not None and cache.get_seq_length() > seen:
                        cache.crop(
                            seen - cache.get_seq_length()
                        )  # a guide's tokens (prefill_in_chunks' guide_ids) left the compressed cache
                    _ALLOWED.clear()
                    _ALLOWED.update(forward["before"])
                    result = model(
                        input_ids=forward["ids"],
                        attention_mask=forward["mask"],
                        position_ids=forward["positions"],
                        cache=cache,
                        use_cache=True,
                    )
                    out.append(result.logits[:, -1].float())
        finally:
            model.set_attn_implementation(base)
            _ALLOWED.clear()
        return out
