"""A learned surrogate of the reconstruction scorer (after KVzap): per layer and KV head, a linear map from what the
prefill already holds, each entry's key, value and place in the context, to the logarithm of the score KVzip's
reconstruction passes would give it. Scoring costs a few small products per layer and no forward pass, so the
question-agnostic presets run at about the price of a plain prefill.

The features of an entry (``surrogate_features``) are its key's RoPE pair magnitudes, which the rotation leaves
unchanged; its key as cached (the slow pairs hardly turn over a few thousand positions and keep their direction);
its value; and three of its place: its position p among the n entries of its row as p/n, log(1+p) and log(n-p).
(Each map is fitted at one length, so n itself would only repeat the bias.)

A map fitted on contexts of one length ranks the entries of other lengths badly (docs/results.md), so the maps come
in a set, one per fitted context length (``SurrogateWeights.lengths``), and a row of n entries is scored by the map
interpolated linearly in log n between the two fitted lengths around n (the first or last below or above them).
``criticalkv train-scorer`` fits the maps (``criticalkv.training.surrogate``); fitted maps ship for the preset
models and are found by the model's fingerprint (``criticalkv.models.fingerprint``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
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

FEATURES = "rope-pair-magnitudes+keys+values+place/v2"  # the feature layout the weights are fitted on
PLACE_FEATURES = 3  # p/n, log(1+p), log(n-p)
TRAIN_COMMAND = "criticalkv train-scorer --model <preset or folder> --out <file>.safetensors"
_METADATA = "criticalkv-surrogate"  # the safetensors metadata key of the header (fingerprint, features)
_LOG_CEILING = 40.0  # predicted log-scores beyond this would overflow float32 in exp; real ones are <= 0


class SurrogateError(CriticalKVError):
    """A surrogate scorer that is missing for a model, trained for another model, or malformed."""


def feature_count(head_dim: int) -> int:
    """Features per entry: d/2 pair magnitudes, the d key and d value components, and ``PLACE_FEATURES``."""
    return head_dim // 2 + 2 * head_dim + PLACE_FEATURES


def place_features(valid: torch.Tensor) -> torch.Tensor:
    """(b, t, 3) float32: for each entry its position p among the n real entries of its row (``valid`` (b, t) bool,
    False on padding) as p/n, log(1+p) and log(n-p). Padding gets the features of its row's next entry."""
    n = valid.sum(-1, keepdim=True)  # (b, 1)
    return _place(valid.cumsum(-1) - 1, n)


def prompt_place_features(places: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """(b, h_kv, t, 3) float32: ``place_features`` of entries that stand at ``places`` (b, h_kv, t) long among their
    row's ``seen`` (b,) real tokens (a cache compressed again: ``LayerView.places``)."""
    return _place(places, seen[:, None, None])


def _place(p: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """(..., 3) float32: p/n, log(1+p) and log(n-p) of positions ``p`` (clamped at 0) among ``n`` (broadcast)."""
    n, p = n.clamp(min=1).float(), p.clamp(min=0).float()
    return torch.stack([p / n, p.log1p(), (n - p).clamp(min=1).log()], dim=-1)


def key_value_features(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """(..., d/2 + 2d) float32: each entry's key pair magnitudes, key and value, from keys and values (..., d).

    RoPE (transformers' rotate-half layout) turns component i with component i + d/2 by the position's angle, so
    the length of each such pair is the same at every position.
    """
    k, v = keys.float(), values.float()
    half = k.shape[-1] // 2
    return torch.cat([torch.hypot(k[..., :half], k[..., half : 2 * half]), k, v], dim=-1)


def surrogate_features(keys: torch.Tensor, values: torch.Tensor, place: torch.Tensor) -> torch.Tensor:
    """(b, h_kv, t, F) float32 features from keys and values (b, h_kv, t, d) and the rows' ``place_features``
    (b, t, 3), the same for every head, or each head's (b, h_kv, t, 3); F = ``feature_count(d)``:
    ``key_value_features`` and the place."""
    place = place.to(keys.device)
    if place.dim() == 3:
        place = place[:, None].expand(-1, keys.shape[1], -1, -1)  # (b, h_kv, t, 3)
    return torch.cat([key_value_features(keys, values), place], dim=-1)


def length_mix(lengths: torch.Tensor, fitted: tuple[int, ...]) -> torch.Tensor:
    """(b, K) float32 weights of the K maps fitted at context lengths ``fitted`` (increasing) for rows of
    ``lengths`` (b,) entries: linear in log length between the two fitted lengths around each row's (one map
    alone at a fitted length), the first or last map alone below or above them. Rows sum to 1."""
    knots = torch.tensor([math.log(n) for n in fitted], dtype=torch.float64, device=lengths.device)  # (K,)
    x = lengths.double().clamp(min=fitted[0], max=fitted[-1]).log()  # (b,)
    mix = torch.zeros(lengths.shape[0], len(fitted), dtype=torch.float64, device=lengths.device)
    if len(fitted) == 1:
        return mix.fill_(1.0).float()
    upper = torch.searchsorted(knots, x, right=True).clamp(1, len(fitted) - 1)  # (b,)
    lower = upper - 1
    share = (x - knots[lower]) / (knots[upper] - knots[lower])  # (b,) in [0, 1]
    mix.scatter_(1, lower[:, None], (1 - share)[:, None])
    mix.scatter_add_(1, upper[:, None], share[:, None])
    return mix.float()


@dataclass(frozen=True, repr=False, eq=False)  # tensors: compared by identity
class SurrogateWeights:
    """Fitted linear maps of one model: for a row of n entries, ``w @ features + b`` is the log reconstruction score
    of an entry of layer ``layers[i]``, per KV head, where w and b mix the K maps ``weight[i, :, k]`` and
    ``bias[i, :, k]`` fitted at context lengths ``lengths`` by ``length_mix(n, lengths)``.

    Parameters
    ----------
    weight
        (L, h_kv, K, F) float32.
    bias
        (L, h_kv, K) float32.
    layers
        The layer index of each of the L maps (the model's compressible layers).
    fingerprint
        ``model_fingerprint`` of the model the maps were fitted on.
    lengths
        The K context lengths the maps were fitted at, increasing.
    card
        What the training wrote about itself (text, sizes, fit figures); saved beside the weights as JSON.
    """

    weight: torch.Tensor
    bias: torch.Tensor
    layers: tuple[int, ...]
    fingerprint: str
    lengths: tuple[int, ...]
    card: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.weight.dim() != 4:
            raise SurrogateError(f"surrogate weights are (L, h_kv, K, F), got shape {tuple(self.weight.shape)}")
        maps, h_kv, fits, _ = self.weight.shape
        if self.bias.shape != (maps, h_kv, fits) or len(self.layers) != maps or len(self.lengths) != fits:
            raise SurrogateError(
                f"surrogate weights of shape {tuple(self.weight.shape)} need biases (L, h_kv, K) = "
                f"{(maps, h_kv, fits)}, {maps} layer indices and {fits} lengths, got {tuple(self.bias.shape)}, "
                f"{len(self.layers)} and {len(self.lengths)}"
            )
        if any(a >= b for a, b in zip(self.lengths, self.lengths[1:])) or min(self.lengths) < 1:
            raise SurrogateError(f"the fitted lengths must increase from >= 1, got {self.lengths}")

    def __repr__(self) -> str:  # part of the scorer's repr, the memo key of its scores: short, and names the fit
        return f"SurrogateWeights(fingerprint={self.fingerprint!r}, digest={self.digest!r})"

    @functools.cached_property
    def digest(self) -> str:
        """A short hash of the maps (weights, biases, layers and lengths): two fits differ in it."""
        hashed = hashlib.sha256()
        for tensor in (self.weight, self.bias):
            hashed.update(tensor.float().contiguous().numpy().tobytes())
        hashed.update(repr((self.layers, self.lengths)).encode())
        return hashed.hexdigest()[:12]

    def predict(self, index: int, features: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
        """(b, h_kv, t) float32 log-scores by the maps of ``layers[index]`` for features (b, h_kv, t, F), the K maps
        mixed per row by ``mix`` (b, K) (``length_mix`` of the rows' lengths)."""
        mix = mix.to(features.device)
        weight = torch.einsum("bk,hkf->bhf", mix, self.weight[index].to(features.device))  # (b, h_kv, F)
        bias = torch.einsum("bk,hk->bh", mix, self.bias[index].to(features.device))  # (b, h_kv)
        return torch.einsum("bhtf,bhf->bht", features, weight) + bias[..., None]

    def save(self, path: str | Path) -> Path:
        """Write the maps to ``path`` (safetensors) and the card beside it (same name, ``.json``); returns path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {
            "weight": self.weight.float().contiguous(),
            "bias": self.bias.float().contiguous(),
            "layers": torch.tensor(self.layers, dtype=torch.int64),
            "lengths": torch.tensor(self.lengths, dtype=torch.int64),
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
                if metadata.get("features") != FEATURES:
                    raise SurrogateError(
                        f"{path} holds maps over features {metadata.get('features')!r}; this version reads "
                        f"{FEATURES!r}: train it again with: {TRAIN_COMMAND}"
                    )
                tensors = {name: file.get_tensor(name) for name in ("weight", "bias", "layers", "lengths")}
        except SurrogateError:
            raise
        except Exception as error:  # safetensors raises its own types for a truncated or foreign file
            raise SurrogateError(f"{path} is not a surrogate scorer file ({type(error).__name__}: {error})") from None
        card_path = path.with_suffix(".json")
        card = json.loads(card_path.read_text()) if card_path.is_file() else {}
        return cls(
            tensors["weight"].float(),
            tensors["bias"].float(),
            tuple(int(i) for i in tensors["layers"].tolist()),
            metadata.get("fingerprint", ""),
            tuple(int(n) for n in tensors["lengths"].tolist()),
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


@functools.cache
def shipped_digest() -> str:
    """A short hash of every shipped surrogate file (read once per process): the shipped maps changed, so did it."""
    hashed = hashlib.sha256()
    for path in shipped_surrogates():
        hashed.update(path.name.encode() + path.read_bytes())
    return hashed.hexdigest()[:12]


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
    place
        Where an entry stands, for a cache compressed again (a chunked prefill, compression while decoding):
        ``"prompt"`` (the default), its place among the prompt's tokens seen so far, with the maps mixed for that
        many, as a one-shot compression places it, where the runtime knows it (``LayerView.places``; a file saved
        before places were kept is placed by rank); ``"held"``, its
        rank among the entries held (the kept ones, then the chunk) and the maps mixed for that many entries. The
        same in a one-shot compression.
    """

    non_negative: ClassVar[bool] = True  # exp of a prediction (Scorer)

    weights: SurrogateWeights | None = None
    sinks: int = 4
    place: str = "prompt"
    # attention module -> the maps and the index of its layer in them, set by check_model
    _maps: weakref.WeakKeyDictionary = field(
        default_factory=weakref.WeakKeyDictionary, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")
        if self.place not in ("held", "prompt"):
            raise ValueError(f"place must be 'held' or 'prompt', got {self.place!r}")

    @property
    def reads_places(self) -> bool:  # Scorer: with place="prompt", the runtime follows where kept entries stand
        return self.place == "prompt"

    def __repr__(self) -> str:  # the memo key of its scores and a sweep's record of the method: what changes them
        weights = self.weights if self.weights is not None else f"shipped:{shipped_digest()}"
        place = "" if self.place == "prompt" else f", place={self.place}"  # a one-shot folder's record unchanged
        return f"SurrogateScorer(weights={weights}, sinks={self.sinks}{place})"

    def check_model(self, model: nn.Module) -> None:
        """Find (or check) the maps for ``model`` before any forward, and attach each to its attention layer."""
        fingerprint = model_fingerprint(model)
        weights = self.weights if self.weights is not None else shipped_for(model, fingerprint)
        weights.check(model, fingerprint)
        position = {layer: i for i, layer in enumerate(weights.layers)}
        for module in attention_modules(model):
            if module.layer_idx in position:
                i = position[module.layer_idx]
                self._maps[module] = (weights, i)

    def score(self, view: LayerView) -> torch.Tensor:
        maps = self._maps.get(view.module)
        if maps is None:
            raise SurrogateError(
                f"the surrogate scorer has no map for layer {view.module.layer_idx} of this model: it is attached "
                "when a compressor is installed (criticalkv.compress, ContextSession, SharedPrefill)"
            )
        weights, index = maps
        h_kv = view.keys.shape[1]
        if weights.weight.shape[1] != h_kv:
            raise SurrogateError(f"the surrogate map has {weights.weight.shape[1]} KV heads, the layer {h_kv}")
        if self.place == "prompt" and view.places is not None:
            place = prompt_place_features(view.places, view.seen)  # (b, h_kv, t, 3)
            mix = length_mix(view.seen, weights.lengths)  # (b, K)
        else:
            place = view.remember_for_prefill("surrogate place", lambda: place_features(view.valid))  # (b, t, 3)
            key = ("surrogate length mix", weights.lengths)
            mix = view.remember_for_prefill(key, lambda: length_mix(view.lengths, weights.lengths))  # (b, K)
        features = surrogate_features(view.keys, view.values, place)  # (b, h_kv, t, F)
        log_scores = weights.predict(index, features, mix)  # (b, h_kv, t)
        return log_scores.clamp_(max=_LOG_CEILING).exp_()  # (b, h_kv, t) float32

    def protected(self, view: LayerView) -> torch.Tensor:
        start = view.valid.shape[1] - view.lengths  # (b,) first real position under left padding
        pos = torch.arange(view.valid.shape[1], device=view.valid.device)
        return (pos[None, :] >= start[:, None]) & (pos[None, :] < start[:, None] + self.sinks)
