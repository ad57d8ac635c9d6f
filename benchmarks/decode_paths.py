"""Decode time per token of each attention path over one compressed cache, interleaved so load drift hits all.

One prefill (and compression); then, for each of ``--rounds`` rounds, every path in turn answers the prompt
greedily (``$CRITICALKV_ATTENTION`` set per answer; the cache is trimmed back to the context after each), and
with ``--full`` a full-cache session does too. Reports, per path, the median wall time per decoded token over
all rounds and the CPU time of this thread per decoded token (with one torch thread, the work itself: it
moves less than wall time when other processes share the cores; its best round is the least disturbed), and
checks that every path produced the same tokens. Then the attention alone: one decoding query per compressed
layer, every layer in turn, ``--attention-repeats`` times per path (interleaved), summed over the layers.

    python benchmarks/decode_paths.py --tokens 8192 --method critical-adakv --budget 0.2 --threads 1 \
        --paths segments,padded --full --out results/decode_paths_8k.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import PreTrainedModel

from criticalkv.cache import CompressedLayer
from criticalkv.cache.attention import compressed_attention
from criticalkv.cache.fused_attention import ATTENTION_ENV_VAR
from criticalkv.eval.needle import needle_prompt_ids
from criticalkv.models import load_model
from criticalkv.runtime.session import ContextSession

FULL = "full cache"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--method", default="critical-adakv")
    parser.add_argument("--budget", default="0.2")
    parser.add_argument("--batch", type=int, default=1, help="rows (the same prompt repeated)")
    parser.add_argument(
        "--paths", default="segments,padded", help="comma-separated: auto, flash, uniform, padded, segments"
    )
    parser.add_argument("--full", action="store_true", help="also time a full-cache session")
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--attention-repeats", type=int, default=30)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=Path("results/decode_paths.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    ids = torch.tensor([needle_prompt_ids(tokenizer, args.tokens)] * args.batch, device=model.device)
    sessions = {}
    compressed = ContextSession(model, args.method, args.budget)
    compressed.prefill(ids)
    layers = [layer for layer in compressed.cache.layers if isinstance(layer, CompressedLayer) and layer.is_compressed]
    padded = [layer.lengths.numel() * int(layer.lengths.max()) for layer in layers]  # entries, before the tail
    padding = max(p / layer.context_keys.shape[0] for p, layer in zip(padded, layers, strict=True))
    padded_mib = max(p * layer.context_keys[0].nbytes for p, layer in zip(padded, layers, strict=True)) / 2**20
    print(f"padded context per layer: at most {padding:.2f}x the kept entries, {padded_mib:.2f} MiB of keys")
    paths = [p.strip() for p in args.paths.split(",")]
    sessions.update({path: compressed for path in paths})
    if args.full:
        sessions[FULL] = ContextSession(model, "full", args.budget)
        sessions[FULL].prefill(ids)
    times: dict[str, list[float]] = {label: [] for label in sessions}
    cpu: dict[str, list[float]] = {label: [] for label in sessions}
    tokens: dict[str, torch.Tensor] = {}
    for _ in range(args.rounds):
        for label, session in sessions.items():
            os.environ[ATTENTION_ENV_VAR] = label if label != FULL else "auto"
            start = time.thread_time()
            generation = session.ask(None, max_new_tokens=args.decode_tokens, eos_token_id=None)  # every token decoded
            cpu[label].append((time.thread_time() - start) / len(generation.decode_seconds))
            times[label].extend(generation.decode_seconds)
            tokens[label] = generation.tokens
    attention = attention_only(layers, model, paths, args.attention_repeats)
    same = all(torch.equal(tokens[p], tokens[paths[0]]) for p in paths)
    runs = {label: 1000 * statistics.median(ts) for label, ts in times.items()}
    cpu_runs = {label: 1000 * statistics.median(ts) for label, ts in cpu.items()}
    cpu_best = {label: 1000 * min(ts) for label, ts in cpu.items()}
    for label, ms in runs.items():
        print(
            f"{label:12s} decode {ms:7.1f} ms/token wall (median of {len(times[label])}), CPU "
            f"{cpu_runs[label]:7.1f} median / {cpu_best[label]:7.1f} best of {len(cpu[label])} rounds"
        )
    for label, ms in attention.items():
        print(f"{label:12s} attention alone {ms:6.2f} ms/token over {len(layers)} layers (best of repeats)")
    print(f"same tokens on every path: {same}")
    report = {
        "command": "python benchmarks/decode_paths.py "
        + " ".join(
            f"--{k.replace('_', '-')}" + ("" if isinstance(v, bool) else f" {v}")
            for k, v in vars(args).items()
            if v is not False
        ),
        "machine": platform.machine(),
        "prompt_tokens": ids.shape[1],
        "kv_entries": compressed.kv_entries(),
        "max_padding_ratio": padding,
        "max_padded_key_mib": padded_mib,
        "decode_ms_per_token_median": runs,
        "decode_cpu_ms_per_token_median": cpu_runs,
        "decode_cpu_ms_per_token_best": cpu_best,
        "attention_only_ms_per_token_best": attention,
        "same_tokens_on_every_path": same,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


def attention_only(
    layers: list[CompressedLayer], model: PreTrainedModel, paths: list[str], repeats: int
) -> dict[str, float]:
    """CPU ms per decoded token spent in the compressed layers' attention, per path: best of ``repeats``."""
    gen = torch.Generator().manual_seed(0)
    dtype = next(model.parameters()).dtype
    inputs = []
    for layer in layers:
        b, h_kv = layer.lengths.shape
        d = layer.context_keys.shape[-1]
        h_q = model.config.num_attention_heads
        query = torch.randn(b, h_q, 1, d, generator=gen).to(dtype)
        tail_keys, tail_values = torch.randn(2, b, h_kv, 1, d, generator=gen).to(dtype)
        inputs.append((query, layer, tail_keys, tail_values, torch.ones(b, 1, 1, 1, dtype=torch.bool)))
    best = {path: float("inf") for path in paths}
    for _ in range(repeats):
        for path in paths:
            start = time.thread_time()
            for query, layer, tail_keys, tail_values, mask in inputs:
                compressed_attention(query, layer, tail_keys, tail_values, mask, 0.125, path=path)
            best[path] = min(best[path], 1000 * (time.thread_time() - start))
    return best


if __name__ == "__main__":
    main()
