"""The compressed KV cache: variable-length per-(batch, KV head) segments and attention over them."""

from criticalkv.cache.attention import segment_attention
from criticalkv.cache.compressed_cache import CompressedCache
from criticalkv.cache.compressed_layer import CompressedLayer

__all__ = ["CompressedCache", "CompressedLayer", "segment_attention"]
