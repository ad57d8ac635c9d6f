"""Tables and plots from a sweep's results.jsonl: score per task, compression loss, score against budget."""

from __future__ import annotations

import csv
import re
from collections import defaultdict
from pathlib import Path
from statistics import mean

from matplotlib.figure import Figure

from criticalkv.errors import CriticalKVError
from criticalkv.eval.intervals import LEVEL, loss_interval, loss_ratio
from criticalkv.eval.sweep import Row, budget_id, is_count, load_rows, stored_settings
from criticalkv.files import write_atomic, write_json
from criticalkv.palette import distinct_colours

HEATMAP_PREFIX = "heatmap_"  # eval needle's score maps, one per (method, budget): heatmap_<label>.png


def file_stem(*parts: str) -> str:
    """A file-name-safe stem from labels (``"snapkv", "critical-snapkv"`` -> ``snapkv_vs_critical-snapkv``)."""
    return "_vs_".join(re.sub(r"[^A-Za-z0-9.+-]+", "_", p) for p in parts)


def summarise(rows: list[Row]) -> dict:
    """Mean score per (regime, method, budget, task), the mean over tasks, the compression loss with its bootstrap
    interval, and the loss ratio of every CriticalKV variant to its base method at the same budget (``loss_ratios``).

    loss = (full - method) / full on the same samples, per regime (evaluation.md): where a pair answered only some
    samples (a run in progress, merged folders), the full cache's mean is taken over those samples alone. Intervals:
    ``intervals.py`` (task-stratified, paired bootstrap over samples).

    A sample answered twice by one pair (folders that resumed runs appended to before the sweep answered only
    missing pairs) counts once; two different scores for it raise ``CriticalKVError``.
    """
    answered = answered_scores(rows)
    by_key: dict[tuple, list[float]] = defaultdict(list)
    for (regime, method, budget), scores in answered.items():
        for (task, _), score in scores.items():
            by_key[(regime, method, budget, task)].append(score)
    tasks = sorted({task for (_, _, _, task) in by_key}, key=_natural)
    table: dict[str, dict] = {}
    for regime, method, budget, task in sorted(by_key, key=str):
        entry = table.setdefault(
            f"{regime}|{method}|{budget[1]}",
            {"regime": regime, "method": method, "budget": budget[1], "tasks": {}, "task_samples": {}, "samples": 0},
        )
        scores = by_key[(regime, method, budget, task)]
        entry["tasks"][task] = mean(scores)
        entry["task_samples"][task] = len(scores)
        entry["samples"] += len(scores)
    for entry in table.values():
        entry["mean"] = mean(entry["tasks"].values())
    for entry in table.values():
        full = _full_of(answered, entry["regime"])
        scores = answered[(entry["regime"], entry["method"], budget_id(entry["budget"]))]
        reference = None if full is None else _mean_over_tasks(full, scores)
        entry["loss"] = None if not reference else (reference - entry["mean"]) / reference
        entry["loss_interval"] = None if not reference else loss_interval(full, scores)
    return {"tasks": tasks, "rows": sorted(table.values(), key=_order), "loss_ratios": _loss_ratios(answered)}


def answered_scores(rows: list[Row]) -> dict[tuple, dict[tuple[str, int], float]]:
    """(regime, method, budget key) -> {(task, index): score}: a budget keyed with its kind (``budget_id``: a count of
    1 entry is not the fraction 1.0). A sample scored twice alike counts once; differently, ``CriticalKVError``."""
    answered: dict[tuple, dict[tuple[str, int], float]] = defaultdict(dict)
    for r in rows:
        if answered[(r.regime, r.method, budget_id(r.budget))].setdefault((r.task, r.index), r.score) != r.score:
            raise CriticalKVError(
                f"{r.task} sample {r.index} is scored twice for {r.method} at {r.budget} ({r.regime}), differently:"
                " the folder mixes runs of other settings or code"
            )
    return answered


def _full_of(answered: dict[tuple, dict], regime: str) -> dict[tuple[str, int], float] | None:
    """The full cache's scores in ``regime``, None if it has none."""
    return next((s for (r, method, _), s in answered.items() if r == regime and method == "full"), None)


def _loss_ratios(answered: dict[tuple, dict]) -> list[dict]:
    """Per regime and budget, each CriticalKV variant's loss over its base method's (``intervals.loss_ratio``), where
    both and the full cache answered."""
    ratios = []
    for (regime, method, budget), scores in sorted(answered.items(), key=str):
        if not method.startswith("critical-"):
            continue
        base, full = answered.get((regime, _base(method), budget)), _full_of(answered, regime)
        if base is None or full is None:
            continue
        point, interval = loss_ratio(full, base, scores)
        entry = {"regime": regime, "method": method, "base": _base(method), "budget": budget[1]}
        ratios.append(entry | {"ratio": point, "interval": interval})
    return ratios


def _natural(name: str) -> list:
    """Sort key of a task name with its numbers as numbers: needle-512 before needle-1024."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]


def _mean_over_tasks(full: dict[tuple[str, int], float], samples: dict[tuple[str, int], float]) -> float | None:
    """The full cache's score over ``samples``' (task, index) keys: mean per task, then over tasks; None if it
    answered none of them."""
    per_task: dict[str, list[float]] = defaultdict(list)
    for key in samples:
        if key in full:
            per_task[key[0]].append(full[key])
    return mean(mean(scores) for scores in per_task.values()) if per_task else None


def _sample_count(entry: dict, tasks: list[str]) -> str:
    """Samples per task of a summary row over the table's ``tasks``: "20", or "5-20" where its tasks have different
    counts ("0-20" where it answered none of some task)."""
    counts = [entry["task_samples"].get(task, 0) for task in tasks]
    low, high = min(counts), max(counts)
    return f"{low}" if low == high else f"{low}-{high}"


def _order(entry: dict) -> tuple:
    return (entry["regime"], entry["method"] != "full", entry["method"], float(entry["budget"]))


def sweep_title(settings: dict | None, regimes: set[str]) -> str:
    """A report's title from a sweep folder's settings (``sweep.json``): "RULER-4096, qwen2.5-0.5b, bfloat16,
    question-aware", "LongBench (max length 3500), ..." (the dtype where the folder records one)."""
    if not settings:
        return "Sweep results"
    name = Path(str(settings.get("model", ""))).name
    benchmark = settings.get("benchmark")
    heads = {
        "ruler": f"RULER-{settings.get('length')}",
        "facts": f"Facts-{settings.get('length')}",
        "longbench": f"LongBench (max length {settings.get('max_length')})",
    }
    head = heads.get(benchmark, str(benchmark))
    dtype = settings.get("dtype")
    parts = [head, name, "" if dtype in (None, "auto") else str(dtype)]
    parts += [f"question-{next(iter(regimes))}"] if len(regimes) == 1 else []
    return ", ".join(p for p in parts if p)


def write_report(results_dir: Path, title: str = "") -> Path:
    """Write report.md, summary.csv, summary.json and plots next to results.jsonl; return the report path.

    Without ``title``, the folder's ``sweep.json`` names it (``sweep_title``). The needle's heatmaps in the folder
    (``HEATMAP_PREFIX``) are shown after the tables."""
    rows = load_rows(results_dir / "results.jsonl")
    summary = summarise(rows)
    tasks = summary["tasks"]
    write_json(results_dir / "summary.json", summary, indent=2)
    with (results_dir / "summary.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["regime", "method", "budget", *tasks, "mean", "loss", "loss_low", "loss_high"])
        for e in summary["rows"]:
            writer.writerow(
                [
                    e["regime"],
                    e["method"],
                    e["budget"],
                    *(f"{e['tasks'].get(t, float('nan')):.2f}" for t in tasks),
                    f"{e['mean']:.2f}",
                    *(
                        "" if value is None else f"{value:.4f}"
                        for value in (e["loss"], *(e["loss_interval"] or [None] * 2))
                    ),
                ]
            )
    title = title or sweep_title(stored_settings(results_dir), {e["regime"] for e in summary["rows"]})
    lines = [f"# {title}", ""]
    for regime in sorted({e["regime"] for e in summary["rows"]}):
        entries = [e for e in summary["rows"] if e["regime"] == regime]
        counts = {_sample_count(e, tasks) for e in entries}
        partial = [e for e in entries if set(e["tasks"]) != set(tasks)]  # rows that answered only some tasks
        mixed = len(counts) > 1  # then each row says its own count
        per_task = next(iter(counts)) if not mixed else "per row (column samples)"
        lines += [
            f"## question-{regime}",
            "",
            f"Samples per task: {per_task}. Loss: (full - method) / full, on the same samples; in brackets its "
            f"{LEVEL:.0%} bootstrap interval over samples (n/a where the full cache scores 0 in some resample).",
            *_copied_line([r for r in rows if r.regime == regime and r.method == "full"]),
            "",
            "| method | budget | " + "samples | " * mixed + " | ".join(tasks) + " | mean | loss |",
            "|---|---|" + "---|" * (len(tasks) + 2 + mixed),
        ]
        for e in entries:
            loss = "" if e["loss"] is None or e["method"] == "full" else _percent(e["loss"], e["loss_interval"])
            cells = " | ".join(f"{e['tasks'][t]:.1f}" if t in e["tasks"] else "–" for t in tasks)
            budget = "" if e["method"] == "full" else str(e["budget"])
            samples = f"{_sample_count(e, tasks)} | " * mixed
            row_mean = f"{e['mean']:.1f}" + ("*" if e in partial else "")
            lines.append(f"| {e['method']} | {budget} | {samples}{cells} | {row_mean} | {loss} |")
        if partial:
            lines += [
                "",
                "\\* the mean of the tasks the row answered (–: none), not comparable with the full rows' "
                "mean; its loss compares the same samples.",
            ]
        lines += ["", *_ratio_table([r for r in summary["loss_ratios"] if r["regime"] == regime])]
        _plot_regime(summary, regime, results_dir / f"score_vs_budget_{regime}.png")
        lines += [f"![score against budget, question-{regime}](score_vs_budget_{regime}.png)", ""]
        if _plot_loss(summary, regime, results_dir / f"loss_{regime}.png"):
            lines += [f"![compression loss, question-{regime}](loss_{regime}.png)", ""]
    heatmaps = sorted(results_dir.glob(f"{HEATMAP_PREFIX}*.png"))
    if heatmaps:
        lines += ["## Needle heatmaps", ""] + [f"![{image.stem}]({image.name})\n" for image in heatmaps]
    path = results_dir / "report.md"
    write_atomic(path, "\n".join(lines))
    return path


def _copied_line(full: list[Row]) -> list[str]:
    """A line saying how many of the full cache's rows were copied from another sweep (``--full-from``), if any."""
    copied = sum(row.copied for row in full)
    if not copied:
        return []
    return [
        "",
        f"The full cache's rows of {copied} of {len(full)} samples were copied from a sweep of the same samples "
        "(`--full-from`), not answered in this folder.",
    ]


def _percent(value: float, interval: tuple[float, float] | None) -> str:
    """``37.7% (33.1-42.0)``: a loss and its interval, in percent."""
    bracket = " (n/a)" if interval is None else f" ({100 * interval[0]:.1f}-{100 * interval[1]:.1f})"
    return f"{100 * value:.1f}%{bracket}"


def _ratio_table(ratios: list[dict]) -> list[str]:
    """Report lines of the loss ratios of a regime (none without a CriticalKV variant beside its base)."""
    if not ratios:
        return []
    lines = [
        f"Loss ratio of each CriticalKV variant to its base method (below 0.5: the loss cut by more than half), "
        f"{LEVEL:.0%} bootstrap interval; n/a where the base loses nothing (in some resample, for the interval).",
        "",
        "| variant | base | budget | loss ratio |",
        "|---|---|---|---|",
    ]
    for r in ratios:
        point = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}"
        interval = "n/a" if r["interval"] is None else f"{r['interval'][0]:.2f}-{r['interval'][1]:.2f}"
        lines.append(f"| {r['method']} | {r['base']} | {r['budget']} | {point} ({interval}) |")
    return [*lines, ""]


def _plot_regime(summary: dict, regime: str, path: Path) -> Figure:
    """Mean score against budget, one line per method: fractions and entry counts on axes of their own."""
    rows = [e for e in summary["rows"] if e["regime"] == regime]
    full = next((e["mean"] for e in rows if e["method"] == "full"), None)
    compressed = [e for e in rows if e["method"] != "full"]
    kinds = sorted({is_count(e["budget"]) for e in compressed}) or [False]  # fractions first
    fig = Figure(figsize=(8.4 if len(kinds) == 1 else 12.0, 4.2))
    axes = fig.subplots(1, len(kinds), squeeze=False)[0]
    methods = sorted({e["method"] for e in compressed}, key=lambda m: (_base(m), m))
    bases = list(dict.fromkeys(_base(m) for m in methods))  # a method and its CriticalKV version share a colour
    colours = distinct_colours(len(bases))
    for ax, counts in zip(axes, kinds, strict=True):
        for method in methods:
            points = sorted(
                (e["budget"], e["mean"])
                for e in compressed
                if e["method"] == method and is_count(e["budget"]) == counts
            )
            if not points:
                continue
            style = "-" if method.startswith("critical-") else "--"
            color = colours[bases.index(_base(method))]
            ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", color=color, label=method)
        if full is not None:
            ax.axhline(full, color="black", linewidth=1, label="full cache")
        ax.set_xlabel("budget (entries kept per KV head)" if counts else "budget (fraction of the context kept)")
        ax.set_ylabel("mean score")
        ax.set_title(f"question-{regime}")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    handles: dict = {}  # every axis's lines, once each: a method may have budgets of one kind only
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    axes[-1].legend(handles.values(), handles.keys(), fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return fig


def _base(method: str) -> str:
    """The method a CriticalKV preset enhances: ``critical-snapkv`` -> ``snapkv``."""
    return method.removeprefix("critical-")


def _plot_loss(summary: dict, regime: str, path: Path) -> bool:
    """Horizontal bars of the compression loss of every (method, budget) of a regime; False if there is none."""
    rows = [e for e in summary["rows"] if e["regime"] == regime and e["method"] != "full" and e["loss"] is not None]
    if not rows:
        return False
    rows.sort(
        key=lambda e: (float(e["budget"]), e["method"].removeprefix("critical-"), e["method"].startswith("critical-"))
    )
    labels = [f"{e['method']} @ {e['budget']}" for e in rows]
    losses = [100 * e["loss"] for e in rows]
    colors = ["tab:orange" if e["method"].startswith("critical-") else "tab:blue" for e in rows]
    fig = Figure(figsize=(6.4, 0.8 + 0.28 * len(rows)))
    ax = fig.subplots()
    ax.barh(range(len(rows)), losses, color=colors)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_xlabel("compression loss against the full cache (%)")
    ax.set_title(f"question-{regime} (orange: CriticalKV versions)")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True
