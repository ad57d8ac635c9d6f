"""Allocators: how many entries does each head get?"""

from criticalkv.allocators.adakv import AdaKVAllocator
from criticalkv.allocators.base import Allocator
from criticalkv.allocators.cross_layer import CrossLayerAllocator
from criticalkv.allocators.cross_layer_bounded import BoundedCrossLayerAllocator
from criticalkv.allocators.head_profile import (
    HeadProfile,
    HeadProfileError,
    HeadProfileWarning,
    load_profile,
)
from criticalkv.allocators.headkv import HeadKVAllocator
from criticalkv.allocators.pyramid import PyramidAllocator
from criticalkv.allocators.uniform import UniformAllocator

__all__ = [
    "AdaKVAllocator",
    "Allocator",
    "BoundedCrossLayerAllocator",
    "CrossLayerAllocator",
    "HeadKVAllocator",
    "HeadProfile",
    "HeadProfileError",
    "HeadProfileWarning",
    "PyramidAllocator",
    "UniformAllocator",
    "load_profile",
]
