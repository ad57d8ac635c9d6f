"""Prefill time of compressed methods against no compression (median of N runs), on one prompt.

With ``--clock cpu`` it also gives each method's "within the run" ratio, prefill / (prefill - compression), with the
compression's CPU time measured inside the same prefill (scoring, selecting, compressing): the two halves share
the state of the machine, so this ratio varies far less between runs on a noisy machine than the ratio to the
full cache's separate runs. It leaves out any other effect of compression on the prefill; the "rest" ratio measures
those: the prefill minus its compression against the first method's prefill of the same repeat (the methods run
one after the other in one process, so 1.0 means compressing costs nothing beyond the compression step itself).

    python benchmarks/prefill_overhead.py --model smollm2-135m --tokens 4096 --repeats 5 \
        --methods "full,snapkv,critical-snapkv,critical-snapkv:norm_dtype=model" --out results/prefill_overhead.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers

from criticalkv.eval.needle import needle_prompt_ids
from criticalkv.models import load_model
from criticalkv.runtime.session import ContextSession
from criticalkv.selectors import value_norm_amx


def run_ratios(
    times: dict[str, list[float]], compression: dict[str, list[float]], first: str
) -> tuple[dict[str, float], dict[str, float]]:
    """Per method, the medians over the repeats of two ratios (CPU times; the lists hold one figure per repeat):

    within: the prefill against its own work outside compression, t / (t - c): both halves see the same state of
    the machine. rest: the prefill outside compression against ``first``'s prefill of the same repeat,
    (t - c) / t_first: what compressing costs the rest of the forward (the attention function, the cache, the
    memory it frees), the compression left out.
    """
    within = {
        name: statistics.median(t / (t - c) for t, c in zip(times[name], compression[name], strict=True))
        for name in times
    }
    rest = {
        name: statistics.median(
            (t - c) / base for t, c, base in zip(times[name], compression[name], times[first], strict=True)
        )
        for name in times
    }
    return within, rest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget", default="0.2")
    parser.add_argument("--methods", default="full,snapkv,critical-snapkv")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall time, or this process's CPU time (with --threads 1: robust to other load on the machine)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=Path("results/prefill_overhead.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_model(args.model, dtype=args.dtype)
    ids = torch.tensor([needle_prompt_ids(tokenizer, args.tokens)])
    methods = [m.strip() for m in args.methods.split(",")]
    sessions = {}
    for spec in methods:
        sessions[spec] = ContextSession(model, spec, args.budget)  # a method spec: name[:key=value;...]
    times: dict[str, list[float]] = {name: [] for name in methods}
    compression: dict[str, list[float]] = {name: [] for name in methods}  # CPU s inside the prefill's compression
    sessions[methods[0]].prefill(ids)  # warm-up
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    for _ in range(args.repeats):  # interleaved, so drifts of the machine hit every method alike
        for name in methods:
            start = clock()
            sessions[name].prefill(ids)
            times[name].append(clock() - start)
            compressor = sessions[name].compressor
            compression[name].append(compressor.compress_cpu_seconds if compressor else 0.0)
    base = statistics.median(times[methods[0]])
    within, rest = run_ratios(times, compression, methods[0]) if args.clock == "cpu" else ({}, {})
    report = {
        "command": "python benchmarks/prefill_overhead.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "model": args.model,
        "prompt_tokens": ids.shape[1],
        "budget": args.budget,
        "dtype": str(next(model.parameters()).dtype),
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "machine": platform.machine(),
        "cpu_value_norms": value_norm_amx.describe(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "seconds": times,
        "median_seconds": {name: statistics.median(t) for name, t in times.items()},
        "ratio_to_first": {name: statistics.median(t) / base for name, t in times.items()},
        "compression_cpu_seconds": compression,
        "within_run_ratio": within,
        "rest_ratio_to_first": rest,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    for name in methods:
        print(
            f"{name:18s} median {report['median_seconds'][name]:7.3f} s   x{report['ratio_to_first'][name]:.3f}"
            f"   compression {statistics.median(compression[name]):6.3f} CPU s"
            + (f"   within the run x{within[name]:.3f}   rest x{rest[name]:.3f}" if name in within else "")
        )


if __name__ == "__main__":
    main()
