"""Plots and Markdown tables of benchmarks/speed_memory.py, quality_vs_kvpress.py and kvpress/same_process.py reports.

    python benchmarks/plot_benchmarks.py --speed results/speed_memory_smollm2.json \
        --quality results/quality_vs_kvpress_smollm2/report.json --tag smollm2 --out-dir docs/img/benchmarks --tables

Writes ``{tag}_time.png`` (time to first token and decode time per token against context length),
``{tag}_memory.png`` (peak memory above the start of the prefill and KV bytes held, against context length),
``{tag}_ratios.png`` (ours/kvpress per method, figure and length), where the runs recorded it ``{tag}_compression.png``
(the prefill's CPU time spent compressing, and the rest of it, against context length) and, with ``--quality``,
``{tag}_quality.png`` (answer agreement and RULER scores); with ``--same-process`` (any number of reports),
``{tag}_same_process.png`` (ours / kvpress within each repeat, time to first token and decode); with ``--pairs``
(reports of prefills alone), ``{tag}_pairs.png`` (ours / kvpress of each pair, and their mean). A speed report of
criticalkv alone (``--systems ours``, every preset) gives ``{tag}_presets.png`` instead of the first three: bars per
method and length. ``--tables`` prints the Markdown tables of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from criticalkv.palette import distinct_colours

MIB = 2**20
CLOCKS = {  # --clock -> (time to first token key, decode key, label)
    "cpu": ("ttft_cpu_seconds", "decode_cpu_ms_per_token_median", "CPU time"),
    "wall": ("ttft_seconds", "decode_ms_per_token_median", "wall clock"),
}
SYSTEM_STYLE = {"ours": ("-", "o"), "kvpress": ("--", "s")}  # line, marker
SYSTEM_NAME = {"ours": "criticalkv", "kvpress": "kvpress 0.5.5"}


def _methods(summary: list[dict]) -> list[str]:
    return list(dict.fromkeys(row["method"] for row in summary))


def _series(summary: list[dict], method: str, system: str, key: str, scale: float = 1.0) -> tuple[list, list]:
    rows = [r for r in summary if r["method"] == method and system in r and key in r[system]]
    return [r["prompt_tokens"] for r in rows], [r[system][key] / scale for r in rows]


def _against_length(summary: list[dict], panels: list[tuple[str, str, float]], title: str, path: Path) -> None:
    """One panel per (key, y label, scale): every method, criticalkv solid, kvpress dashed."""
    fig, grid = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    axes = grid[0]
    methods = _methods(summary)
    colors = dict(zip(methods, distinct_colours(len(methods)), strict=True))
    for ax, (key, y_label, scale) in zip(axes, panels, strict=True):
        for method, color in colors.items():
            for system, (line, marker) in SYSTEM_STYLE.items():
                x, y = _series(summary, method, system, key, scale)
                if x:
                    label = f"{method} ({SYSTEM_NAME[system]})"
                    ax.plot(
                        x,
                        y,
                        line,
                        marker=marker,
                        fillstyle="none" if system == "kvpress" else "full",
                        color=color,
                        label=label,
                    )
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(y_label)
        ax.set_xscale("log", base=2)
        lengths = sorted({r["prompt_tokens"] for r in summary})
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_ratios(summary: list[dict], clock: str, title: str, path: Path) -> None:
    """Grouped bars of ours/kvpress: one group per (method, length), one bar per figure."""
    ttft, decode, _ = CLOCKS[clock]
    figures = [(ttft, "time to first token"), (decode, "decode / token"), ("peak_rss_above_start_bytes", "peak RSS")]
    figures.append(("kv_bytes", "KV bytes"))
    rows = [r for r in summary if "ratio_ours_over_kvpress" in r]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows)), 4.2))
    width = 0.8 / len(figures)
    for i, (key, label) in enumerate(figures):
        values = [r["ratio_ours_over_kvpress"].get(key, float("nan")) for r in rows]
        ax.bar([j + (i - (len(figures) - 1) / 2) * width for j in range(len(rows))], values, width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), [f"{r['method']}\n{r['prompt_tokens']}" for r in rows], fontsize=7)
    ax.set_ylabel("criticalkv / kvpress (below 1: criticalkv smaller)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_quality(report: dict, title: str, path: Path) -> None:
    """Exact answer agreement per method, and each system's mean RULER score."""
    methods = list(report["methods"])
    data = report["methods"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(methods, [100 * data[m]["exact_agreement"] for m in methods], color="tab:green")
    left.axhline(95, color="black", linestyle=":", linewidth=0.8)
    left.set_ylim(0, 105)
    left.set_ylabel("answers identical to kvpress's (%)")
    width = 0.38
    right.bar([i - width / 2 for i in range(len(methods))], [data[m]["ours_mean_score"] for m in methods], width)
    right.bar([i + width / 2 for i in range(len(methods))], [data[m]["kvpress_mean_score"] for m in methods], width)
    right.set_xticks(range(len(methods)), methods)
    right.legend(["criticalkv", "kvpress 0.5.5"], fontsize=8)
    right.set_ylabel("mean RULER score")
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _cell(d: dict, key: str, fmt: str, scale: float = 1.0) -> str:
    return format(d[key] / scale, fmt) if key in d else "–"


def _kv_cell(d: dict) -> str:
    if "kv_bytes" not in d:
        return "–"
    return f"{d['kv_bytes'] / MIB:.1f} ({100 * d.get('kv_fraction_of_full', float('nan')):.1f}%)"


def speed_tables(summary: list[dict], clock: str) -> str:
    """Markdown: medians of both systems and ours/kvpress, one row per (length, method); time, then memory."""
    ttft, decode, label = CLOCKS[clock]
    time_lines = [
        "| prompt tokens | method | TTFT criticalkv (s) | TTFT kvpress (s) | ratio | decode criticalkv (ms/token) | "
        "decode kvpress (ms/token) | ratio |",
        "|" + "---|" * 8,
    ]
    cuda = "peak_cuda_above_start_bytes"
    on_gpu = any(cuda in r.get("ours", {}) for r in summary)
    memory_lines = [
        "| prompt tokens | method | peak RSS criticalkv (MiB) | peak RSS kvpress (MiB) | ratio | "
        + ("peak CUDA criticalkv (MiB) | peak CUDA kvpress (MiB) | ratio | " if on_gpu else "")
        + "KV criticalkv (MiB, % of full) | KV kvpress (MiB, % of full) | ratio |",
        "|" + "---|" * (11 if on_gpu else 8),
    ]
    rss = "peak_rss_above_start_bytes"
    for r in summary:
        ours, theirs, ratio = r.get("ours", {}), r.get("kvpress", {}), r.get("ratio_ours_over_kvpress", {})
        head = f"| {r['prompt_tokens']} | {r['method']} |"
        time_lines.append(
            f"{head} {_cell(ours, ttft, '.2f')} | {_cell(theirs, ttft, '.2f')} | {_cell(ratio, ttft, '.3f')} | "
            f"{_cell(ours, decode, '.1f')} | {_cell(theirs, decode, '.1f')} | {_cell(ratio, decode, '.3f')} |"
        )
        gpu = (
            f" {_cell(ours, cuda, '.0f', MIB)} | {_cell(theirs, cuda, '.0f', MIB)} | {_cell(ratio, cuda, '.3f')} |"
            if on_gpu
            else ""
        )
        memory_lines.append(
            f"{head} {_cell(ours, rss, '.0f', MIB)} | {_cell(theirs, rss, '.0f', MIB)} | {_cell(ratio, rss, '.3f')} |"
            f"{gpu} {_kv_cell(ours)} | {_kv_cell(theirs)} | {_cell(ratio, 'kv_bytes', '.3f')} |"
        )
    tables = (
        f"Times ({label}, medians):\n\n" + "\n".join(time_lines) + "\n\nMemory (medians):\n\n" + "\n".join(memory_lines)
    )
    return tables + compression_table(summary)


def ours_alone(summary: list[dict]) -> bool:
    """Whether the report ran criticalkv alone (``--systems ours``: every preset, most without a kvpress twin)."""
    return bool(summary) and not any("kvpress" in r for r in summary)


def presets_table(summary: list[dict], clock: str, live_rss: bool = True) -> str:
    """Markdown: criticalkv alone, one row per (length, method): medians of the times, the compression inside the
    prefill, the KV bytes held and, where ``live_rss`` (runs under ``--allocator mmap``, whose peak RSS is live
    memory), the peak RSS."""
    ttft, decode, label = CLOCKS[clock]
    cuda = "peak_cuda_above_start_bytes"
    on_gpu = any(cuda in r.get("ours", {}) for r in summary)
    lines = [
        "| prompt tokens | method | TTFT (s) | compression (CPU s) | decode (ms/token) | KV (MiB, % of full) |"
        + (" peak RSS (MiB) |" if live_rss else "")
        + (" peak CUDA (MiB) |" if on_gpu else ""),
        "|" + "---|" * (6 + live_rss + on_gpu),
    ]
    for r in summary:
        ours = r.get("ours", {})
        lines.append(
            f"| {r['prompt_tokens']} | {r['method']} | {_cell(ours, ttft, '.2f')} | "
            f"{_cell(ours, 'compression_cpu_seconds', '.3f')} | {_cell(ours, decode, '.1f')} | {_kv_cell(ours)} |"
            + (f" {_cell(ours, 'peak_rss_above_start_bytes', '.0f', MIB)} |" if live_rss else "")
            + (f" {_cell(ours, cuda, '.0f', MIB)} |" if on_gpu else "")
        )
    return f"criticalkv alone ({label}, medians):\n\n" + "\n".join(lines)


def plot_presets(summary: list[dict], clock: str, title: str, path: Path) -> None:
    """Horizontal bars, one group per method and one bar per prompt length: time to first token, the compression
    inside the prefill and the decode time per token (criticalkv alone; a line plot of two dozen methods is
    unreadable)."""
    ttft, decode, label = CLOCKS[clock]
    panels = [  # (key, axis label, log scale: the compression spans three decades across the presets)
        (ttft, f"time to first token (s, {label})", False),
        ("compression_cpu_seconds", "compression inside the prefill (CPU s, log scale)", True),
        (decode, f"decode (ms/token, {label})", False),
    ]
    methods = _methods(summary)
    lengths = sorted({r["prompt_tokens"] for r in summary})
    height = 0.8 / len(lengths)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 1.5 + 0.28 * len(methods)), sharey=True)
    for ax, (key, x_label, log) in zip(axes, panels, strict=True):
        for j, length in enumerate(lengths):
            value = {
                r["method"]: r.get("ours", {}).get(key, float("nan")) for r in summary if r["prompt_tokens"] == length
            }
            places = [i + j * height for i in range(len(methods))]
            ax.barh(places, [value.get(m, float("nan")) for m in methods], height, label=f"{length} tokens")
        ax.set_xlabel(x_label)
        ax.set_xscale("log" if log else "linear")
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks([i + height * (len(lengths) - 1) / 2 for i in range(len(methods))], methods)
    axes[0].invert_yaxis()
    fig.legend(*axes[0].get_legend_handles_labels(), loc="upper right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compression_table(summary: list[dict]) -> str:
    """Markdown: the prefill's CPU time spent compressing and the rest of it, both systems (runs that recorded it)."""
    spent, rest = "compression_cpu_seconds", "ttft_cpu_outside_compression_seconds"
    lines = [
        "| prompt tokens | method | compression criticalkv (CPU s) | compression kvpress (CPU s) | ratio | "
        "rest of the prefill criticalkv (CPU s) | rest kvpress (CPU s) | ratio |",
        "|" + "---|" * 8,
    ]
    for r in summary:
        ours, theirs = r.get("ours", {}), r.get("kvpress", {})
        if spent not in ours or spent not in theirs:
            continue
        lines.append(
            f"| {r['prompt_tokens']} | {r['method']} | {ours[spent]:.3f} | {theirs[spent]:.3f} | "
            f"{ours[spent] / theirs[spent]:.3f} | {ours[rest]:.2f} | {theirs[rest]:.2f} | "
            f"{ours[rest] / theirs[rest]:.3f} |"
        )
    if len(lines) == 2:
        return ""
    return "\n\nCompression inside the prefill (CPU time, medians over the runs):\n\n" + "\n".join(lines)


def phase_table(summary: list[dict]) -> str:
    """Markdown: the prefill's CPU seconds per phase (medians), criticalkv against kvpress; empty without phases."""
    phases = ("attention", "mlp", "compression", "other")
    lines = []
    for row in summary:
        if "ours" not in row or "kvpress" not in row or "phase_other_cpu_seconds" not in row["ours"]:
            continue
        cells = []
        for phase in phases:
            key = f"phase_{phase}_cpu_seconds"
            ours, theirs = row["ours"].get(key), row["kvpress"].get(key)
            if ours is None or theirs is None:
                cells.append("–")
                continue
            ratio = f" ({ours / theirs:.3f})" if theirs else ""
            cells.append(f"{ours:.3f} / {theirs:.3f}{ratio}")
        lines.append(f"| {row['prompt_tokens']} | {row['method']} | " + " | ".join(cells) + " |")
    if not lines:
        return ""
    header = "| prompt tokens | method | " + " | ".join(f"{p}: ours / kvpress CPU s" for p in phases) + " |"
    return "\n".join([header, "|---|---|" + "---|" * len(phases), *lines])


def fastest_table(runs: list[dict], clock: str) -> str:
    """Markdown: ours/kvpress of the fastest repeat (the one least slowed by the machine) per (length, method)."""
    ttft, decode, label = CLOCKS[clock]
    best: dict[tuple, dict[str, float]] = {}
    for r in runs:
        cell = best.setdefault((r["length"], r["method"], r["system"]), {})
        for key in (ttft, decode):
            cell[key] = min(cell.get(key, float("inf")), r[key])
    lines = [f"| prompt tokens | method | TTFT ratio ({label}) | decode ratio ({label}) |", "|---|---|---|---|"]
    for length, method, system in best:
        theirs = best.get((length, method, "kvpress"))
        if system != "ours" or theirs is None:
            continue
        ours = best[(length, method, system)]
        lines.append(f"| {length} | {method} | {ours[ttft] / theirs[ttft]:.3f} | {ours[decode] / theirs[decode]:.3f} |")
    return "Fastest repeat, ours / kvpress:\n\n" + "\n".join(lines)


def _pairs(runs: list[dict]):
    """(length, method, ours, kvpress's) for each run of ours with a kvpress twin: the same length, method, repeat
    and run in its process."""
    by_run = {(r["length"], r["method"], r["system"], r["repeat"], r.get("run_in_process", 0)): r for r in runs}
    for (length, method, system, *run), ours in by_run.items():
        theirs = by_run.get((length, method, "kvpress", *run))
        if system == "ours" and theirs is not None:
            yield length, method, ours, theirs


def paired_table(runs: list[dict], clock: str) -> str:
    """Markdown: ours/kvpress within each repeat (the two processes run one after the other, so a drift of the
    machine between repeats cancels), their median and in how many repeats ours was the lower, per (length, method).
    """
    ttft, decode, label = CLOCKS[clock]
    ratios: dict[tuple, dict[str, list[float]]] = {}
    for length, method, ours, theirs in _pairs(runs):
        cell = ratios.setdefault((length, method), {ttft: [], decode: []})
        for key in cell:
            cell[key].append(ours[key] / theirs[key])
    lines = [
        f"| prompt tokens | method | pairs | TTFT ratio, median ({label}) | ours lower | decode ratio, median "
        f"({label}) | ours lower |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += _median_rows(ratios, (ttft, decode), digits=3)
    return "Within each repeat, ours / kvpress:\n\n" + "\n".join(lines)


def _median_rows(ratios: dict[tuple, dict[str, list[float]]], keys: tuple[str, ...], digits: int) -> list[str]:
    """Markdown rows by length (stable): the pairs, then per key the median ratio and how many are below 1."""
    rows = []
    for (length, method), cell in sorted(ratios.items(), key=lambda item: item[0][0]):
        row = [f"{length}", method, f"{len(cell[keys[0]])}"]
        for key in keys:
            row += [f"{statistics.median(cell[key]):.{digits}f}", f"{sum(x < 1 for x in cell[key])}"]
        rows.append("| " + " | ".join(row) + " |")
    return rows


def gauged_table(runs: list[dict]) -> str:
    """Markdown: within each repeat, ours/kvpress of the prefill's CPU time per CPU second of its MLP phase, and of
    the attention phase per MLP second; empty without phases.

    The MLP is the same code on the same shapes in both systems and under every method, so its time gauges how fast
    the machine ran that process: dividing by it removes the speed differences between processes that the raw
    ratio carries (it assumes they slow every phase alike)."""
    ratios: dict[tuple, dict[str, list[float]]] = {}
    for length, method, ours, theirs in _pairs(runs):
        if "prefill_phases" not in ours or "prefill_phases" not in theirs:
            continue
        mine, other = ours["prefill_phases"], theirs["prefill_phases"]
        gauge = mine["mlp"]["cpu_seconds"] / other["mlp"]["cpu_seconds"]
        cell = ratios.setdefault((length, method), {"ttft": [], "attention": []})
        cell["ttft"].append(ours["ttft_cpu_seconds"] / theirs["ttft_cpu_seconds"] / gauge)
        cell["attention"].append(mine["attention"]["cpu_seconds"] / other["attention"]["cpu_seconds"] / gauge)
    if not ratios:
        return ""
    lines = [
        "| prompt tokens | method | pairs | TTFT per MLP second, median | ours lower | attention per MLP second, "
        "median | ours lower |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += _median_rows(ratios, ("ttft", "attention"), digits=4)
    return "Within each repeat, ours / kvpress per CPU second of the MLP phase (CPU time):\n\n" + "\n".join(lines)


def answer_cells(ours: str, theirs: str, context: int = 20, width: int = 60) -> tuple[str, str]:
    """Two answers as Markdown table cells, each from ``context`` characters before their first difference.

    The common start is shown as "…", newlines as "⏎" and pipes as "/", so a cell stays on one table row.
    """
    common = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    start = max(0, common - context)

    def cell(text: str) -> str:
        shown = text[start : start + width].replace("\n", "⏎").replace("|", "/")
        return ("…" if start else "") + shown + ("…" if len(text) > start + width else "")

    return cell(ours), cell(theirs)


def quality_tables(report: dict) -> str:
    """Markdown: agreement and scores per method, then every disagreement."""
    lines = [
        "| criticalkv | kvpress | samples | identical answers | same score | mean score: criticalkv | kvpress |",
        "|---|---|---|---|---|---|---|",
    ]
    for method, r in report["methods"].items():
        lines.append(
            f"| `{method}` | `{r['kvpress_press']}` | {r['samples']} | {100 * r['exact_agreement']:.1f}% | "
            f"{100 * r['score_agreement']:.1f}% | {r['ours_mean_score']:.1f} | {r['kvpress_mean_score']:.1f} |"
        )
    if not any(r["disagreements"] for r in report["methods"].values()):
        return "\n".join([*lines, "", "No disagreements."])
    lines += [
        "",
        "| method | sample | criticalkv answer (score) | kvpress answer (score) | kept sets |",
        "|---|---|---|---|---|",
    ]
    for method, r in report["methods"].items():
        for d in r["disagreements"]:
            kept = d.get("kept_sets", {})
            where = f"heads identical {kept['heads_identical']}" if kept else "–"
            if "first_layer" in kept:
                where += f", first differing layer {kept['first_layer']}"
            ours, theirs = answer_cells(d["ours"], d["kvpress"])
            lines.append(
                f"| `{method}` | {d['key']} | {ours} ({d['ours_score']:.0f}) | {theirs} ({d['kvpress_score']:.0f}) | "
                f"{where} |"
            )
    return "\n".join(lines)


def _same_process_cells(reports: list[dict]) -> list[tuple[str, dict, str]]:
    """(cell label, report, method) for every method of every same_process.py report, in the order given."""
    return [
        (f"{r['model']} {r['prompt_tokens']}\n{method}", r, method)
        for r in reports
        for method in r["summary"]
        if method != "full"
    ]


def same_process_ratios(report: dict, method: str, key: str) -> list[float]:
    """Ours / kvpress of ``key`` in each repeat of one method of a same_process.py report."""
    by = {(run["label"], run["repeat"]): run[key] for run in report["runs"]}
    repeats = sorted({run["repeat"] for run in report["runs"]})
    return [by[(f"ours:{method}", k)] / by[(f"kvpress:{method}", k)] for k in repeats]


def _tokens_cell(first_difference: int | None) -> str:
    return "identical" if first_difference is None else f"first {first_difference} identical"


def same_process_table(reports: list[dict]) -> str:
    """One row per (model, length, method) of same_process.py reports: CPU-time medians and ratios."""
    lines = [
        "| model | tokens | method | repeats | TTFT ours / kvpress (s) | ratio of medians | within each repeat: "
        "median, ours lower | `full` (s) | compression ours / kvpress (s) | rest within | decode ours / kvpress "
        "(ms) | decode within | KV bytes ours / kvpress | generated tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for _, r, method in _same_process_cells(reports):
        s = r["summary"][method]
        full = r["summary"].get("full")  # absent from a run with --no-control
        control = f"{full['ttft_median']:.2f}" if full else "not run"
        lines.append(
            f"| {r['model']} | {r['prompt_tokens']} | {method} | {s['repeats']} | {s['ttft_ours']:.2f} / "
            f"{s['ttft_kvpress']:.2f} | {s['ttft_ratio']:.3f} | {s['ttft_within']:.3f}, {s['ttft_ours_lower']} of "
            f"{s['repeats']} | {control} | {s['compression_ours']:.3f} / "
            f"{s['compression_kvpress']:.3f} | {s['rest_within']:.3f} | {s['decode_ms_ours']:.1f} / "
            f"{s['decode_ms_kvpress']:.1f} | {s['decode_ms_within']:.3f} | "
            f"{s['kv_bytes_ours'] / s['kv_bytes_kvpress']:.3f} | {_tokens_cell(s['first_difference'])} |"
        )
    return "\n".join(lines)


def plot_same_process(reports: list[dict], title: str, path: Path) -> None:
    """Ours / kvpress in each repeat (dots) and their median (bar), per cell; time to first token and decode."""
    cells = _same_process_cells(reports)
    keys = [("ttft_cpu_seconds", "time to first token"), ("decode_cpu_ms_per_token_median", "decode / token")]
    fig, axes = plt.subplots(len(keys), 1, figsize=(max(6.0, 0.9 * len(cells)), 3.4 * len(keys)), sharex=True)
    for ax, (key, name) in zip(axes, keys, strict=True):
        for x, (_, report, method) in enumerate(cells):
            ratios = same_process_ratios(report, method, key)
            ax.plot([x] * len(ratios), ratios, "o", color="tab:blue", alpha=0.5, markersize=4)
            ax.hlines(statistics.median(ratios), x - 0.3, x + 0.3, color="black")
        ax.axhline(1.0, color="tab:red", linewidth=0.8, linestyle=":")
        ax.set_ylabel(f"{name}\ncriticalkv / kvpress")
        ax.grid(axis="y", alpha=0.3)
    axes[-1].set_xticks(range(len(cells)), [label for label, _, _ in cells], fontsize=7, rotation=90)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compression_alone(summary: dict) -> float:
    """The ours / kvpress ratio of time to first token that the compression medians alone would give: kvpress's
    median prefill less the difference of the two compression medians, over kvpress's."""
    return 1 - (summary["compression_kvpress"] - summary["compression_ours"]) / summary["ttft_kvpress"]


def pairs_table(reports: list[dict]) -> str:
    """One row per (model, length, method) of same_process.py reports run with ``--no-control --decode-steps 0``:
    the prefill pairs' ratios, and the ratio the compression times alone would give."""
    lines = [
        "| model | tokens | method | pairs | TTFT ours / kvpress (s) | ratio of medians | within each pair: mean "
        "± standard error | median | ours lower | compression ours / kvpress (s) | from compression alone | "
        "rest within |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for _, r, method in _same_process_cells(reports):
        s = r["summary"][method]
        lines.append(
            f"| {r['model']} | {r['prompt_tokens']} | {method} | {s['repeats']} | {s['ttft_ours']:.3f} / "
            f"{s['ttft_kvpress']:.3f} | {s['ttft_ratio']:.4f} | {s['ttft_within_mean']:.4f} ± "
            f"{s['ttft_within_standard_error']:.4f} | {s['ttft_within']:.4f} | {s['ttft_ours_lower']} | "
            f"{s['compression_ours']:.3f} / {s['compression_kvpress']:.3f} | {compression_alone(s):.4f} | "
            f"{s['rest_within']:.4f} |"
        )
    return "\n".join(lines)


def plot_pairs(reports: list[dict], title: str, path: Path) -> None:
    """Per cell: ours / kvpress of each prefill pair (left) and their mean with two standard errors (right)."""
    cells = _same_process_cells(reports)
    fig, (spread, mean) = plt.subplots(1, 2, figsize=(max(8.0, 2.2 * len(cells)), 4.2))
    for x, (_, report, method) in enumerate(cells):
        ratios = same_process_ratios(report, method, "ttft_cpu_seconds")
        s = report["summary"][method]
        spread.plot([x] * len(ratios), ratios, "o", color="tab:blue", alpha=0.25, markersize=3)
        mean.errorbar(x, s["ttft_within_mean"], yerr=2 * s["ttft_within_standard_error"], fmt="o", color="black")
        label = "from compression alone" if x == 0 else None
        mean.hlines(compression_alone(s), x - 0.25, x + 0.25, color="tab:green", label=label)
    for ax, name in ((spread, "each pair"), (mean, "mean ± 2 standard errors")):
        ax.axhline(1.0, color="tab:red", linewidth=0.8, linestyle=":")
        ax.set_xticks(range(len(cells)), [f"{r['model']}\n{r['prompt_tokens']}\n{m}" for _, r, m in cells], fontsize=7)
        ax.set_title(name, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    spread.set_ylabel("time to first token, criticalkv / kvpress")
    mean.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def speed_outputs(report: dict, args: argparse.Namespace) -> list[Path]:
    """The plots of a speed_memory.py report (with ``args.tables``, its tables printed too); the paths written.
    A report of criticalkv alone gets the presets' bars and table; one of both systems the comparison."""
    summary, model, budget = report["summary"], report["model"], report["budget"]

    def path(name: str) -> Path:
        return args.out_dir / f"{args.tag}_{name}.png"

    if ours_alone(summary):
        plot_presets(summary, args.clock, f"criticalkv, {model}, budget {budget}", path("presets"))
        if args.tables:  # under glibc's defaults or "retain" the peak RSS holds the retained heap: left out
            live_rss = "--allocator mmap" in report.get("command", "--allocator mmap")
            print(presets_table(summary, args.clock, live_rss), end="\n\n")
        return [path("presets")]
    ttft, decode, label = CLOCKS[args.clock]
    time_panels = [(ttft, f"time to first token (s, {label})", 1.0), (decode, f"decode (ms/token, {label})", 1.0)]
    memory_panels = [
        ("peak_rss_above_start_bytes", "peak RSS above start (MiB)", MIB),
        ("kv_bytes", "KV (MiB)", MIB),
    ]
    if any("peak_cuda_above_start_bytes" in r.get("ours", {}) for r in summary):
        memory_panels.append(("peak_cuda_above_start_bytes", "peak CUDA above start (MiB)", MIB))
    _against_length(summary, time_panels, f"{model}, budget {budget}: time", path("time"))
    _against_length(summary, memory_panels, f"{model}, budget {budget}: memory", path("memory"))
    plot_ratios(summary, args.clock, f"{model}, budget {budget}: criticalkv / kvpress", path("ratios"))
    written = [path("time"), path("memory"), path("ratios")]
    if any("compression_cpu_seconds" in r.get("kvpress", {}) for r in summary):  # runs that recorded it
        compression_panels = [
            ("compression_cpu_seconds", "compression inside the prefill (CPU s)", 1.0),
            ("ttft_cpu_outside_compression_seconds", "rest of the prefill (CPU s)", 1.0),
        ]
        _against_length(summary, compression_panels, f"{model}, budget {budget}: compression", path("compression"))
        written.append(path("compression"))
    if args.tables:
        print(speed_tables(summary, args.clock), end="\n\n")
        print(fastest_table(report["runs"], args.clock), end="\n\n")
        print(paired_table(report["runs"], args.clock), end="\n\n")
        for table in (phase_table(summary), gauged_table(report["runs"])):
            if table:
                print(table, end="\n\n")
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--speed", type=Path, help="a speed_memory.py report")
    parser.add_argument("--quality", type=Path, help="a quality_vs_kvpress.py report.json")
    parser.add_argument("--same-process", type=Path, nargs="+", help="same_process.py reports, drawn together")
    parser.add_argument(
        "--pairs",
        type=Path,
        nargs="+",
        help="same_process.py reports of prefills alone (--no-control, --decode-steps 0)",
    )
    parser.add_argument("--tag", default="smollm2", help="file name prefix, e.g. the model")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="cpu", help="which times to draw")
    parser.add_argument("--out-dir", type=Path, default=Path("docs/img/benchmarks"))
    parser.add_argument("--tables", action="store_true", help="print the Markdown tables")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if args.speed:
        written += speed_outputs(json.loads(args.speed.read_text()), args)
    if args.quality:
        report = json.loads(args.quality.read_text())
        written.append(args.out_dir / f"{args.tag}_quality.png")
        title = f"{report['model']}, RULER-{report['length']}, {report['samples']} samples, budget {report['budget']}"
        plot_quality(report, title, written[-1])
        if args.tables:
            print(quality_tables(report), end="\n\n")
    if args.same_process:
        reports = [json.loads(path.read_text()) for path in args.same_process]
        written.append(args.out_dir / f"{args.tag}_same_process.png")
        title = f"criticalkv / kvpress 0.5.5 in one process, budget {reports[0]['budget']}, CPU time"
        plot_same_process(reports, title, written[-1])
        if args.tables:
            print(same_process_table(reports), end="\n\n")
    if args.pairs:
        reports = [json.loads(path.read_text()) for path in args.pairs]
        written.append(args.out_dir / f"{args.tag}_pairs.png")
        title = f"Prefills alone, criticalkv / kvpress 0.5.5 in one process, budget {reports[0]['budget']}, CPU time"
        plot_pairs(reports, title, written[-1])
        if args.tables:
            print(pairs_table(reports), end="\n\n")
    for path in written:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
