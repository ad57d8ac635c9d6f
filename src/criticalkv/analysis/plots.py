"""Figures of the output-perturbation analysis (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from criticalkv.palette import distinct_colours

__all__ = ["plot_hidden", "plot_layers", "plot_ratio_heatmap", "plot_ratio_histogram"]


def _columns(count: int) -> tuple[int, int]:
    cols = min(count, 3)
    return (count + cols - 1) // cols, cols


def plot_ratio_histogram(
    ratios: Mapping[str, np.ndarray],
    a: str,
    b: str,
    path: Path,
    headline: Mapping[str, Mapping[str, float]] | None = None,
    title: str = "",
) -> Path:
    """Histogram of per-head log10(B / A), one panel per budget. ``ratios[budget]`` holds any-shaped log ratios
    (NaN ignored); ``headline[budget]`` may hold ``fraction_b_lower`` and ``median_log10_ratio`` for the legend."""
    rows, cols = _columns(len(ratios))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, (budget, values) in zip(axes.flat, ratios.items(), strict=False):
        v = np.asarray(values, dtype=np.float64).ravel()
        v = v[np.isfinite(v)]
        if v.size:
            span = max(abs(np.quantile(v, 0.005)), abs(np.quantile(v, 0.995)), 1e-3)
            ax.hist(np.clip(v, -span, span), bins=60, range=(-span, span), color="tab:blue", alpha=0.85)
        ax.axvline(0.0, color="black", lw=1)
        text = f"budget {budget}"
        if headline and budget in headline:
            h = headline[budget]
            text += f"\nB lower on {100 * h['fraction_b_lower']:.1f}%\nmedian {h['median_log10_ratio']:+.3f}"
        ax.text(0.02, 0.97, text, transform=ax.transAxes, va="top", fontsize=8)
        ax.set_xlabel(f"log10({b} / {a})")
        ax.set_ylabel("heads")
    for ax in list(axes.flat)[len(ratios) :]:
        ax.axis("off")
    fig.suptitle(title or f"per-head output perturbation: {b} vs {a} (left of 0: {b} lower)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_layers(
    per_layer: Mapping[str, Mapping[str, Sequence[float]]],
    layers: Sequence[int],
    path: Path,
    title: str = "",
    ylabel: str = "mean ||(o - ô) W_O^h||_1",
) -> Path:
    """Mean perturbation per layer (log y), one line per method, one panel per budget.
    ``per_layer[method][budget]`` is the per-layer mean (of the heads' figure, or of the layer's own)."""
    budgets = list(next(iter(per_layer.values())).keys())
    rows, cols = _columns(len(budgets))
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False)
    colours = distinct_colours(len(per_layer))
    for ax, budget in zip(axes.flat, budgets, strict=False):
        for (method, by_budget), colour in zip(per_layer.items(), colours, strict=True):
            y = np.asarray(by_budget[budget], dtype=np.float64)
            ax.plot(layers, np.where(y > 0, y, np.nan), marker="o", ms=3, lw=1.2, color=colour, label=method)
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_title(f"budget {budget}", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(budgets) :]:
        ax.axis("off")
    fig.suptitle(title or "output perturbation per layer", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ratio_heatmap(
    ratios: Mapping[str, np.ndarray], layers: Sequence[int], a: str, b: str, path: Path, title: str = ""
) -> Path:
    """Layer x head map of log10(B / A), one panel per budget (blue: B lower). ``ratios[budget]`` is (layers, heads)."""
    rows, cols = _columns(len(ratios))
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols + 1, 0.16 * len(layers) * rows + 1.6), squeeze=False)
    finite = [np.abs(r[np.isfinite(r)]) for r in ratios.values()]
    span = max((float(np.quantile(f, 0.98)) for f in finite if f.size), default=1.0) or 1.0
    image = None
    for ax, (budget, r) in zip(axes.flat, ratios.items(), strict=False):
        image = ax.imshow(r, aspect="auto", cmap="RdBu_r", vmin=-span, vmax=span, interpolation="nearest")
        ax.set_yticks(range(len(layers))[:: max(1, len(layers) // 10)])
        ax.set_yticklabels([str(x) for x in layers][:: max(1, len(layers) // 10)])
        ax.set_xticks(range(r.shape[1]))
        ax.set_xlabel("query head")
        ax.set_title(f"budget {budget}", fontsize=9)
    for ax in axes[:, 0]:
        ax.set_ylabel("layer")
    for ax in list(axes.flat)[len(ratios) :]:
        ax.axis("off")
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label=f"log10({b} / {a})")
    fig.suptitle(title or f"log10 perturbation ratio {b} / {a} per head (blue: {b} lower)", fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_hidden(hidden: Mapping[str, Mapping[str, float]], path: Path, title: str = "") -> Path:
    """Last-layer hidden-state perturbation against the budget, one line per method.
    ``hidden[method][budget]`` is the mean L1 distance to the full-cache run."""
    fig, ax = plt.subplots(figsize=(5, 3.4))
    for (method, by_budget), colour in zip(hidden.items(), distinct_colours(len(hidden)), strict=True):
        budgets = list(by_budget)
        x = [float(b) for b in budgets]
        ax.plot(x, [by_budget[b] for b in budgets], marker="o", color=colour, label=method)
    ax.set_xlabel("budget")
    ax.set_ylabel("mean L1 of last hidden state vs full")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(title or "last-layer hidden-state perturbation", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
