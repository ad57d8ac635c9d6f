"""Facts of the machine criticalkv runs on that more than one layer reads."""

from __future__ import annotations

import torch


def cpu_multiplies_bfloat16() -> bool:
    """AVX512-BF16 or AMX, as torch reports them (private helpers: a torch without them counts as neither)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)
