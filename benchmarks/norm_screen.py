"""What CriticalKV's value-norm screen recomputes in float32, what it saves, and that it keeps the same entries.

For each method, one prefill of the needle prompt with the screen (the default) and one without (``screen=false``,
every float32 norm): the entries per layer the screen could not settle from the bfloat16 norms' bound (counted by
wrapping ``norm_screen._settled``), each prefill's compression CPU time, and whether the two caches are identical.

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
from criticalkv.models.presets import load_model
from criticalkv.runtime.session import ContextSession
from criticalkv.selectors import norm_screen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="preset name or local model folder")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--budget", default="0.2")
    parser.add_argument("--methods", default="critical-snapkv,critical-adakv")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=Path("results/norm_screen.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_model(args.model)
    ids = torch.tensor([needle_prompt_ids(tokenizer, args.tokens)])
    unsettled: list[int] = []  # per screened layer: candidates neither surely in nor surely out
    settled = norm_screen._settled

    def counting(low: torch.Tensor, high: torch.Tensor, need: torch.Tensor, k: int):
        sure_in, sure_out = settled(low, high, need, k)
        candidates = low > float("-inf")
        unsettled.append(int((candidates & ~sure_in & ~sure_out).sum()))
        return sure_in, sure_out

    norm_screen._settled = counting
    ContextSession(model, "full", args.budget).prefill(ids)  # warm-up
    report = {
        "command": "python benchmarks/norm_screen.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "prompt_tokens": ids.shape[1],
        "methods": {},
    }
    for spec in args.methods.split(","):
        unsettled.clear()
        screened = ContextSession(model, spec, args.budget)
        screened.prefill(ids)
        counts = list(unsettled)
        reference = ContextSession(model, f"{spec}:screen=false", args.budget)
        reference.prefill(ids)
        if not counts:
            raise SystemExit(f"{spec}: the screen did not run (values not bfloat16, or no native bfloat16 products)")
        identical = all(
            torch.equal(a.context_keys, b.context_keys)
            and torch.equal(a.context_values, b.context_values)
            and torch.equal(a.offsets(), b.offsets())
            for a, b in zip(screened.cache.layers, reference.cache.layers, strict=True)
        )
        row = {
            "unsettled_per_layer": counts,
            "entries_per_layer": int(ids.shape[1]) * model.config.num_key_value_heads,
            "compression_cpu_seconds": screened.compressor.compress_cpu_seconds,
            "compression_cpu_seconds_unscreened": reference.compressor.compress_cpu_seconds,
            "identical_caches": identical,
        }
        report["methods"][spec] = row
        median = statistics.median(counts)
        print(
            f"{spec}: unsettled per layer median {median:.0f} (min {min(counts)}, max {max(counts)}) "
            f"of {row['entries_per_layer']}; compression {row['compression_cpu_seconds']:.2f} CPU s screened, "
            f"{row['compression_cpu_seconds_unscreened']:.2f} unscreened; identical caches: {identical}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
