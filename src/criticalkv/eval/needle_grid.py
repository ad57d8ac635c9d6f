"""Needle-in-a-haystack grid (context lengths x needle depths) and its heatmap.

Each cell is one ``build_needle_sample``: one needle at a relative depth of an essay haystack of a
given length. Scores per cell are drawn the way this benchmark is usually shown: context length on x,
needle depth on y with 0 % at the top, a red-yellow-green colour scale from 0 to 100, each cell
annotated with its score.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LinearSegmentedColormap
from matplotlib.figure import Figure
from transformers import PreTrainedTokenizerBase

from criticalkv.errors import CriticalKVError
from criticalkv.eval.needle import NeedleSample, build_needle_sample

__all__ = ["NeedleCell", "needle_grid", "plot_heatmap"]

# The usual needle-in-a-haystack palette: red (missed) -> yellow -> green (found).
_CMAP = LinearSegmentedColormap.from_list("needle", ["#F0496E", "#EBB839", "#0CD79F"])


@dataclass(frozen=True)
class NeedleCell:
    """One cell of the grid: the requested context ``length`` (tokens), ``depth`` in [0, 1], its sample."""

    length: int
    depth: float
    sample: NeedleSample


def needle_grid(
    tokenizer: PreTrainedTokenizerBase, lengths: Sequence[int], depths: Sequence[float], seed: int = 0
) -> list[NeedleCell]:
    """One needle sample per (length, depth), lengths outer, depths inner.

    Parameters
    ----------
    tokenizer : PreTrainedTokenizerBase
        The model's tokenizer (context lengths are in its tokens, as in ``build_needle_sample``).
    lengths : sequence of int
        Context lengths in tokens (the haystack with its needle, without template and question).
    depths : sequence of float
        Needle depths in [0, 1]: 0 = first sentence, 1 = last.
    seed : int
        Cell ``i`` (in the order returned) uses seed ``seed + i``: each cell has its own key and value,
        and the same arguments give the same grid.

    Returns
    -------
    list of NeedleCell

    Raises
    ------
    CriticalKVError
        Empty or duplicate lengths or depths, a length <= 0 or not above the needle's own length, a depth
        outside [0, 1].
    """
    check_grid(lengths, depths)
    cells = []
    for length in lengths:
        for depth in depths:
            sample = build_needle_sample(tokenizer, length, depth=depth, seed=seed + len(cells))
            cells.append(NeedleCell(length=length, depth=depth, sample=sample))
    return cells


def check_grid(lengths: Sequence[int], depths: Sequence[float]) -> None:
    """What ``needle_grid`` refuses without a tokenizer (so a command can refuse it before loading a model): empty
    or repeated lengths or depths, a length <= 0, a depth outside [0, 1]."""
    if not lengths or not depths:
        raise CriticalKVError("needle_grid needs at least one length and one depth.")
    if len(set(lengths)) != len(lengths) or len(set(depths)) != len(depths):
        raise CriticalKVError("needle_grid: lengths and depths must not repeat.")
    for depth in depths:
        if not 0.0 <= depth <= 1.0:
            raise CriticalKVError(f"needle depths are fractions in [0, 1], got {depth}.")
    for length in lengths:
        if length <= 0:
            raise CriticalKVError(f"needle lengths must be positive, got {length}.")


def _length_label(length: int) -> str:
    if length >= 1024 and length % 1024 == 0:
        return f"{length // 1024}k"
    if length >= 1000 and length % 1000 == 0:
        return f"{length // 1000}k"
    return str(length)


def plot_heatmap(
    scores: Mapping[tuple[int, float], float], path: str | Path, title: str = "Needle in a haystack"
) -> Path:
    """Draw ``scores[(length, depth)]`` (0..100) as the usual needle-in-a-haystack heatmap, saved to ``path``.

    Context length on x (ascending), depth on y (0 % at the top), red (0) - yellow - green (100),
    each cell annotated with its score; cells missing from ``scores`` (or NaN) are left grey.
    The format follows ``path``'s suffix (``.png``, ``.pdf``, ``.svg``); parent folders are created.

    Returns
    -------
    Path
        ``path``.
    """
    if not scores:
        raise CriticalKVError("plot_heatmap needs at least one score.")
    for key, value in scores.items():
        if not (isinstance(key, tuple) and len(key) == 2):
            raise CriticalKVError(f"scores are keyed by (length, depth), got key {key!r}.")
        if not math.isnan(value) and not 0.0 <= value <= 100.0:
            raise CriticalKVError(f"scores are in [0, 100], got {value} at {key}.")
    lengths = sorted({length for length, _ in scores})
    depths = sorted({depth for _, depth in scores})
    grid = [[scores.get((length, depth), math.nan) for length in lengths] for depth in depths]

    width = max(4.0, 1.0 + 0.75 * len(lengths))
    height = max(3.0, 1.2 + 0.45 * len(depths))
    figure = Figure(figsize=(width + 1.6, height), dpi=120)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    cmap = _CMAP.with_extremes(bad="#D9D9D9")
    image = axes.imshow(grid, cmap=cmap, vmin=0, vmax=100, aspect="auto", interpolation="nearest")
    axes.set_xticks(range(len(lengths)), [_length_label(length) for length in lengths])
    axes.set_yticks(range(len(depths)), [f"{100 * depth:.0f}%" for depth in depths])
    axes.set_xlabel("Context length (tokens)")
    axes.set_ylabel("Needle depth")
    axes.set_title(title)
    axes.set_xticks([x - 0.5 for x in range(1, len(lengths))], minor=True)
    axes.set_yticks([y - 0.5 for y in range(1, len(depths))], minor=True)
    axes.grid(which="minor", color="white", linewidth=1.0)
    axes.tick_params(which="minor", length=0)
    for row, values in enumerate(grid):
        for column, value in enumerate(values):
            if not math.isnan(value):
                axes.text(column, row, f"{value:.0f}", ha="center", va="center", fontsize=8, color="#1A1A1A")
    colorbar = figure.colorbar(image, ax=axes, fraction=0.05, pad=0.03)
    colorbar.set_label("Score")
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path
