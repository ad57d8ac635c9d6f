"""A learned surrogate of the reconstruction scorer (after KVzap): per layer and KV head, a linear map from what the
prefill already holds, each entry's key and value, to the logarithm of the score KVzip's reconstruction passes
would give it. Scoring costs a few small products per layer and no forward pass, so the question-agnostic presets
run at about the price of a plain prefill.

The features of an entry (``surrogate_features``) are its key's RoPE pair magnitudes, which the rotation leaves
unchanged, so they do not depend on the entry's position; its key as cached (the slow pairs hardly turn over a
few thousand positions and keep their direction); and its value. ``criticalkv train-scorer`` fits the maps
(``criticalkv.training.surrogate``); fitted maps ship for the preset models and are found by the model's
fingerprint (``criticalkv.models.fingerprint``).
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import ClassVar

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from criticalkv.core.view import LayerView
from criticalkv.errors import CriticalKVError
from criticalkv.models.families import attention_modules
from criticalkv.models.fingerprint import model_fingerprint
from criticalkv.scorers.base import Scorer

FEATURES = "rope-pair-magnitudes+keys+values/v1"  # the feature layout the weights are fitted on
TRAIN_COMMAND = "criticalkv train-scorer --model <preset or folder> --out <file>.safetensors"
_METADATA = "criticalkv-surrogate"  # the safetensors metadata key of the header (fingerprint, features)
_LOG_CEILING = 40.0  # predicted log-scores beyond this would overflow float32 in exp; real ones are <= 0


class SurrogateError(CriticalKVError):
    """A surrogate scorer that is missing for a model, trained for another model, or malformed."""


def feature_count(head_dim: int) -> int:
    """Features per entry: d/2 pair magnitudes, the d key components and the d value components."""
    return head_dim // 2 + 2 * head_dim


def surrogate_features(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """(b, h_kv, t, F) float32 features from keys and values (b, h_kv, t, d), F = ``feature_count(d)``.

    RoPE (transformers' rotate-half layout) turns component i with component i + d/2 by the position's angle, so
    the length of each such pair is the same at every position.
    """
    k, v = keys.float(), values.float()
    half = k.shape[-1] // 2
    magnitudes = torch.hypot(k[..., :half], k[..., half : 2 * half])  # (b, h_kv, t, d/2)
    return torch.cat([magnitudes, k, v], dim=-1)


@dataclass(frozen=True, repr=False, eq=False)  # tensors: compared by identity
class SurrogateWeights:
    """Fitted linear maps of one model: ``weight[i] @ features + bias[i]`` is the log reconstruction score of an
    entry of layer ``layers[i]``, per KV head.

    Parameters
    ----------
    weight
        (L, h_kv, F) float32.
    bias
        (L, h_kv) float32.
    layers
        The layer index of each of the L maps (the model's compressible layers).
    fingerprint
        ``model_fingerprint`` of the model the maps were fitted on.
    card
        What the training wrote about itself (text, sizes, fit figures); saved beside the weights as JSON.
    """

    weight: torch.Tensor
    bias: torch.Tensor
    layers: tuple[int, ...]
    fingerprint: str
    card: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        maps, h_kv, _ = self.weight.shape
        if self.bias.shape != (maps, h_kv) or len(self.layers) != maps:
            raise SurrogateError(
                f"surrogate weights of shape {tuple(self.weight.shape)} need biases (L, h_kv) = {(maps, h_kv)} and "
                f"{maps} layer indices, got {tuple(self.bias.shape)} and {len(self.layers)}"
            )

    def __repr__(self) -> str:  # part of the scorer's repr, the memo key of its scores: short, and names the fit
        return f"SurrogateWeights(fingerprint={self.fingerprint!r}, layers={len(self.layers)})"

    def save(self, path: str | Path) -> Path:
        """Write the maps to ``path`` (safetensors) and the card beside it (same name, ``.json``); returns path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {
            "weight": self.weight.float().contiguous(),
            "bias": self.bias.float().contiguous(),
            "layers": torch.tensor(self.layers, dtype=torch.int64),
        }
        # one metadata entry: safetensors writes several in a random order, and a training run must give the same bytes
        save_file(tensors, str(path), metadata={_METADATA: json.dumps(self._header(), sort_keys=True)})
        path.with_suffix(".json").write_text(json.dumps(self.card, indent=2, sort_keys=True) + "\n")
        return path

    def _header(self) -> dict[str, str]:
        return {"fingerprint": self.fingerprint, "features": FEATURES}

    @classmethod
    def load(cls, path: str | Path) -> SurrogateWeights:
        """The maps saved at ``path`` by ``save`` (its card too, when the JSON file is beside it)."""
        path = Path(path)
        if not path.is_file():
            raise SurrogateError(f"no surrogate scorer at {path}; train one with: {TRAIN_COMMAND}")
        try:
            with safe_open(str(path), framework="pt") as file:
                metadata = json.loads((file.metadata() or {})[_METADATA])
                tensors = {name: file.get_tensor(name) for name in ("weight", "bias", "layers")}
        except Exception as error:  # safetensors raises its own types for a truncated or foreign file
            raise SurrogateError(f"{path} is not a surrogate scorer file ({type(error).__name__}: {error})") from None
        if metadata.get("features") != FEATURES:
            raise SurrogateError(
                f"{path} holds maps over features {metadata.get('features')!r}; this version reads {FEATURES!r}: "
                f"train it again with: {TRAIN_COMMAND}"
            )
        card_path = path.with_suffix(".json")
        card = json.loads(card_path.read_text()) if card_path.is_file() else {}
        return cls(
            tensors["weight"].float(),
            tensors["bias"].float(),
            tuple(int(i) for i in tensors["layers"].tolist()),
            metadata.get("fingerprint", ""),
            card,
        )

    def check(self, model: nn.Module, fingerprint: str | None = None) -> None:
        """Refuse a model these maps were not fitted on (another fingerprint)."""
        fingerprint = fingerprint or model_fingerprint(model)
        if fingerprint != self.fingerprint:
            trained = self.card.get("model", {}).get("name", "another model")
            raise SurrogateError(
                f"this surrogate scorer was trained for {trained} (fingerprint {self.fingerprint}), not for this "
                f"model ({fingerprint}); train one for it with: {TRAIN_COMMAND}"
            )


def shipped_surrogates() -> list[Path]:
    """The surrogate files shipped with criticalkv (package data), sorted by name."""
    folder = resources.files("criticalkv.scorers") / "surrogates"
    if not folder.is_dir():  # an installation without any
        return []
    return sorted(Path(str(entry)) for entry in folder.iterdir() if entry.name.endswith(".safetensors"))


def shipped_for(model: nn.Module, fingerprint: str | None = None) -> SurrogateWeights:
    """The shipped surrogate fitted on ``model`` (matched by fingerprint); a clear error when none is."""
    fingerprint = fingerprint or model_fingerprint(model)
    for path in shipped_surrogates():
        weights = SurrogateWeights.load(path)
        if weights.fingerprint == fingerprint:
            return weights
    name = getattr(model, "name_or_path", "") or type(model).__name__
    raise SurrogateError(
        f"no surrogate scorer ships for this model ({name}, fingerprint {fingerprint}); train one with: "
        f"{TRAIN_COMMAND}, then pass weights=<file> (e.g. --method 'surrogate:weights=<file>')"
    )


@dataclass(repr=False)
class SurrogateScorer(Scorer):
    """Question-agnostic scores predicted from each entry's key and value by a per-layer, per-head linear map fitted
    to the reconstruction scorer's log-scores (``SurrogateWeights``); no pass beyond the prefill.

    Scores are ``exp`` of the prediction, so like the reconstruction scores they are positive and comparable
    across layers and heads (the cross-layer ranking of ``layer-surrogate``). The first ``sinks`` real tokens of
    each row are protected, as the reconstruction scorer protects them.

    Parameters
    ----------
    weights
        The fitted maps, or None to use the one shipped for the model, found by its fingerprint when the scorer
        is installed (``check_model``); a model without one is refused with the command that trains one.
    sinks
        First tokens of each row always kept.
    """

    non_negative: ClassVar[bool] = True  # exp of a prediction (Scorer)

    weights: SurrogateWeights | None = None
    sinks: int = 4
    # attention module -> its (h_kv, F) map and (h_kv,) bias, set by check_model for the model being compressed
    _maps: weakref.WeakKeyDictionary = field(
        default_factory=weakref.WeakKeyDictionary, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")

    def __repr__(self) -> str:  # the memo key of its scores: the options that change them
        return f"SurrogateScorer(weights={self.weights!r}, sinks={self.sinks})"

    def check_model(self, model: nn.Module) -> None:
        """Find (or check) the maps for ``model`` before any forward, and attach each to its attention layer."""
        fingerprint = model_fingerprint(model)
        weights = self.weights if self.weights is not None else shipped_for(model, fingerprint)
        weights.check(model, fingerprint)
        position = {layer: i for i, layer in enumerate(weights.layers)}
        for module in attention_modules(model):
            if module.layer_idx in position:
                i = position[module.layer_idx]
                self._maps[module] = (weights.weight[i], weights.bias[i])

    def score(self, view: LayerView) -> torch.Tensor:
        maps = self._maps.get(view.module)
        if maps is None:
            raise SurrogateError(
                f"the surrogate scorer has no map for layer {view.module.layer_idx} of this model: it is attached "
                "when a compressor is installed (criticalkv.compress, ContextSession, SharedPrefill)"
            )
        weight, bias = maps  # (h_kv, F), (h_kv,)
        h_kv = view.keys.shape[1]
        if weight.shape[0] != h_kv:
            raise SurrogateError(f"the surrogate map has {weight.shape[0]} KV heads, the layer {h_kv}")
        features = surrogate_features(view.keys, view.values)  # (b, h_kv, t, F)
        weight = weight.to(features.device)
        log_scores = torch.einsum("bhtf,hf->bht", features, weight) + bias.to(features.device)[None, :, None]
        return log_scores.clamp_(max=_LOG_CEILING).exp_()  # (b, h_kv, t) float32

    def protected(self, view: LayerView) -> torch.Tensor:
        start = view.valid.shape[1] - view.lengths  # (b,) first real position under left padding
        pos = torch.arange(view.valid.shape[1], device=view.valid.device)
        return (pos[None, :] >= start[:, None]) & (pos[None, :] < start[:, None] + self.sinks)
