"""Where a model runs and in which dtype: the ``--device`` and ``--dtype`` values, and a hint for a slow pair."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from criticalkv.errors import CriticalKVError

DEVICE_HELP = "auto (the GPU when torch sees one, else the CPU), cpu, cuda or cuda:N."
DTYPE_HELP = (
    "auto (presets: bfloat16, float32 on a CPU without bfloat16 instructions; else the checkpoint's), bfloat16, "
    "float16 or float32."
)


def _emulates_bfloat16(device: torch.device) -> bool:
    """A CPU without bfloat16 instructions (neither AVX512-BF16 nor AMX), where float32 runs about 5x faster than
    bfloat16 (docs/benchmarks.md)."""
    from criticalkv.core.device import cpu_multiplies_bfloat16

    return device.type == "cpu" and not cpu_multiplies_bfloat16()


def slow_dtype_note(model: PreTrainedModel) -> str | None:
    """A hint for the command line: a bfloat16 model on a CPU that emulates bfloat16 products; None elsewhere."""
    if model.dtype != torch.bfloat16 or not _emulates_bfloat16(model.device):
        return None
    return (
        "note: this CPU has no bfloat16 instructions (neither AVX512-BF16 nor AMX): --dtype float32 runs faster here, "
        "at twice the KV bytes"
    )


def preset_dtype(device: torch.device) -> torch.dtype:
    """What ``auto`` loads a preset in: bfloat16, except on a CPU that emulates bfloat16 products, where float32
    is faster at twice the KV bytes."""
    return torch.float32 if _emulates_bfloat16(device) else torch.bfloat16


def resolve_device(device: str | torch.device) -> torch.device:
    """The torch device a model runs on: ``"auto"`` (the first GPU when torch sees one, else the CPU), ``"cpu"``,
    ``"cuda"`` or ``"cuda:N"``.

    Raises
    ------
    CriticalKVError
        Not a device name, or a GPU torch does not see (no CUDA build, no GPU, an index past the last one).
    """
    if isinstance(device, torch.device):
        chosen = device
    elif device == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    else:
        try:
            chosen = torch.device(device)
        except RuntimeError:
            raise CriticalKVError(f"Unknown device '{device}': use 'auto', 'cpu', 'cuda' or 'cuda:N'.") from None
    if chosen.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise CriticalKVError(
                f"Device '{device}' asked for, but torch sees no CUDA GPU (torch {torch.__version__})."
            )
        if chosen.index is not None and chosen.index >= count:
            raise CriticalKVError(f"Device '{device}' asked for, but torch sees {count} CUDA GPU(s).")
    elif chosen.type != "cpu":
        raise CriticalKVError(f"Device '{device}': criticalkv runs on 'cpu' and 'cuda' devices.")
    return chosen


def as_dtype(dtype: torch.dtype | str, auto: torch.dtype | str) -> torch.dtype | str:
    """The torch dtype a ``--dtype`` value names (aliases: bf16, fp16, half, fp32, float); ``auto`` for "auto"."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return auto
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    value = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(
        aliases.get(dtype, dtype)
    )
    if value is None:  # int8 or float8 load nothing, float64 nothing useful
        raise CriticalKVError(f"Unknown dtype '{dtype}': use 'auto', 'bfloat16', 'float16' or 'float32'.")
    return value
