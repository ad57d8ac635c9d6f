"""The transformers ``Cache`` holding compressed layers; sliding-window layers stay transformers' own."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Protocol

from transformers import PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, DummyLayer

from criticalkv.cache.compressed_layer import CompressedLayer, owning
from criticalkv.core.layout import StageLength, on_this_stage, stage_layers
from criticalkv.errors import CacheStateError
from criticalkv.models.families import layer_types


class CacheOwner(Protocol):
    """What the cache reads of the runtime that plugs into it (``criticalkv.runtime.compressor.Compressor``): the
    model it serves, whether its attention function is installed, and where to say which cache is being filled."""

    model: PreTrainedModel
    installed: bool
    active_cache: object


def storage_bytes(tensors) -> int:
    """Bytes of the storages behind ``tensors``, each storage once: what they keep allocated. A view (transformers'
    sliding layer keeps its window as a slice of the whole prompt's keys) counts its whole storage."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


def release_views(layers, slack: float = 0.0) -> None:
    """Copy each transformers layer's keys and values that are views of a larger storage (a sliding layer's window,
    sliced from the prompt's keys by ``update`` and ``crop``), so that storage is freed: (b, h_kv, w, d) each.

    ``slack``: leave a view whose storage exceeds it by at most this fraction of the view (a copy then frees more
    than ``slack`` times the bytes it copies: a full cache cropped back after a short answer is left as is).
    """
    for layer in layers:
        if isinstance(layer, CompressedLayer) or not getattr(layer, "is_initialized", False):
            continue
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if tensor is not None and tensor.untyped_storage().nbytes() > (1 + slack) * tensor.nbytes:
                setattr(layer, name, owning(tensor))


class CompressedCache(StageLength, Cache):
    """A cache whose full-attention layers can be compressed right after their prefill.

    Sliding-window layers (Gemma 3, Mistral with a window) already hold at most their window and are left
    to transformers' own layers, uncompressed. On a pipeline stage, the layers other stages run are
    transformers' ``DummyLayer`` (they hold nothing; masks are sized, and the length read, from a layer the stage
    runs: ``StageLength``).
    """

    def __init__(self, config: PretrainedConfig, compressor: CacheOwner | None = None) -> None:
        kinds, layer_kwargs = layer_types(config)
        owned = None if compressor is None else stage_layers(compressor.model)  # None: every layer
        layers = [
            CompressedLayer() if kind == "full_attention" else DYNAMIC_LAYER_TYPE_MAPPING[kind](**kwargs)
            for kind, kwargs in zip(kinds, layer_kwargs, strict=True)
        ]
        super().__init__(layers=on_this_stage(layers, owned))
        self.compressor = compressor

    def __deepcopy__(self, memo: dict) -> CompressedCache:
        """A copy of the cached tensors that shares the compressor, and through it the model (transformers' prompt
        reuse deep-copies a prefilled cache: without this the copy would hold a second model)."""
        memo[id(self.compressor)] = self.compressor
        clone = self.__class__.__new__(self.__class__)
        memo[id(self)] = clone
        for name, value in self.__dict__.items():
            setattr(clone, name, copy.deepcopy(value, memo))
        return clone

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if self.compressor is None or not self.compressor.installed:
            raise CacheStateError(
                "a CompressedCache is read by criticalkv's attention function: use it inside criticalkv.compress(...) "
                "or through a ContextSession, never with the model's plain attention"
            )
        self.compressor.active_cache = self  # the attention function right after this call reads it
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """(kv_length, kv_offset) of the mask transformers builds for the layers of ``layer_idx``'s kind.

        For our layers the mask starts where the earliest of their compressed contexts ends (0 while one is dense):
        a compressed layer reads only its tail's columns (``CompressedLayer.tail_columns``), so a chunk or a question
        over a compressed context gets a (b, 1, q, tail + q) mask rather than one over every token seen (for a
        2,048-token chunk after 30k tokens, 64 MiB of mask to read its last 2,048 columns). Other kinds of layer:
        transformers' sizes.
        """
        kv_length, kv_offset = super().get_mask_sizes(query_length, layer_idx)
        held = self.held_layer_index(layer_idx)  # the layer transformers reads the sizes of
        if kv_offset or held >= len(self.layers) or not isinstance(self.layers[held], CompressedLayer):
            return kv_length, kv_offset
        start = min(layer.context_seen for layer in self.layers if isinstance(layer, CompressedLayer))
        return kv_length - start, start

    def compact(self) -> None:
        """Give back every compressed layer's tail room beyond the tokens appended (``CompressedLayer.compact``)."""
        for layer in self.layers:
            if isinstance(layer, CompressedLayer):
                layer.compact()

    def nbytes(self) -> int:
        """Bytes of key/value storage held by every layer (capacity, including sliding layers, counted by the
        storages they keep: ``storage_bytes``)."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, CompressedLayer):
                total += layer.nbytes()
            elif getattr(layer, "is_initialized", False) and layer.keys is not None:  # DummyLayer: no keys
                total += storage_bytes([layer.keys, layer.values])
        return total

    def entries(self) -> int:
        """(batch, layer, head, token) entries held, summed over every layer."""
        return self._count(CompressedLayer.entries)

    def full_entries(self) -> int:
        """(batch, layer, head, token) entries the cache would hold had nothing been evicted: every token seen, in
        every compressed layer; a layer criticalkv does not compress (a sliding window) as it is."""
        return self._count(CompressedLayer.full_entries)

    def _count(self, compressed: Callable[[CompressedLayer], int]) -> int:
        """``compressed`` of every compressed layer, plus the entries every other layer holds."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, CompressedLayer):
                total += compressed(layer)
            elif getattr(layer, "is_initialized", False) and layer.keys is not None:  # DummyLayer: no keys
                total += layer.keys.shape[0] * layer.keys.shape[1] * layer.keys.shape[2]
        return total

    @classmethod
    def stack(cls, caches: list[CompressedCache]) -> CompressedCache:
        """The rows of several caches of one prompt as one batch (``CompressedLayer.stack``, layer by layer), so
        that they answer one question in one decode. Caches with sliding-window layers cannot be stacked."""
        if not caches:
            raise CacheStateError("nothing to stack")
        out = cls.__new__(cls)
        layers = []
        for index, group in enumerate(zip(*(cache.layers for cache in caches), strict=True)):
            if all(isinstance(layer, DummyLayer) for layer in group):  # another pipeline stage's layer
                layers.append(DummyLayer())
            elif all(isinstance(layer, CompressedLayer) for layer in group):
                layers.append(CompressedLayer.stack(list(group)))
            else:
                raise CacheStateError(f"layer {index} is not a compressed layer in every cache: it cannot be stacked")
        Cache.__init__(out, layers=layers)
        out.compressor = caches[0].compressor
        return out

    def stackable(self) -> bool:
        """Whether ``stack`` takes this cache: every layer compressed (or another pipeline stage's)."""
        return all(isinstance(layer, CompressedLayer | DummyLayer) for layer in self.layers)
