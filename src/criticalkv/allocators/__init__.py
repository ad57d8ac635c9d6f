"""Allocators: how many entries does each head get?"""

from criticalkv.allocators.base import Allocator
from criticalkv.allocators.uniform import UniformAllocator

__all__ = ["Allocator", "UniformAllocator"]
