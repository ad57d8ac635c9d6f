"""What CriticalKV's value-norm screen computes in float32, what it saves, and that it keeps the same entries.

For each method, one prefill of the needle prompt with the screen (the default) and one without (``screen=false``,
every float32 norm): the entries per layer whose float32 norm the screen computed (counted by wrapping
``norm_screen._rank_exactly``; with the bfloat16 bracket the entries its bound could not settle, with the l2 one
also its first round), each prefill's compression CPU time, and whether the two caches are identical. Which
bracket runs depends on the values' dtype (``--dtype``) and the CPU (``norm_screen.screen_kind``); on a CPU with AMX,
bfloat16 values take the fused kernel and no bracket unless ``CRITICALKV_AMX=0``.

    OMP_NUM_THREADS=1 python benchmarks/norm_screen.py --model qwen2.5-0.5b --tokens 4096 --threads 1 \
        --out results/norm_screen_qwen.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from criticalkv.eval.needle import needle_prompt_ids
from criticalkv.models import load_model
from criticalkv.runtime.session import ContextSession
from criticalkv.selectors import critical as critical_module
from criticalkv.selectors import norm_screen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="preset name or local model folder")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--budget", default="0.2")
    parser.add_argument("--methods", default="critical-snapkv,critical-adakv")
    parser.add_argument(
        "--repeats", type=int, default=1, help="screened and unscreened prefills per method, alternating (medians)"
    )
    parser.add_argument("--dtype", default="auto", help="the model's dtype: auto (its own), float32, bfloat16, ...")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=Path("results/norm_screen.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_model(args.model, dtype=args.dtype)
    ids = torch.tensor([needle_prompt_ids(tokenizer, args.tokens)])
    computed: list[int] = []  # per screened layer: the entries whose float32 norm the screen computed
    kinds: set[str | None] = set()
    rank_exactly, screened_top, screen_kind = (
        norm_screen._rank_exactly,
        critical_module.take_top_by_value_norm,
        critical_module.screen_kind,
    )

    def counting(ranking, done, wanted, *rest) -> None:
        computed[-1] += int(wanted.sum())
        rank_exactly(ranking, done, wanted, *rest)

    def per_layer(*args, **kwargs):
        computed.append(0)
        return screened_top(*args, **kwargs)

    def noting(values: torch.Tensor, o_proj_weight: torch.Tensor) -> str | None:
        kind = screen_kind(values, o_proj_weight)
        kinds.add(kind)
        return kind

    norm_screen._rank_exactly, critical_module.take_top_by_value_norm = counting, per_layer
    critical_module.screen_kind = noting
    ContextSession(model, "full", args.budget).prefill(ids)  # warm-up
    report = {
        "command": "python benchmarks/norm_screen.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "prompt_tokens": ids.shape[1],
        "methods": {},
    }
    for spec in args.methods.split(","):
        times: dict[str, list[float]] = {"screened": [], "unscreened": []}
        for _ in range(args.repeats):  # the first screened prefill also derives the brackets' factors of each weight
            computed.clear()
            kinds.clear()
            screened = ContextSession(model, spec, args.budget)
            screened.prefill(ids)
            counts = list(computed)
            reference = ContextSession(model, f"{spec}:screen=false", args.budget)
            reference.prefill(ids)
            times["screened"].append(screened.compressor.compress_cpu_seconds)
            times["unscreened"].append(reference.compressor.compress_cpu_seconds)
        if not counts:
            raise SystemExit(
                f"{spec}: the screen did not run (brackets {kinds}: see norm_screen.screen_kind; bfloat16 values on a "
                "CPU with AMX take the fused kernel instead, which CRITICALKV_AMX=0 turns off)"
            )
        identical = all(
            torch.equal(a.context_keys, b.context_keys)
            and torch.equal(a.context_values, b.context_values)
            and torch.equal(a.offsets(), b.offsets())
            for a, b in zip(screened.cache.layers, reference.cache.layers, strict=True)
        )
        row = {
            "bracket": sorted(kinds - {None}),
            "computed_per_layer": counts,
            "entries_per_layer": int(ids.shape[1]) * model.config.num_key_value_heads,
            "compression_cpu_seconds": statistics.median(times["screened"]),
            "compression_cpu_seconds_unscreened": statistics.median(times["unscreened"]),
            "compression_cpu_seconds_each": times,
            "identical_caches": identical,
        }
        report["methods"][spec] = row
        median = statistics.median(counts)
        print(
            f"{spec} ({', '.join(row['bracket'])} bracket): float32 norms computed per layer median {median:.0f} "
            f"(min {min(counts)}, max {max(counts)}) "
            f"of {row['entries_per_layer']}; compression {row['compression_cpu_seconds']:.2f} CPU s screened, "
            f"{row['compression_cpu_seconds_unscreened']:.2f} unscreened (median of {args.repeats}; best "
            f"{min(times['screened']):.2f} / {min(times['unscreened']):.2f}); "
            f"identical caches: {identical}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
