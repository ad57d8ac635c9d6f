"""Peak process memory of a long prefill, KV bytes held, and decode time per token: full cache vs compressed.

Each (method, budget) runs in its own process so peak RSS is that run's alone.

    python benchmarks/memory.py --model smollm2-135m --tokens 8192 --methods full,critical-snapkv,critical-adakv \
        --budget 0.2 --decode-tokens 32 --out results/memory_8k.json

``--attention`` (auto, flash, padded, segments) forces the attention path over compressed layers (it sets
$CRITICALKV_ATTENTION for the runs; see criticalkv.cache.fused_attention).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from timed_generation import child_environment, peak_memory_above, reset_peak_memory

from criticalkv.cache import CompressedLayer
from criticalkv.cache.fused_attention import ATTENTION_ENV_VAR, PATHS
from criticalkv.eval.needle import needle_prompt_ids
from criticalkv.models import load_model
from criticalkv.models.families import head_dim
from criticalkv.runtime.session import ContextSession

CPU = torch.device("cpu")


def measure(model_name: str, method: str, budget: str, tokens: int, decode_tokens: int, dtype: str) -> dict:
    """One run, in this process: prefill, KV accounting, greedy decode timing, peak RSS."""
    model, tokenizer = load_model(model_name, dtype=dtype)
    ids = torch.tensor([needle_prompt_ids(tokenizer, tokens)])
    session = ContextSession(model, method, budget)
    start_memory = reset_peak_memory(CPU)  # loading the weights peaks higher than a prefill: measure from here on
    start = time.perf_counter()
    session.prefill(ids)
    prefill = time.perf_counter() - start
    itemsize = next(model.parameters()).element_size()
    entries = session.kv_entries()
    kv_bytes = session.kv_bytes()
    compressed = [layer for layer in session.cache.layers if isinstance(layer, CompressedLayer) and layer.is_compressed]
    bookkeeping = sum(layer.lengths.nbytes for layer in compressed)
    generation = session.ask(None, max_new_tokens=decode_tokens, eos_token_id=None)  # always decode_tokens tokens
    above = peak_memory_above(CPU, start_memory)["peak_rss_above_start_bytes"]
    return {
        "method": method,
        "budget": budget,
        "attention": os.environ.get(ATTENTION_ENV_VAR, "auto"),
        "prompt_tokens": ids.shape[1],
        "prefill_seconds": prefill,
        "decode_ms_per_token_median": 1000 * statistics.median(generation.decode_seconds),
        "kv_entries": entries,
        "kv_bytes": kv_bytes,
        "kv_bytes_of_entries": entries * 2 * head_dim(model.config) * itemsize,
        "bookkeeping_bytes": bookkeeping,
        "rss_before_prefill_bytes": start_memory["rss"],
        "peak_rss_bytes": start_memory["rss"] + above,
        "peak_rss_above_start_bytes": above,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--methods", default="full,critical-snapkv,critical-adakv")
    parser.add_argument("--budget", default="0.2")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--attention",
        choices=PATHS,
        default=os.environ.get(ATTENTION_ENV_VAR, "auto"),
        help=f"attention path over compressed layers (default: ${ATTENTION_ENV_VAR}, else auto)",
    )
    parser.add_argument("--out", type=Path, default=Path("results/memory.json"))
    parser.add_argument("--single", help=argparse.SUPPRESS)  # internal: run one method in this process
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ[ATTENTION_ENV_VAR] = args.attention  # read at every compressed layer's attention; runs inherit it
    if args.single:
        result = measure(args.model, args.single, args.budget, args.tokens, args.decode_tokens, args.dtype)
        print(json.dumps(result))
        return
    runs = []
    for method in [m.strip() for m in args.methods.split(",")]:
        command = [sys.executable, __file__, "--single", method] + [
            x
            for k in ("model", "tokens", "budget", "decode_tokens", "dtype", "threads", "attention")
            for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))
        ]
        env = child_environment("mmap")  # peak RSS measures live memory
        done = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        r = runs[-1]
        print(
            f"{method:18s} prefill {r['prefill_seconds']:6.2f} s  "
            f"decode {r['decode_ms_per_token_median']:6.1f} ms/tok  KV {r['kv_bytes'] / 2**20:7.1f} MiB  "
            f"peak RSS above start {r['peak_rss_above_start_bytes'] / 2**20:7.0f} MiB"
        )
    report = {
        "command": "python benchmarks/memory.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "single"),
        "machine": platform.machine(),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
