"""Named methods: each preset is a scorer + allocator + selector combination (design.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from criticalkv.allocators import AdaKVAllocator, HeadKVAllocator, PyramidAllocator, UniformAllocator
from criticalkv.errors import UnknownMethodError
from criticalkv.runtime.method import Method
from criticalkv.scorers import KeyNormScorer, SnapKVScorer, StreamingScorer, TOVAScorer
from criticalkv.selectors import CriticalSelector, TopKSelector


@dataclass(frozen=True)
class Preset:
    summary: str
    build: Callable[[], Method] | None  # None: no compression (the full cache)


def _preset(scorer: Callable, selector: Callable) -> Callable[[], Method]:
    return lambda: Method(scorer(), UniformAllocator(), selector())


PRESETS: dict[str, Preset] = {
    "full": Preset("no compression: the full cache, the reference every method is measured against", None),
    "snapkv": Preset(
        "SnapKV: observation-window attention (window 32, pool 5), top-k per head",
        _preset(SnapKVScorer, TopKSelector),
    ),
    "critical-snapkv": Preset(
        "CriticalKV over SnapKV: alpha=0.5 of the budget by attention, the rest by attention x ||V W_O||_1",
        _preset(SnapKVScorer, CriticalSelector),
    ),
    "adakv": Preset(
        "AdaKV: SnapKV scores, one layer-wide top-k over all KV heads sets each head's budget (safeguard 0.2)",
        lambda: Method(SnapKVScorer(), AdaKVAllocator(), TopKSelector()),
    ),
    "critical-adakv": Preset(
        "CriticalKV over AdaKV: AdaKV's head budgets from the attention, then the two-stage selection per head",
        lambda: Method(SnapKVScorer(), AdaKVAllocator(), CriticalSelector()),
    ),
    "pyramidkv": Preset(
        "PyramidKV: SnapKV scores, layer budgets decreasing linearly with depth (beta 20), top-k per head",
        lambda: Method(SnapKVScorer(), PyramidAllocator(), TopKSelector()),
    ),
    "critical-pyramidkv": Preset(
        "CriticalKV over PyramidKV: pyramid layer budgets, two-stage selection per head",
        lambda: Method(SnapKVScorer(), PyramidAllocator(), CriticalSelector()),
    ),
    "headkv": Preset(
        "HeadKV: SnapKV scores, head budgets from the model's head-importance profile (base share 0.2), top-k",
        lambda: Method(SnapKVScorer(), HeadKVAllocator(), TopKSelector()),
    ),
    "critical-headkv": Preset(
        "CriticalKV over HeadKV: profile-driven head budgets, two-stage selection per head",
        lambda: Method(SnapKVScorer(), HeadKVAllocator(), CriticalSelector()),
    ),
    "streaming": Preset(
        "StreamingLLM: 4 attention sinks + the most recent tokens", _preset(StreamingScorer, TopKSelector)
    ),
    "knorm": Preset("key norm: keep the entries with the smallest key L2 norm", _preset(KeyNormScorer, TopKSelector)),
    "tova": Preset(
        "TOVA: attention of the last prompt token, mean over the layer's heads",
        _preset(TOVAScorer, TopKSelector),
    ),
    "critical-tova": Preset("CriticalKV over TOVA's scores", _preset(TOVAScorer, CriticalSelector)),
}


def method_names() -> list[str]:
    return list(PRESETS)


def build_method(name: str, **options: object) -> Method | None:
    """The method of a preset, with options set on whichever piece has them (``window=64``, ``alpha=0.25``).

    Returns None for ``full``. Unknown names and options raise ``UnknownMethodError``.
    """
    preset = PRESETS.get(name)
    if preset is None:
        raise UnknownMethodError(f"unknown method {name!r}; choose one of: {', '.join(PRESETS)}")
    if preset.build is None:
        if options:
            raise UnknownMethodError(f"method 'full' takes no options, got {sorted(options)}")
        return None
    method = preset.build()
    pieces = {"scorer": method.scorer, "allocator": method.allocator, "selector": method.selector}
    for key, value in options.items():
        owners = [p for p, obj in pieces.items() if key in {f.name for f in dataclasses.fields(obj)}]
        if not owners:
            valid = sorted({f.name for obj in pieces.values() for f in dataclasses.fields(obj)})
            raise UnknownMethodError(
                f"method {name!r} has no option {key!r}; its options: {', '.join(valid) or 'none'}"
            )
        for owner in owners:
            pieces[owner] = dataclasses.replace(pieces[owner], **{key: value})
    return Method(pieces["scorer"], pieces["allocator"], pieces["selector"], name=name)
