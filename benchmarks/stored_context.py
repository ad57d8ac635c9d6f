"""A stored compressed context against compressing it again: time to the first token of a question, and bytes.

For one needle context of ``--tokens`` tokens, median over ``--repeats``:

* again: prefill and compress the context (question-agnostic), then the question's forward to its first token;
* stored: load the saved file from disk (``ContextSession.load``), then the question's forward to its first token.
  The file was written just before, so it is read from the operating system's page cache, as a server reads a
  context it keeps on a local disk that is asked often.

Also the file's size against the full cache's key/value bytes (every layer's keys and values of every token).

    python benchmarks/stored_context.py --model smollm2-135m --tokens 8192 --method critical-snapkv --budget 0.2 \
        --repeats 3 --dtype float32 --threads 1 --clock cpu --out results/stored_context.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from criticalkv.eval.needle import build_needle_sample, encode_prompt
from criticalkv.models import load_model
from criticalkv.runtime.session import ContextSession


def full_cache_bytes(model, tokens: int) -> int:
    """Keys and values of every layer for ``tokens`` tokens, as transformers' DynamicCache holds them."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * tokens * itemsize


def first_token_seconds(session: ContextSession, question: torch.Tensor, clock) -> float:
    start = clock()
    steps = session.stream(question, max_new_tokens=1)
    next(steps)
    steps.close()
    return clock() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--method", default="critical-snapkv")
    parser.add_argument("--budget", default="0.2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto", help="the model's dtype (auto: as criticalkv run reads it)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall time, or this process's CPU time (with --threads 1: robust to other load on the machine)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_model(args.model, device="cpu", dtype=args.dtype)
    sample = build_needle_sample(tokenizer, args.tokens)
    context_ids, question_ids = encode_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
    context, question = torch.tensor([context_ids]), torch.tensor([question_ids])
    again, stored = [], []
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "context.safetensors"
        for _ in range(args.repeats):
            start = clock()
            session = ContextSession(model, args.method, args.budget)
            session.prefill(context)
            again.append(clock() - start + first_token_seconds(session, question, clock))
            file_bytes = session.save(path)
            kv_bytes = session.kv_bytes()
            del session
            start = clock()
            loaded = ContextSession.load(path, model)
            stored.append(clock() - start + first_token_seconds(loaded, question, clock))
            del loaded
    full = full_cache_bytes(model, len(context_ids))
    report = {
        "model": args.model,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "context_tokens": len(context_ids),
        "question_tokens": len(question_ids),
        "method": args.method,
        "budget": args.budget,
        "first_token_seconds_compress_again": statistics.median(again),
        "first_token_seconds_stored": statistics.median(stored),
        "speedup": statistics.median(again) / statistics.median(stored),
        "file_bytes": file_bytes,
        "kv_bytes_compressed": kv_bytes,
        "kv_bytes_full": full,
        "file_over_full": file_bytes / full,
        "runs_compress_again": again,
        "runs_stored": stored,
    }
    print(json.dumps(report, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
