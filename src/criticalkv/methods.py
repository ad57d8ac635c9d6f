"""Named methods: each preset is a scorer + allocator + selector combination (design.md)."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass

from criticalkv.allocators import (
    AdaKVAllocator,
    BoundedCrossLayerAllocator,
    CrossLayerAllocator,
    HeadKVAllocator,
    PyramidAllocator,
    UniformAllocator,
)
from criticalkv.errors import CriticalKVError, MethodOptionError, UnknownMethodError, did_you_mean
from criticalkv.runtime.method import Method
from criticalkv.scorers import (
    DefensiveScorer,
    KeyNormScorer,
    ReconstructionScorer,
    SnapKVScorer,
    StreamingScorer,
    SurrogateScorer,
    TOVAScorer,
)
from criticalkv.selectors import CriticalSelector, DefensiveSelector, PerturbationSelector, TopKSelector


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
    "measured-snapkv": Preset(
        "SnapKV's top-k set improved by swaps that lower the window queries' measured output perturbation "
        "(each query head's relative to its start; half the budget anchored by score; docs/selectors.md)",
        _preset(SnapKVScorer, PerturbationSelector),
    ),
    "measured-adakv": Preset(
        "AdaKV's head budgets, then per head the measured-perturbation swaps of measured-snapkv",
        lambda: Method(SnapKVScorer(), AdaKVAllocator(), PerturbationSelector()),
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
    "defensive": Preset(
        "DefensiveKV: window max floored at the head mean, value shares across heads, cumulative-mass stage 1; "
        "one layer-wide contest sets head budgets",
        lambda: Method(DefensiveScorer(), AdaKVAllocator(safeguard=0.0), DefensiveSelector()),
    ),
    "layer-defensive": Preset(
        "Layer-DefensiveKV: DefensiveKV's ranking, one contest over every layer and head (reference: every layer "
        "stays dense until the prefill ends)",
        lambda: Method(DefensiveScorer(), CrossLayerAllocator(), DefensiveSelector()),
    ),
    "layer-defensive-bounded": Preset(
        "Layer-DefensiveKV's allocation computed layer by layer: each layer compressed on arrival, earlier layers "
        "shrunk as later ones win entries (peak memory of a per-layer method)",
        lambda: Method(DefensiveScorer(), BoundedCrossLayerAllocator(), DefensiveSelector()),
    ),
    "reconstruct": Preset(
        "KVzip scores (max attention from the model repeating the context, chunks of 2048), question-agnostic; "
        "the same budget in every layer and head, top-k",
        _preset(ReconstructionScorer, TopKSelector),
    ),
    "critical-reconstruct": Preset(
        "CriticalKV over the reconstruction scores: two-stage selection per head",
        _preset(ReconstructionScorer, CriticalSelector),
    ),
    "ada-reconstruct": Preset(
        "reconstruction scores, AdaKV head budgets (safeguard 0.2), top-k per head",
        lambda: Method(ReconstructionScorer(), AdaKVAllocator(), TopKSelector()),
    ),
    "critical-ada-reconstruct": Preset(
        "reconstruction scores, AdaKV head budgets, CriticalKV's two-stage selection per head",
        lambda: Method(ReconstructionScorer(), AdaKVAllocator(), CriticalSelector()),
    ),
    "layer-reconstruct": Preset(
        "KVzip as published (kvpress's default, layerwise=False): the reconstruction scores ranked over every layer "
        "and head at once, sinks kept",
        lambda: Method(ReconstructionScorer(), CrossLayerAllocator(), TopKSelector()),
    ),
    "critical-layer-reconstruct": Preset(
        "KVzip's cross-layer budgets, then CriticalKV's two-stage selection per head",
        lambda: Method(ReconstructionScorer(), CrossLayerAllocator(), CriticalSelector()),
    ),
    "surrogate": Preset(
        "the reconstruction scores predicted from each entry's key and value by a per-layer linear map (shipped for "
        "the preset models, or weights=<file> from train-scorer): no pass beyond the prefill; top-k per head",
        _preset(SurrogateScorer, TopKSelector),
    ),
    "critical-surrogate": Preset(
        "CriticalKV over the surrogate scores: two-stage selection per head",
        _preset(SurrogateScorer, CriticalSelector),
    ),
    "ada-surrogate": Preset(
        "surrogate scores, AdaKV head budgets (safeguard 0.2), top-k per head",
        lambda: Method(SurrogateScorer(), AdaKVAllocator(), TopKSelector()),
    ),
    "critical-ada-surrogate": Preset(
        "surrogate scores, AdaKV head budgets, CriticalKV's two-stage selection per head",
        lambda: Method(SurrogateScorer(), AdaKVAllocator(), CriticalSelector()),
    ),
    "layer-surrogate": Preset(
        "layer-reconstruct at the price of a prefill: the surrogate scores ranked over every layer and head at once",
        lambda: Method(SurrogateScorer(), CrossLayerAllocator(), TopKSelector()),
    ),
    "critical-layer-surrogate": Preset(
        "the surrogate's cross-layer budgets, then CriticalKV's two-stage selection per head",
        lambda: Method(SurrogateScorer(), CrossLayerAllocator(), CriticalSelector()),
    ),
}


def method_names() -> list[str]:
    return list(PRESETS)


def parse_option_value(raw: str) -> object:
    """An option's value as written on a command line: int, float, ``true``/``false``, else the string."""
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            continue
    return {"true": True, "false": False}.get(raw.lower(), raw)


def parse_method_spec(spec: str) -> tuple[str, dict[str, object]]:
    """``"critical-snapkv:alpha=0.25;eps=0"`` -> ``("critical-snapkv", {"alpha": 0.25, "eps": 0})``.

    A method spec is a preset name, optionally followed by ``:`` and ``key=value`` options separated by ``;``.
    """
    name, _, rest = spec.partition(":")
    options: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in rest.split(";"))):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UnknownMethodError(f"method spec {spec!r}: option {item!r} is not of the form key=value")
        options[key.strip()] = parse_option_value(raw.strip())
    return name.strip(), options


def _typed(value: object, annotation: object) -> object:
    """``value`` as the field annotated ``annotation`` takes it (an int for ``float`` becomes a float, a path for a
    type with a ``load`` classmethod is loaded); raises TypeError when no member of the annotation accepts it (a bool
    is never an int or a float here)."""
    members = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    for member in members:
        if member is type(None) and value is None:
            return value
        if member is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if member is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(member, type) and member not in (int, float, type(None)) and isinstance(value, member):
            return value
        if isinstance(member, type) and isinstance(value, str) and callable(getattr(member, "load", None)):
            return member.load(value)  # an object saved to a file, named by its path (a calibrated HeadKV profile)
    expected = " or ".join("None" if m is type(None) else getattr(m, "__name__", str(m)) for m in members)
    raise TypeError(f"expected {expected}, got {value!r}")


def _with_option(piece: object, key: str, value: object) -> object:
    """A copy of the scorer/allocator/selector ``piece`` with field ``key`` set (typed and validated)."""
    return dataclasses.replace(piece, **{key: _typed(value, typing.get_type_hints(type(piece))[key])})


def build_method(name: str, **options: object) -> Method | None:
    """The method of a preset, with options set on whichever piece has them (``window=64``, ``alpha=0.25``).

    ``name`` may be a method spec, ``"critical-snapkv:alpha=0.25;eps=0"`` (see ``parse_method_spec``); keyword
    options add to the spec's, and one given both ways with different values is refused (the method is named by its
    spec). Returns None for ``full``. Unknown names and options raise ``UnknownMethodError``.
    """
    spec = name
    if not isinstance(spec, str):
        raise UnknownMethodError(
            f"a method is a preset name such as 'critical-snapkv' or a criticalkv.Method, got {spec!r}; "
            f"presets: {', '.join(PRESETS)}"
        )
    name, spec_options = parse_method_spec(spec)
    clashes = sorted(k for k in spec_options.keys() & options.keys() if spec_options[k] != options[k])
    if clashes:
        raise MethodOptionError(
            f"method {spec!r}: option(s) {', '.join(clashes)} given in the spec and again with another value"
        )
    options = {**spec_options, **options}
    preset = PRESETS.get(name)
    if preset is None:
        raise UnknownMethodError(f"unknown method {name!r}.{did_you_mean(name, PRESETS)} Methods: {', '.join(PRESETS)}")
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
                f"method {name!r} has no option {key!r}.{did_you_mean(key, valid)} "
                f"Its options: {', '.join(valid) or 'none'}"
            )
        for owner in owners:
            try:
                pieces[owner] = _with_option(pieces[owner], key, value)
            except (TypeError, ValueError, CriticalKVError) as error:
                raise MethodOptionError(f"method {name!r}, option {key}={value!r}: {error}") from error
    return Method(pieces["scorer"], pieces["allocator"], pieces["selector"], name=spec)


def method_spec(method: Method) -> str | None:
    """The spec that builds ``method`` again: its name's preset with an option for every field where its pieces
    differ from the preset's (keyword options given to ``build_method`` are not in its name). None when none does:
    a method of no preset, or one whose differences no option string can say (an object, one key set apart on two
    pieces)."""
    name, _ = parse_method_spec(method.name)
    preset = PRESETS.get(name)
    if preset is None or preset.build is None:
        return None
    options: dict[str, object] = {}
    for mine, theirs in zip(method.pieces, preset.build().pieces, strict=True):
        if type(mine) is not type(theirs):
            return None
        for field in dataclasses.fields(mine):
            if not field.init:  # state the piece makes for itself (a scorer's maps per model), not an option
                continue
            value = getattr(mine, field.name)
            if repr(value) == repr(getattr(theirs, field.name)):
                continue
            if not isinstance(value, bool | int | float | str):
                return None
            options[field.name] = value
    written = {k: str(v).lower() if isinstance(v, bool) else v for k, v in sorted(options.items())}
    spec = name + (":" + ";".join(f"{k}={v}" for k, v in written.items()) if written else "")
    try:
        rebuilt = build_method(spec)
    except CriticalKVError:
        return None
    return spec if repr(rebuilt.pieces) == repr(method.pieces) else None
