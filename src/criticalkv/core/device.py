"""Facts of the machine criticalkv runs on that more than one layer reads."""

from __future__ import annotations

import torch


def cpu_has_amx() -> bool:
    """AMX tiles, as torch reports them (a private helper: a torch without it counts as no)."""
    return getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()


def cpu_has_avx512_bf16() -> bool:
    """AVX512-BF16, as torch reports it (a private helper: a torch without it counts as no)."""
    return getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()


def cpu_multiplies_bfloat16() -> bool:
    """AVX512-BF16 or AMX."""
    return cpu_has_avx512_bf16() or cpu_has_amx()
