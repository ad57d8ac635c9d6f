"""Two sweeps of the same samples side by side: each (regime, method, budget) both answered, its mean score in each,
and the paired difference (second minus first) with its 95% bootstrap interval over the samples both answered.

Made for a chunked prefill against one-shot compression at the same number of kept entries (the two sweeps differ in
their settings, so ``criticalkv report A B --out`` refuses to join them):

    python benchmarks/compare_sweeps.py results/r4k-aware-oneshot results/r4k-aware-chunked \
        --labels one-shot,chunked --out results/r4k-aware-chunked-vs-oneshot.json

or for two methods of other names, in two folders or in one (each ``--pair`` a method of the first folder and one of
the second; the two options of one scorer, say):

    python benchmarks/compare_sweeps.py results/sweep results/sweep \
        --pair layer-reconstruct 'layer-reconstruct:softmax=chunk' --labels whole-cache,chunk

Beside the means, the samples on which the second answered better and worse than the first.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from criticalkv.eval.intervals import common_samples, difference, task_means
from criticalkv.eval.report import answered_scores
from criticalkv.eval.sweep import load_rows, stored_settings


def compare(first: Path, second: Path, pairs: list[tuple[str, str]] | None = None) -> list[dict]:
    """One entry per (regime, method, budget) both folders answered: the means on their common samples, the paired
    difference, and the samples the second answered better and worse. ``pairs``: (method of the first folder, method
    of the second) to compare instead of each method with its namesake."""
    a, b = (answered_scores(load_rows(folder / "results.jsonl")) for folder in (first, second))
    namesakes = [(m, m) for m in sorted({k[1] for k in a} & {k[1] for k in b})]
    names = namesakes if pairs is None else [("full", "full"), *pairs]
    entries = []
    for key in sorted(a, key=lambda k: (k[0], k[1] != "full", k[1], k[2][1])):
        regime, method, budget_key = key
        for other in [s for f, s in names if f == method]:
            there = b.get((regime, other, budget_key), {})
            common = set(a[key]) & set(there)
            if not common:
                continue
            counts = [len(keys) for keys in common_samples([a[key], there]).values()]
            delta, interval = difference(a[key], there)
            entries.append(
                {
                    "regime": regime,
                    "method": method if other == method else f"{method} vs {other}",
                    "budget": "full" if method == "full" else str(budget_key[1]),
                    "samples": sum(counts),
                    "samples_per_task": f"{min(counts)}-{max(counts)}",
                    "means": task_means([a[key], there]).tolist(),
                    "difference": delta,
                    "interval": interval,
                    "better": sum(there[k] > a[key][k] for k in common),
                    "worse": sum(there[k] < a[key][k] for k in common),
                }
            )
    return entries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    parser.add_argument("--labels", default="first,second", help="names of the two sweeps, comma-separated")
    parser.add_argument(
        "--pair",
        nargs=2,
        action="append",
        metavar=("FIRST", "SECOND"),
        help="compare the first folder's method FIRST with the second's SECOND (repeatable; default: namesakes)",
    )
    parser.add_argument("--out", type=Path, help="JSON file for the comparison")
    args = parser.parse_args()
    labels = args.labels.split(",")
    entries = compare(args.first, args.second, [tuple(p) for p in args.pair] if args.pair else None)
    print(
        f"| regime | method | budget | samples (per task) | {labels[0]} | {labels[1]} | difference (95% interval) "
        f"| {labels[1]} better / worse |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for e in entries:
        low, high = e["interval"] if e["interval"] else (float("nan"), float("nan"))
        print(
            f"| {e['regime']} | {e['method']} | {e['budget']} | {e['samples']} ({e['samples_per_task']}) "
            f"| {e['means'][0]:.1f} | {e['means'][1]:.1f} | {e['difference']:+.1f} ({low:+.1f} to {high:+.1f}) "
            f"| {e['better']} / {e['worse']} |"
        )
    if args.out:
        pairs = "".join(f" --pair {shlex.quote(f)} {shlex.quote(s)}" for f, s in args.pair or [])
        report = {
            "command": f"python benchmarks/compare_sweeps.py {args.first} {args.second} --labels {args.labels}{pairs}",
            "labels": labels,
            "settings": [stored_settings(args.first), stored_settings(args.second)],
            "pairs": entries,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
