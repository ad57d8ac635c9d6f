"""Allocators: how many entries does each head get?"""

from criticalkv.allocators.adakv import AdaKVAllocator
from criticalkv.allocators.base import Allocator
from criticalkv.allocators.head_profile import (
    HeadProfile,
    HeadProfileError,
    calibrate_head_profile,
    calibrate_preset,
    load_profile,
)
from criticalkv.allocators.headkv import HeadKVAllocator
from criticalkv.allocators.pyramid import PyramidAllocator
from criticalkv.allocators.uniform import UniformAllocator

__all__ = [
    "AdaKVAllocator",
    "Allocator",
    "HeadKVAllocator",
    "HeadProfile",
    "HeadProfileError",
    "PyramidAllocator",
    "UniformAllocator",
    "calibrate_head_profile",
    "calibrate_preset",
    "load_profile",
]
