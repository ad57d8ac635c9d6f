"""Head-importance profiles for HeadKV: which KV heads of a model retrieve from the context, measured once per
model on needle-in-a-haystack prompts and shipped (or cached) as JSON.

A profile is a (layers x kv_heads) matrix plus the model shape it was measured on, so it can refuse a model
of another shape. ``criticalkv.eval.head_calibration`` measures one; ``load_profile`` finds one for a config.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from criticalkv.core.paths import cache_root
from criticalkv.errors import CriticalKVError
from criticalkv.files import write_json
from criticalkv.models.families import head_dim, text_config

FORMAT = "criticalkv-head-profile/1"
#: Shape fields a profile must share with a model's config to be used on it.
SHAPE_FIELDS = ("model_type", "num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size")
USER_PROFILE_DIR = "head_profiles"  # under criticalkv's cache root: where calibrate-heads saves by default


class HeadProfileError(CriticalKVError):
    """No head profile for this model, or a profile measured on a model of another shape."""


class HeadProfileWarning(UserWarning):
    """A head profile found by the model's shape alone: measured on another model of that shape."""


def _calibrate_hint(config: PretrainedConfig | None = None) -> str:
    name = getattr(config, "name_or_path", "") or "M"
    return (
        f"Measure one with `criticalkv calibrate-heads --model {name}` (a few minutes on CPU) and pass it as "
        "HeadKVAllocator(profile=HeadProfile.load(path)), or save it where load_profile looks"
    )


def config_shape(config: PretrainedConfig) -> dict[str, Any]:
    """The shape facts of a model config a profile is matched on (text config of multimodal wrappers)."""
    text = text_config(config)
    return {
        "model_type": getattr(text, "model_type", None),
        "num_layers": int(text.num_hidden_layers),
        "num_heads": int(text.num_attention_heads),
        "num_kv_heads": int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads),
        "head_dim": int(head_dim(text)),
        "hidden_size": int(text.hidden_size),
    }


def _describe(shape: dict[str, Any]) -> str:
    return (
        f"{shape['model_type']} with {shape['num_layers']} layers, {shape['num_heads']} query / "
        f"{shape['num_kv_heads']} KV heads, head size {shape['head_dim']}, hidden size {shape['hidden_size']}"
    )


def rounded(rows: Sequence[Sequence[float]]) -> list[list[float]]:
    """Six significant digits: readable JSON, and a positive importance never rounds to zero."""
    return [[float(f"{float(x):.6g}") for x in row] for row in rows]


@dataclass(repr=False)
class HeadProfile:
    """Importance of every KV head of a model: a (num_layers, num_kv_heads) matrix, higher = more budget.

    Parameters
    ----------
    importance
        ``importance[layer][kv_head]`` > 0.
    model_type, num_layers, num_heads, num_kv_heads, head_dim, hidden_size
        The shape of the model it was measured on (``num_heads`` are query heads).
    name
        A label, e.g. the model preset (``"smollm2-135m"``).
    measurement
        How it was measured: method, samples, lengths, depths, seed, date, wall time, versions, ...
    query_scores
        Optional per-query-head scores (num_layers, num_heads) the importance was reduced from.
    """

    importance: list[list[float]]
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    name: str = ""
    measurement: dict[str, Any] = field(default_factory=dict)
    query_scores: list[list[float]] | None = None

    def __post_init__(self) -> None:
        matrix = self.matrix
        if tuple(matrix.shape) != (self.num_layers, self.num_kv_heads):
            raise HeadProfileError(
                f"head profile {self.name!r}: importance is {tuple(matrix.shape)}, expected "
                f"(num_layers, num_kv_heads) = ({self.num_layers}, {self.num_kv_heads})"
            )
        if not bool(torch.isfinite(matrix).all()) or bool((matrix <= 0).any()):
            raise HeadProfileError(f"head profile {self.name!r}: importances must be finite and > 0")
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise HeadProfileError(
                f"head profile {self.name!r}: {self.num_heads} query heads are not a multiple of "
                f"{self.num_kv_heads} KV heads"
            )

    def __repr__(self) -> str:
        samples = self.measurement.get("samples", "?")
        return (
            f"HeadProfile(name={self.name!r}, {self.model_type} {self.num_layers} layers x {self.num_kv_heads} KV "
            f"heads, samples={samples})"
        )

    @property
    def matrix(self) -> torch.Tensor:
        """The importance matrix (num_layers, num_kv_heads), float64."""
        return torch.tensor(self.importance, dtype=torch.float64).reshape(len(self.importance), -1)

    @property
    def shape(self) -> dict[str, Any]:
        return {
            "model_type": self.model_type,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_size": self.hidden_size,
        }

    @classmethod
    def from_config(
        cls, config: PretrainedConfig, importance: torch.Tensor | Sequence[Sequence[float]], **kwargs: Any
    ) -> HeadProfile:
        """A profile for ``config``'s shape with the given (num_layers, num_kv_heads) importances."""
        rows = torch.as_tensor(importance, dtype=torch.float64).tolist()
        return cls(importance=rows, **config_shape(config), **kwargs)

    def mismatches(self, config: PretrainedConfig) -> list[str]:
        """The shape fields on which this profile and ``config`` differ, as ``"field: profile vs model"``."""
        model = config_shape(config)
        return [f"{k}: {self.shape[k]} vs {model[k]}" for k in SHAPE_FIELDS if self.shape[k] != model[k]]

    def check(self, config: PretrainedConfig) -> None:
        """Raise ``HeadProfileError`` unless this profile was measured on a model of ``config``'s shape."""
        wrong = self.mismatches(config)
        if wrong:
            raise HeadProfileError(
                f"head profile {self.name or '<unnamed>'!r} is for another model: it was measured on "
                f"{_describe(self.shape)}, this model is {_describe(config_shape(config))} "
                f"({'; '.join(wrong)}). {_calibrate_hint(config)}."
            )

    # --- JSON ------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": FORMAT, "name": self.name, "model": self.shape}
        out["measurement"] = self.measurement
        out["importance"] = rounded(self.importance)
        if self.query_scores is not None:
            out["query_scores"] = rounded(self.query_scores)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HeadProfile:
        if data.get("format") != FORMAT:
            raise HeadProfileError(f"not a criticalkv head profile (format {data.get('format')!r}, want {FORMAT!r})")
        try:
            return cls(
                importance=data["importance"],
                name=data.get("name", ""),
                measurement=data.get("measurement", {}),
                query_scores=data.get("query_scores"),
                **{k: data["model"][k] for k in SHAPE_FIELDS},
            )
        except (KeyError, TypeError, ValueError) as exc:  # ValueError: rows of unequal length
            raise HeadProfileError(f"malformed head profile: missing or bad field {exc}") from None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, self.to_dict(), indent=1)
        return path

    @classmethod
    def load(cls, path: str | Path) -> HeadProfile:
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise HeadProfileError(f"cannot read head profile {path}: {exc}") from None
        return cls.from_dict(data)


# --- finding a profile -----------------------------------------------------------------------------------------


def user_profile_dir() -> Path:
    """Where ``criticalkv calibrate-heads`` saves profiles by default: ``<cache root>/head_profiles``."""
    return cache_root() / USER_PROFILE_DIR


def _candidate_files() -> Iterable[tuple[str, Any]]:
    """(label, readable path) of every profile JSON: the user's own first, then the shipped ones."""
    user = user_profile_dir()
    if user.is_dir():
        for path in sorted(user.glob("*.json")):
            yield str(path), path
    shipped = files("criticalkv.allocators").joinpath("profiles")
    if shipped.is_dir():
        for entry in sorted(shipped.iterdir(), key=lambda p: p.name):
            if entry.name.endswith(".json"):
                yield f"criticalkv/allocators/profiles/{entry.name}", entry


def available_profiles() -> list[tuple[str, HeadProfile]]:
    """Every readable profile (user cache dir, then shipped), with where it came from."""
    found = []
    for label, entry in _candidate_files():
        try:
            found.append((label, HeadProfile.from_dict(json.loads(entry.read_text(encoding="utf-8")))))
        except (OSError, json.JSONDecodeError, HeadProfileError):
            continue  # a broken file must not hide the others
    return found


def model_label(config: PretrainedConfig) -> str:
    """The name profiles are saved under for this model: its folder's name (a preset's converted folder is named
    after the preset), as ``calibrate-heads`` labels what it measures; empty when the config has no path."""
    return Path(getattr(config, "name_or_path", "") or "").name


def model_source(config: PretrainedConfig) -> str:
    """Where the model was loaded from: a local folder's absolute path, else ``name_or_path`` as given (a hub id);
    recorded in a calibrated profile, so that two folders of one name (``run1/final``, ``run2/final``) are told
    apart."""
    where = getattr(config, "name_or_path", "") or ""
    return str(Path(where).resolve()) if where and Path(where).is_dir() else where


def load_profile(config: PretrainedConfig) -> HeadProfile:
    """The head profile for a model config: the one named after the model (``model_label``) among those of its
    shape, else the first of its shape (user cache dir, then shipped) with a ``HeadProfileWarning``: its heads were
    measured on another model of the same shape (a fine-tune's may differ).

    Raises
    ------
    HeadProfileError
        None matches: the message lists the profiles there are, what differs, and how to measure one.
    """
    found = available_profiles()
    same_shape = [profile for _, profile in found if not profile.mismatches(config)]
    label, source = model_label(config), model_source(config)
    named = [profile for profile in same_shape if profile.name == label]
    own = [profile for profile in named if profile.measurement.get("source") in (None, source)]
    if own:
        return own[0]
    if named:  # a folder of the same name elsewhere
        profile = named[0]
        warnings.warn(
            f"HeadKV: the head profile {label!r} was measured on {profile.measurement['source']}, not on this model "
            f"({source}), a model of the same name and shape; using it. {_calibrate_hint(config)}.",
            HeadProfileWarning,
            stacklevel=2,
        )
        return profile
    if same_shape:
        profile = same_shape[0]
        model = repr(label) if label else "this model"
        warnings.warn(
            f"HeadKV: no head profile measured on {model}; using {profile.name or '<unnamed>'!r}, measured on "
            f"another model of the same shape. {_calibrate_hint(config)}.",
            HeadProfileWarning,
            stacklevel=2,
        )
        return profile
    shape = config_shape(config)
    if found:
        others = "; ".join(f"{p.name or where} ({_describe(p.shape)})" for where, p in found)
        listing = f"the installed profiles are for other models: {others}"
    else:
        listing = "no head profile is installed"
    raise HeadProfileError(
        f"no HeadKV head profile for this model ({_describe(shape)}): {listing}. {_calibrate_hint(config)}"
        f" ({user_profile_dir()})."
    )
