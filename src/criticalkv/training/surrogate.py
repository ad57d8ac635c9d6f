"""Fit the surrogate of the reconstruction scorer (``criticalkv.scorers.surrogate``) to a model.

Windows of training text, some of each fitted context length, are prefilled under the reconstruction scorer
(KVzip's passes over the finished prefill); each layer's keys, values and true scores are folded into one
least-squares problem per layer, KV head and length (the target: the log of the score, the space rankings live in;
the sinks the scorer protects left out), solved in closed form with a small ridge: one map per length, fitted on
that length's windows alone. Held-out windows of each length, from another part of the text, then measure the fit:
per layer, the rank correlation of the predicted with the true scores and the overlap of the entries each keeps at
a budget. Everything is seeded and accumulated in float64 in a fixed order, so two runs write the same bytes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from criticalkv.errors import CriticalKVError
from criticalkv.methods import Method
from criticalkv.models.fingerprint import architecture_of, model_fingerprint
from criticalkv.progress import step_progress
from criticalkv.runtime.session import ContextSession
from criticalkv.scorers.base import PrefillContext
from criticalkv.scorers.reconstruct import ReconstructionScorer
from criticalkv.scorers.surrogate import (
    FEATURES,
    SurrogateWeights,
    length_mix,
    place_features,
    surrogate_features,
)
from criticalkv.training.text import TrainingText, kjv_text

SCORE_FLOOR = 1e-7  # log-scores below log(1e-7) are all "never attended"; the floor keeps log finite
DEFAULT_LENGTHS = (512, 768, 1024, 1536, 2048, 3072, 4096)  # steps of about sqrt(2): one map fits only near its length
HELD_OUT_SHARE = 0.2  # the text's last fifth (most of the New Testament) is held out, the rest trains
_CHARS_PER_TOKEN = 8  # characters read per wanted token: English runs at about 4 per token in these tokenizers


@dataclass(frozen=True)
class TrainingOptions:
    """What a training run reads and how it fits.

    Parameters
    ----------
    windows
        Training windows (prefills) of each length.
    held_out
        Held-out windows of each length, the fit figures are measured on.
    lengths
        The context lengths (tokens per window) a map is fitted at, increasing; contexts between two are scored by
        their maps mixed (``criticalkv.scorers.surrogate.length_mix``).
    seed
        Seed of the windows' positions in the text.
    ridge
        Ridge penalty, relative to the mean diagonal of each head's feature Gram matrix (the bias is not
        penalised).
    budget
        Kept fraction at which the held-out overlap of kept sets is measured.
    chunk_size
        The reconstruction scorer's chunk size (the scores the surrogate learns).
    """

    windows: int = 2
    held_out: int = 1
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    seed: int = 0
    ridge: float = 1e-3
    budget: float = 0.2
    chunk_size: int = 2048

    def __post_init__(self) -> None:
        for name in ("windows", "held_out", "chunk_size"):
            if getattr(self, name) < 1:
                raise CriticalKVError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lengths or min(self.lengths) < 16 or list(self.lengths) != sorted(set(self.lengths)):
            raise CriticalKVError(f"lengths must be distinct, increasing and >= 16 tokens, got {self.lengths}")
        if self.ridge < 0:
            raise CriticalKVError(f"ridge must be >= 0, got {self.ridge}")
        if not 0 < self.budget < 1:
            raise CriticalKVError(f"budget must be in (0, 1), got {self.budget}")


@dataclass
class LayerSample:
    """One layer of one prefill (batch of one): keys, values (h_kv, t, d), true scores (h_kv, t) and the positions
    the reconstruction scorer protects (t,) bool."""

    layer: int
    keys: torch.Tensor
    values: torch.Tensor
    scores: torch.Tensor
    protected: torch.Tensor


@dataclass(repr=False)
class _RecordingReconstruction(ReconstructionScorer):
    """The reconstruction scorer, keeping each layer's keys, values and scores as it hands them to the method."""

    samples: list[LayerSample] = field(default_factory=list, init=False)

    def score_after_prefill(self, context: PrefillContext) -> list[torch.Tensor]:
        scores = super().score_after_prefill(context)
        if context.input_ids.shape[0] != 1:
            raise CriticalKVError("training prefills one window at a time")
        t = context.input_ids.shape[1]
        for item, layer_scores in zip(context.pending, scores, strict=True):
            protected = self.protected(item.view)
            self.samples.append(
                LayerSample(
                    item.view.module.layer_idx,
                    item.layer.keys[0, :, :t].clone(),
                    item.layer.values[0, :, :t].clone(),
                    layer_scores[0].clone(),
                    protected[0].clone(),
                )
            )
        return scores


def window_ids(
    tokenizer: PreTrainedTokenizerBase, text: str, count: int, tokens: int, generator: torch.Generator
) -> list[torch.Tensor]:
    """``count`` windows of ``tokens`` token ids (1, tokens), each from a line start at a seeded place in ``text``."""
    span = tokens * _CHARS_PER_TOKEN
    if len(text) <= span:
        raise CriticalKVError(f"the text ({len(text)} characters) is too short for windows of {tokens} tokens")
    windows = []
    for _ in range(count):
        start = int(torch.randint(0, len(text) - span, (1,), generator=generator))
        start = text.find("\n", start) + 1  # a window starts at a verse, not inside a word
        ids = tokenizer(text[start : start + span], add_special_tokens=False)["input_ids"][:tokens]
        if len(ids) < tokens:
            raise CriticalKVError(f"a window of the text holds {len(ids)} tokens, fewer than {tokens}")
        windows.append(torch.tensor([ids]))
    return windows


def split_text(text: str) -> tuple[str, str]:
    """``text`` cut in two: the first ``1 - HELD_OUT_SHARE`` of its characters train, the rest is held out."""
    split = int(len(text) * (1 - HELD_OUT_SHARE))
    return text[:split], text[split:]


def split_windows(
    tokenizer: PreTrainedTokenizerBase, text: str, options: TrainingOptions
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The seeded training windows from the training part of ``text`` and the held-out ones from the rest
    (``split_text``): ``options.windows`` and ``options.held_out`` of each length, each (1, length), shortest first."""
    training, held_out = split_text(text)
    generator = torch.Generator().manual_seed(options.seed)
    train = [ids for n in options.lengths for ids in window_ids(tokenizer, training, options.windows, n, generator)]
    held = [ids for n in options.lengths for ids in window_ids(tokenizer, held_out, options.held_out, n, generator)]
    return train, held


def collect(model: PreTrainedModel, ids: torch.Tensor, scorer: ReconstructionScorer) -> list[LayerSample]:
    """Each compressible layer's keys, values and reconstruction scores for the prefill of ``ids`` (1, t)."""
    recorder = _RecordingReconstruction(scorer.chunk_size, scorer.query_stride, scorer.sinks, scorer.tokenizer)
    ContextSession(model, Method(recorder), 0.5).prefill(ids)  # any budget below 1.0: a 1.0 installs no compressor
    if not recorder.samples:
        raise CriticalKVError("the prefill ran no reconstruction passes: no layer of this model is compressible")
    return recorder.samples


def design_rows(sample: LayerSample) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows the fit reads: features with a trailing 1 (h_kv, n, F+1) float64, log-scores (h_kv, n) float64."""
    free = ~sample.protected  # (t,)
    valid = torch.ones(1, sample.keys.shape[1], dtype=torch.bool)  # one window, no padding
    place = place_features(valid)  # (1, t, 3)
    features = surrogate_features(sample.keys[None], sample.values[None], place)[0][:, free]  # (h_kv, n, F)
    ones = features.new_ones(*features.shape[:2], 1)
    target = sample.scores[:, free].clamp(min=SCORE_FLOOR).log()
    return torch.cat([features, ones], dim=-1).double(), target.double()


@dataclass
class NormalEquations:
    """Per layer, context length and KV head, X^T X and X^T y of every row seen, in float64."""

    gram: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (layer, length) -> (h_kv, F+1, F+1)
    moment: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (layer, length) -> (h_kv, F+1)
    rows: int = 0

    def add(self, sample: LayerSample) -> None:
        self.add_rows(sample.layer, sample.keys.shape[1], *design_rows(sample))

    def add_rows(self, layer: int, length: int, x: torch.Tensor, y: torch.Tensor) -> None:
        """Fold rows x (h_kv, n, F+1) float64, the last column ones, and targets y (h_kv, n) of a window of
        ``length`` tokens into the sums of ``layer`` at that length."""
        gram = x.transpose(1, 2) @ x
        moment = (x.transpose(1, 2) @ y[..., None])[..., 0]
        key = (layer, length)
        if key in self.gram:
            self.gram[key] += gram
            self.moment[key] += moment
        else:
            self.gram[key], self.moment[key] = gram, moment
        self.rows += y.numel()

    def solve(self, ridge: float) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...], tuple[int, ...]]:
        """Weights (L, h_kv, K, F) and biases (L, h_kv, K) float32 of the ridge fits, the L layers and the K lengths
        in order; every layer needs rows at every length."""
        layers = tuple(sorted({layer for layer, _ in self.gram}))
        lengths = tuple(sorted({length for _, length in self.gram}))
        missing = [(layer, n) for layer in layers for n in lengths if (layer, n) not in self.gram]
        if missing:
            raise CriticalKVError(
                f"no rows for (layer, length) {missing[:3]}: every layer needs windows of every length"
            )
        weights, biases = [], []
        for layer in layers:
            solutions = [self._ridge(self.gram[layer, n], self.moment[layer, n], ridge) for n in lengths]
            solution = torch.stack(solutions, dim=1)  # (h_kv, K, F+1)
            weights.append(solution[..., :-1].float())
            biases.append(solution[..., -1].float())
        return torch.stack(weights), torch.stack(biases), layers, lengths

    @staticmethod
    def _ridge(gram: torch.Tensor, moment: torch.Tensor, ridge: float) -> torch.Tensor:
        """(h_kv, F+1) solution of (X^T X + penalty) w = X^T y, the penalty ``ridge`` times the mean diagonal of
        each head's feature Gram matrix on every weight but the bias (the last)."""
        f = gram.shape[-1] - 1
        scale = gram[:, torch.arange(f), torch.arange(f)].mean(dim=-1)  # (h_kv,)
        penalty = torch.zeros_like(gram)
        penalty[:, torch.arange(f), torch.arange(f)] = ridge * scale[:, None]
        return torch.linalg.solve(gram + penalty, moment[..., None])[..., 0]


def spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rank correlation along the last dimension of a and b (..., n) (ties ranked by position; float64)."""
    ranks_a = a.argsort(dim=-1).argsort(dim=-1).double()
    ranks_b = b.argsort(dim=-1).argsort(dim=-1).double()
    ranks_a -= ranks_a.mean(dim=-1, keepdim=True)
    ranks_b -= ranks_b.mean(dim=-1, keepdim=True)
    return (ranks_a * ranks_b).sum(-1) / (ranks_a.square().sum(-1) * ranks_b.square().sum(-1)).sqrt()


def kept_overlap(predicted: torch.Tensor, true: torch.Tensor, fraction: float) -> torch.Tensor:
    """Share of the ``fraction`` best entries by ``true`` that ``predicted`` keeps too, along the last dimension."""
    k = max(1, round(fraction * true.shape[-1]))
    keep_true = torch.zeros_like(true, dtype=torch.bool).scatter_(-1, true.topk(k, dim=-1).indices, True)
    keep_predicted = torch.zeros_like(true, dtype=torch.bool).scatter_(-1, predicted.topk(k, dim=-1).indices, True)
    return (keep_true & keep_predicted).sum(-1).double() / k


@dataclass
class HeldOutFit:
    """Held-out figures of a fitted surrogate, summed over windows (``add`` one window's samples at a time) per
    context length: per layer, over its heads; and over every layer at once. ``figures`` averages them."""

    spearman: dict[int, dict[int, float]] = field(default_factory=dict)  # length -> layer -> sum over windows
    overlap: dict[int, dict[int, float]] = field(default_factory=dict)  # length -> layer -> sum over windows
    cross_layer_overlap: dict[int, float] = field(default_factory=dict)  # length -> sum over windows
    windows: dict[int, int] = field(default_factory=dict)  # length -> windows

    def add(self, samples: list[LayerSample], weights: SurrogateWeights, budget: float) -> None:
        position = {layer: i for i, layer in enumerate(weights.layers)}
        n = samples[0].keys.shape[1]
        mix = length_mix(torch.tensor([n]), weights.lengths)  # (1, K): the maps a prefill of n tokens uses
        spearman_sums, overlap_sums = self.spearman.setdefault(n, {}), self.overlap.setdefault(n, {})
        predicted_all, true_all = [], []
        for sample in samples:
            x, y = design_rows(sample)  # (h_kv, n, F+1), (h_kv, n)
            predicted = weights.predict(position[sample.layer], x[None, ..., :-1].float(), mix)[0].double()
            layer = sample.layer
            spearman_sums[layer] = spearman_sums.get(layer, 0.0) + float(spearman(predicted, y).mean())
            overlap_sums[layer] = overlap_sums.get(layer, 0.0) + float(kept_overlap(predicted, y, budget).mean())
            predicted_all.append(predicted.reshape(-1))
            true_all.append(y.reshape(-1))
        cross = float(kept_overlap(torch.cat(predicted_all), torch.cat(true_all), budget))
        self.cross_layer_overlap[n] = self.cross_layer_overlap.get(n, 0.0) + cross
        self.windows[n] = self.windows.get(n, 0) + 1

    def figures(self, budget: float) -> dict[str, object]:
        """Mean figures over the lengths, and per length (``by_length``) with each layer's."""
        by_length = {}
        for n in sorted(self.windows):
            count, spearman_sums, overlap_sums = self.windows[n], self.spearman[n], self.overlap[n]
            by_length[str(n)] = {
                "windows": count,
                "mean_spearman": round(sum(spearman_sums.values()) / count / len(spearman_sums), 4),
                "mean_overlap": round(sum(overlap_sums.values()) / count / len(overlap_sums), 4),
                "cross_layer_overlap": round(self.cross_layer_overlap[n] / count, 4),
                "per_layer": {
                    str(layer): {
                        "spearman": round(spearman_sums[layer] / count, 4),
                        "overlap": round(overlap_sums[layer] / count, 4),
                    }
                    for layer in sorted(spearman_sums)
                },
            }
        means = {
            name: round(sum(fit[name] for fit in by_length.values()) / len(by_length), 4)
            for name in ("mean_spearman", "mean_overlap", "cross_layer_overlap")
        }
        return {"windows": sum(self.windows.values()), "budget": budget, **means, "by_length": by_length}


def train_surrogate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    text: TrainingText,
    options: TrainingOptions,
    model_name: str,
    progress: bool = True,
) -> SurrogateWeights:
    """Fit the surrogate of the reconstruction scorer to ``model`` on ``text`` (see the module notes); the card
    names the model, the text and its licence, the sizes and the held-out fit figures."""
    train_windows, held_out_windows = split_windows(tokenizer, text.text, options)
    reference = ReconstructionScorer(chunk_size=options.chunk_size, tokenizer=tokenizer)
    equations = NormalEquations()
    fit = HeldOutFit()
    with step_progress("train-scorer", len(train_windows) + len(held_out_windows), enabled=progress) as advance:
        for index, ids in enumerate(train_windows):
            for sample in collect(model, ids, reference):
                equations.add(sample)
            advance(f"training window {index + 1}/{len(train_windows)} ({ids.shape[1]} tokens)")
        weight, bias, layers, lengths = equations.solve(options.ridge)
        fingerprint = model_fingerprint(model)
        weights = SurrogateWeights(weight, bias, layers, fingerprint, lengths)
        for index, ids in enumerate(held_out_windows):
            fit.add(collect(model, ids, reference), weights, options.budget)
            advance(f"held-out window {index + 1}/{len(held_out_windows)} ({ids.shape[1]} tokens)")
    card = {
        "scorer": (
            "surrogate of the reconstruction scorer (KVzip): per layer, KV head and fitted context length, "
            "log score = w . features + b; between two fitted lengths the maps mix linearly in log length"
        ),
        "features": FEATURES,
        "target": f"log(max(reconstruction score, {SCORE_FLOOR}))",
        "model": {"name": model_name, "fingerprint": fingerprint, "architecture": architecture_of(model.config)},
        "text": {**text.describe(), "held_out": f"the last {HELD_OUT_SHARE:.0%} of the characters"},
        "training": {
            "lengths": list(lengths),
            "windows_per_length": options.windows,
            "held_out_windows_per_length": options.held_out,
            "rows": equations.rows,
            "seed": options.seed,
            "ridge": options.ridge,
            "reconstruction": {"chunk_size": options.chunk_size, "query_stride": 1, "sinks": reference.sinks},
            "windows_sha256": _windows_digest(train_windows + held_out_windows),
        },
        "sizes": {
            "layers": len(layers),
            "kv_heads": int(weight.shape[1]),
            "lengths": len(lengths),
            "features": int(weight.shape[-1]),
            "parameters": weight.numel() + bias.numel(),
        },
        "held_out_fit": fit.figures(options.budget),
    }
    return SurrogateWeights(weight, bias, layers, fingerprint, lengths, card)


def _windows_digest(windows: list[torch.Tensor]) -> str:
    """sha256 of the windows' token ids, so a card says which exact text it was fitted on."""
    digest = hashlib.sha256()
    for ids in windows:
        digest.update(ids.to(torch.int64).numpy().tobytes())
    return digest.hexdigest()


def train_and_save(
    model_name: str, out: Path, options: TrainingOptions, device: str = "cpu", dtype: str = "float32"
) -> SurrogateWeights:
    """Load ``model_name`` (a preset or a folder), fit its surrogate on the King James text and save it to ``out``
    (safetensors, and the card beside it as JSON)."""
    from criticalkv.models.loading import load_model

    text = kjv_text()  # before minutes of model loading: a missing text package fails now
    model, tokenizer = load_model(model_name, dtype=dtype, device=device)
    weights = train_surrogate(model, tokenizer, text, options, model_name)
    weights.save(out)
    return weights
