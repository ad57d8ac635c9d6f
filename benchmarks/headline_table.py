"""Sweeps of several models side by side, one regime at a time: each (method, budget)'s mean score, its compression
loss with the 95% bootstrap interval, and each CriticalKV variant's loss ratio to its base with its interval
(``summarise``'s figures, read from each folder's rows). Made for the headline table of docs/results.md:

    python benchmarks/headline_table.py --regime aware \
        Qwen2.5-1.5B=docs/img/results/ruler4k_qwen15/aware Qwen2.5-0.5B=results/ruler4k-qwen-aware

``--plot FILE`` also draws the loss ratios against the budget, a panel per model, with their intervals and the
paper's "more than half" line at 0.5. ``--common`` keeps, in each folder, only the samples every method answered (a
sweep whose new methods have run on part of the samples so far: every figure of a column on the same samples).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from criticalkv.eval.report import summarise
from criticalkv.eval.sweep import load_rows
from criticalkv.palette import distinct_colours


def answered_by_all(rows: list) -> list:
    """The rows of the samples (task, index) that every (method, budget) of ``rows`` answered."""
    pairs = {(r.method, r.budget) for r in rows}
    seen: dict[tuple, set] = {}
    for r in rows:
        seen.setdefault((r.task, r.index), set()).add((r.method, r.budget))
    return [r for r in rows if seen[(r.task, r.index)] == pairs]


def columns(folders: dict[str, Path], regime: str, common: bool = False) -> dict[str, dict]:
    """label -> {(method, budget): cell}, a cell holding mean, loss, loss interval, ratio, ratio interval, samples;
    ``common``: each folder's samples that every method answered alone (``answered_by_all``)."""
    out: dict[str, dict] = {}
    for label, folder in folders.items():
        rows = [r for r in load_rows(folder / "results.jsonl") if r.regime == regime]
        summary = summarise(answered_by_all(rows) if common else rows)
        cells = {
            (e["method"], "full" if e["method"] == "full" else e["budget"]): {
                "mean": e["mean"],
                "loss": e["loss"],
                "loss_interval": e["loss_interval"],
                "samples": e["samples"],
                "per_task": sorted(set(e["task_samples"].values())),
            }
            for e in summary["rows"]
        }
        for r in summary["loss_ratios"]:
            cells[(r["method"], r["budget"])].update(ratio=r["ratio"], ratio_interval=r["interval"])
        out[label] = cells
    return out


def cell_text(cell: dict | None) -> str:
    """``54.7 · 37.4% (31.0 to 44.2) · 0.59 (0.41 to 0.80)``: mean, loss and its interval, loss ratio and its
    interval (n/a where the base loses nothing in some resample)."""
    if cell is None:
        return "not run"
    parts = [f"{cell['mean']:.1f}"]
    if cell["loss"] is not None and cell["loss_interval"] is not None:
        low, high = cell["loss_interval"]
        parts.append(f"{100 * cell['loss']:.1f}% ({100 * low:.1f} to {100 * high:.1f})")
    if "ratio" in cell:
        ratio = "n/a" if cell["ratio"] is None else f"{cell['ratio']:.2f}"
        interval = cell["ratio_interval"]
        parts.append(ratio + (" (n/a)" if interval is None else f" ({interval[0]:.2f} to {interval[1]:.2f})"))
    return " · ".join(parts)


def table(folders: dict[str, Path], regime: str, common: bool = False) -> str:
    """The markdown table: a row per (method, budget), a column per folder (``common``: see ``columns``)."""
    cols = columns(folders, regime, common)
    keys = sorted(
        {key for cells in cols.values() for key in cells},
        key=lambda k: (k[0] != "full", str(k[1]), k[0].removeprefix("critical-"), k[0].startswith("critical-")),
    )
    samples = [
        f"{label} ({max(c['samples'] for c in cells.values())} samples, "
        f"{'-'.join(str(n) for n in sorted({n for c in cells.values() for n in c['per_task']}))} per task)"
        for label, cells in cols.items()
    ]
    lines = ["| method | budget | " + " | ".join(samples) + " |", "|---|---|" + "---|" * len(cols)]
    for method, budget in keys:
        row = [cell_text(cells.get((method, budget))) for cells in cols.values()]
        lines.append(f"| `{method}` | {budget} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def ratio_plot(folders: dict[str, Path], regime: str, path: Path) -> Figure:
    """Each CriticalKV variant's loss ratio to its base against the budget, a panel per folder (model): the point,
    its 95% interval as a bar, a dashed line at 0.5 (below it: the loss cut by more than half) and one at 1. Ratios
    without an interval (the base loses nothing in some resample, so the ratio means little) are left out; one
    legend names every variant of every panel."""
    cols = columns(folders, regime)
    variants = sorted({m for cells in cols.values() for (m, _), c in cells.items() if "ratio" in c})
    colours = distinct_colours(max(1, len(variants)))
    fig = Figure(figsize=(3.6 * len(cols) + 2.4, 3.8))
    axes = fig.subplots(1, len(cols), squeeze=False, sharey=True)[0]
    for ax, (label, cells) in zip(axes, cols.items(), strict=True):
        for n, method in enumerate(variants):
            points = sorted(
                (float(b), c) for (m, b), c in cells.items() if m == method and c.get("ratio_interval") is not None
            )
            if not points:
                continue
            shift = 1 + 0.04 * (n - (len(variants) - 1) / 2)  # side by side on the log budget axis
            x = [b * shift for b, _ in points]
            y = [c["ratio"] for _, c in points]
            low = [c["ratio"] - c["ratio_interval"][0] for _, c in points]
            high = [c["ratio_interval"][1] - c["ratio"] for _, c in points]
            ax.errorbar(x, y, yerr=[low, high], marker="o", capsize=3, color=colours[n], label=method)
        ax.axhline(0.5, color="black", linestyle="--", linewidth=1)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log")
        budgets = sorted({float(b) for (m, b) in cells if m != "full"})
        ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
        ax.minorticks_off()
        ax.set_title(label)
        ax.set_xlabel("budget (fraction kept)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("loss ratio to the base method")
    handles = [Line2D([], [], color=colours[n], marker="o", label=method) for n, method in enumerate(variants)]
    axes[-1].legend(handles=handles, fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle(f"question-{regime}: CriticalKV's loss over its base's (below the dashed line: cut by more than half)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", help="LABEL=FOLDER, a sweep folder (results.jsonl) per column")
    parser.add_argument("--regime", choices=("aware", "agnostic"), required=True)
    parser.add_argument("--plot", type=Path, help="also draw the loss ratios against the budget to this PNG")
    parser.add_argument("--common", action="store_true", help="in each folder, only the samples every method answered")
    args = parser.parse_args()
    folders = {}
    for item in args.folders:
        label, sep, folder = item.partition("=")
        if not sep or not label:
            parser.error(f"give each folder as LABEL=FOLDER, got {item!r}")
        folders[label] = Path(folder)
    print(table(folders, args.regime, args.common))
    if args.plot:
        ratio_plot(folders, args.regime, args.plot)


if __name__ == "__main__":
    main()
