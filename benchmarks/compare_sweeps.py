"""Two sweeps of the same samples side by side: each (regime, method, budget) both answered, its mean score in each,
and the paired difference (second minus first) with its 95% bootstrap interval over the samples both answered.

Made for a chunked prefill against one-shot compression at the same number of kept entries (the two sweeps differ in
their settings, so ``criticalkv merge`` refuses to join them):

    python benchmarks/compare_sweeps.py results/r4k-aware-oneshot results/r4k-aware-chunked \
        --labels one-shot,chunked --out results/r4k-aware-chunked-vs-oneshot.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from criticalkv.eval.intervals import common_samples, difference, task_means
from criticalkv.eval.report import answered_scores
from criticalkv.eval.sweep import load_rows, stored_settings


def compare(first: Path, second: Path) -> list[dict]:
    """One entry per pair both folders answered: the means on their common samples and the paired difference."""
    a, b = (answered_scores(load_rows(folder / "results.jsonl")) for folder in (first, second))
    entries = []
    for key in sorted(set(a) & set(b), key=lambda k: (k[0], k[1] != "full", k[1], k[2][1])):
        if not set(a[key]) & set(b[key]):
            continue
        counts = [len(keys) for keys in common_samples([a[key], b[key]]).values()]
        delta, interval = difference(a[key], b[key])
        regime, method, (_, budget) = key
        entries.append(
            {
                "regime": regime,
                "method": method,
                "budget": "full" if method == "full" else str(budget),
                "samples": sum(counts),
                "samples_per_task": f"{min(counts)}-{max(counts)}",
                "means": task_means([a[key], b[key]]).tolist(),
                "difference": delta,
                "interval": interval,
            }
        )
    return entries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    parser.add_argument("--labels", default="first,second", help="names of the two sweeps, comma-separated")
    parser.add_argument("--out", type=Path, help="JSON file for the comparison")
    args = parser.parse_args()
    labels = args.labels.split(",")
    entries = compare(args.first, args.second)
    print(f"| regime | method | budget | samples (per task) | {labels[0]} | {labels[1]} | difference (95% interval) |")
    print("|---|---|---|---|---|---|---|")
    for e in entries:
        low, high = e["interval"] if e["interval"] else (float("nan"), float("nan"))
        print(
            f"| {e['regime']} | {e['method']} | {e['budget']} | {e['samples']} ({e['samples_per_task']}) "
            f"| {e['means'][0]:.1f} | {e['means'][1]:.1f} | {e['difference']:+.1f} ({low:+.1f} to {high:+.1f}) |"
        )
    if args.out:
        report = {
            "command": f"python benchmarks/compare_sweeps.py {args.first} {args.second} --labels {args.labels}",
            "labels": labels,
            "settings": [stored_settings(args.first), stored_settings(args.second)],
            "pairs": entries,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
