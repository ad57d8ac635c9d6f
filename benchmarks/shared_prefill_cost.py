"""Cost of one shared prefill compressed into many (method, budget) caches, against one method alone.

    python benchmarks/shared_prefill_cost.py --model smollm2-135m --tokens 4096 --repeats 3 \
        --methods snapkv,critical-snapkv,adakv,critical-adakv,headkv,critical-headkv --budgets 0.1,0.2,0.4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from criticalkv.eval.needle import build_needle_sample
from criticalkv.models import load_model
from criticalkv.prompts import encode_prompt
from criticalkv.runtime.session import ContextSession
from criticalkv.runtime.shared_prefill import SharedPrefill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default="snapkv,critical-snapkv,adakv,critical-adakv,headkv,critical-headkv")
    parser.add_argument("--budgets", default="0.1,0.2,0.4")
    parser.add_argument("--dtype", default="auto", help="the model's dtype (auto: as criticalkv run reads it)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=Path("results/shared_prefill_cost.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_model(args.model, dtype=args.dtype)
    sample = build_needle_sample(tokenizer, args.tokens, seed=0)
    ids = torch.tensor([encode_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)[0]])  # context
    methods = [m.strip() for m in args.methods.split(",")]
    budgets = [b.strip() for b in args.budgets.split(",")]
    pairs = [(f"{m}@{b}", m, b) for m in methods for b in budgets]
    single = ContextSession(model, methods[-1], budgets[0])
    shared = SharedPrefill(model, pairs)
    single.prefill(ids)  # warm-up
    times: dict[str, list[float]] = {"one method": [], "shared": []}
    for _ in range(args.repeats):
        start = time.perf_counter()
        single.prefill(ids)
        times["one method"].append(time.perf_counter() - start)
        start = time.perf_counter()
        sessions = shared.prefill(ids)
        times["shared"].append(time.perf_counter() - start)
        del sessions
    medians = {k: statistics.median(v) for k, v in times.items()}
    report = {
        "command": "python benchmarks/shared_prefill_cost.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "prompt_tokens": ids.shape[1],
        "pairs": len(pairs),
        "one_method": f"{methods[-1]}@{budgets[0]}",
        "seconds": times,
        "median_seconds": medians,
        "ratio": medians["shared"] / medians["one method"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(
        f"one method {medians['one method']:.2f} s, {len(pairs)} pairs shared {medians['shared']:.2f} s, "
        f"ratio {report['ratio']:.3f}"
    )


if __name__ == "__main__":
    main()
