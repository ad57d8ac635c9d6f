"""Sweeps of several models side by side, one regime at a time: each (method, budget)'s mean score, its compression
loss with the 95% bootstrap interval, and each CriticalKV variant's loss ratio to its base with its interval
(``summarise``'s figures, read from each folder's rows). Made for the headline table of docs/results.md:

    python benchmarks/headline_table.py --regime aware \
        Qwen2.5-1.5B=docs/img/results/ruler4k_qwen15/aware Qwen2.5-0.5B=results/ruler4k-qwen-aware
"""

from __future__ import annotations

import argparse
from pathlib import Path

from criticalkv.eval.report import summarise
from criticalkv.eval.sweep import load_rows


def columns(folders: dict[str, Path], regime: str) -> dict[str, dict]:
    """label -> {(method, budget): cell}, a cell holding mean, loss, loss interval, ratio, ratio interval, samples."""
    out: dict[str, dict] = {}
    for label, folder in folders.items():
        summary = summarise([r for r in load_rows(folder / "results.jsonl") if r.regime == regime])
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


def table(folders: dict[str, Path], regime: str) -> str:
    """The markdown table: a row per (method, budget), a column per folder."""
    cols = columns(folders, regime)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", help="LABEL=FOLDER, a sweep folder (results.jsonl) per column")
    parser.add_argument("--regime", choices=("aware", "agnostic"), required=True)
    args = parser.parse_args()
    folders = {}
    for item in args.folders:
        label, sep, folder = item.partition("=")
        if not sep or not label:
            parser.error(f"give each folder as LABEL=FOLDER, got {item!r}")
        folders[label] = Path(folder)
    print(table(folders, args.regime))


if __name__ == "__main__":
    main()
