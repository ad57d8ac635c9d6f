"""Bounded memory: peak process memory and prefill time of a chunked prefill with a cap against the one-shot
compression at the same cap, per prompt length; then a long generation compressed back to the cap while it
decodes, its cache bytes after every step and its text against the uncompressed generation's.

    python benchmarks/bounded_memory.py --model smollm2-135m --tokens 2048,4096,8192 --cap 1024 --chunk-size 2048 \
        --decode-tokens 4096 --compress-every 256 --dtype float32 --threads 1 --out results/bounded_memory_smollm2.json
    python benchmarks/bounded_memory.py --model qwen2.5-0.5b --tokens 8192,16384,32768 --cap 1024 --chunk-size 2048 \
        --one-shot-max-tokens 16384 --decode-tokens 0 --dtype float32 --threads 1 --out results/bounded_memory_qwen.json

Each prefill runs in its own process, with glibc's mmap threshold at 64 KiB (``--allocator mmap``, as in
docs/benchmarks.md), so its peak RSS above the start (after the weights load) is that prefill's live memory alone.
The report gives, per mode, the spread of the peak across lengths (max / min - 1: flat when small) and the slope
of the prefill time per token against the length (seconds per token per 1k tokens: 0 when constant), in wall and
CPU seconds. The one-shot prefill's attention grows with the square of the length: ``--one-shot-max-tokens`` skips
it beyond a length.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from timed_generation import ALLOCATORS, child_environment, peak_memory_above, reset_peak_memory

from criticalkv.eval.needle import needle_prompt_ids
from criticalkv.models import load_model
from criticalkv.runtime.session import ContextSession

CPU = torch.device("cpu")
MODES = ("chunked", "one-shot")


def prefill_run(args: argparse.Namespace, mode: str, tokens: int) -> dict:
    """One prefill of ``tokens`` in this process: chunked to the cap, or one forward compressed to the cap."""
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    ids = torch.tensor([needle_prompt_ids(tokenizer, tokens)])
    chunking = {"chunk_size": args.chunk_size, "cap": args.cap} if mode == "chunked" else {}
    session = ContextSession(model, args.method, args.cap, **chunking)
    start_memory = reset_peak_memory(CPU)  # loading the weights peaks higher than a prefill: measure from here on
    start, cpu_start = time.perf_counter(), time.process_time()
    session.prefill(ids)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return {
        "mode": mode,
        "prompt_tokens": ids.shape[1],
        "prefill_seconds": seconds,
        "prefill_seconds_per_token": seconds / ids.shape[1],
        "prefill_cpu_seconds": cpu_seconds,
        "prefill_cpu_seconds_per_token": cpu_seconds / ids.shape[1],
        "kv_bytes": session.kv_bytes(),
        "peak_rss_above_start_bytes": peak_memory_above(CPU, start_memory)["peak_rss_above_start_bytes"],
    }


def decode_run(args: argparse.Namespace) -> dict:
    """A long greedy generation compressed back to the cap every ``--compress-every`` tokens: the cache's bytes
    after every step, and its tokens against the uncompressed generation's."""
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    ids = torch.tensor([needle_prompt_ids(tokenizer, args.decode_prompt_tokens)])
    options = {"chunk_size": args.chunk_size, "cap": args.cap, "compress_every": args.compress_every}
    session = ContextSession(model, args.method, args.cap, **options)
    session.prefill(ids)
    tokens, step_bytes = [], []
    for token, _ in session.stream(None, args.decode_tokens, eos_token_id=None):
        tokens.append(int(token[0]))
        step_bytes.append(session.kv_bytes())
    full = ContextSession(model, "full")
    full.prefill(ids)
    full_tokens = full.ask(None, args.decode_tokens, eos_token_id=None).tokens[0].tolist()
    same = next((i for i, (a, b) in enumerate(zip(tokens, full_tokens, strict=True)) if a != b), len(tokens))
    return {
        "prompt_tokens": ids.shape[1],
        "decode_tokens": len(tokens),
        "kv_bytes_after_step": step_bytes,
        "kv_bytes_max": max(step_bytes),
        "kv_bytes_after_prefill": session.kv_bytes(),
        "tokens_equal_to_uncompressed_before_first_difference": same,
        "text": tokenizer.decode(tokens, skip_special_tokens=True),
        "uncompressed_text": tokenizer.decode(full_tokens, skip_special_tokens=True),
    }


def slope_per_1k(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of ``y`` against ``x`` (per 1000 of x), for (x, y) points; 0 for a single point."""
    if len(points) < 2:
        return 0.0
    xs, ys = torch.tensor([p[0] for p in points], dtype=torch.float64), torch.tensor([p[1] for p in points])
    dx = xs - xs.mean()
    return float((dx * (ys.double() - ys.double().mean())).sum() / (dx * dx).sum()) * 1000


def summary(runs: list[dict]) -> dict:
    """Per mode: the spread of the peak RSS across lengths and the slope of the prefill time per token."""
    out = {}
    for mode in MODES:
        mine = sorted((r for r in runs if r["mode"] == mode), key=lambda r: r["prompt_tokens"])
        if not mine:
            continue
        peaks = [r["peak_rss_above_start_bytes"] for r in mine]
        out[mode] = {
            "peak_rss_spread": max(peaks) / max(min(peaks), 1) - 1,
            **{
                f"{kind}_per_token_slope_per_1k_tokens": slope_per_1k(
                    [(r["prompt_tokens"], r[f"prefill_{kind}_per_token"]) for r in mine]
                )
                for kind in ("seconds", "cpu_seconds")
            },
        }
    return out


def child(args: argparse.Namespace, *extra: str) -> dict:
    """Run this script with ``extra`` in a fresh process under ``--allocator``; its JSON line."""
    command = [sys.executable, __file__, *extra] + [
        x
        for k in ("model", "method", "cap", "chunk_size", "compress_every", "decode_tokens", "dtype", "threads")
        for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))
    ]
    command += ["--decode-prompt-tokens", str(args.decode_prompt_tokens)]
    done = subprocess.run(command, check=True, capture_output=True, text=True, env=child_environment(args.allocator))
    return json.loads(done.stdout.strip().splitlines()[-1])


def plot(report: dict, path: Path) -> None:
    """Peak RSS per length and mode; the decode run's cache bytes per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for mode in MODES:
        mine = sorted((r for r in report["runs"] if r["mode"] == mode), key=lambda r: r["prompt_tokens"])
        xs = [r["prompt_tokens"] for r in mine]
        axes[0].plot(xs, [r["peak_rss_above_start_bytes"] / 2**20 for r in mine], marker="o", label=mode)
    axes[0].set(xlabel="prompt tokens", ylabel="peak RSS above start (MiB)", title="prefill")
    axes[0].legend()
    if report.get("decode"):
        axes[1].plot([b / 2**20 for b in report["decode"]["kv_bytes_after_step"]])
    axes[1].set(xlabel="generated tokens", ylabel="KV cache (MiB)", title="decoding at the cap")
    figure.tight_layout()
    figure.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--method", default="critical-snapkv")
    parser.add_argument("--tokens", default="2048,4096,8192", help="comma-separated prompt lengths")
    parser.add_argument("--one-shot-max-tokens", type=int, default=None, help="no one-shot prefill beyond this length")
    parser.add_argument("--cap", type=int, default=1024, help="entries per KV head kept")
    parser.add_argument("--chunk-size", type=int, default=2048)
    parser.add_argument("--compress-every", type=int, default=256, help="decode run: compress every N tokens")
    parser.add_argument("--decode-tokens", type=int, default=4096, help="decode run's length (0: no decode run)")
    parser.add_argument("--decode-prompt-tokens", type=int, default=2048)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--allocator", choices=ALLOCATORS, default="mmap", help="glibc setting of the runs")
    parser.add_argument("--out", type=Path, default=Path("results/bounded_memory.json"))
    parser.add_argument("--single", help=argparse.SUPPRESS)  # internal: "chunked:4096", "one-shot:4096", "decode"
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.single:
        mode, _, tokens = args.single.partition(":")
        result = decode_run(args) if mode == "decode" else prefill_run(args, mode, int(tokens))
        print(json.dumps(result))
        return
    runs = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        for mode in MODES:
            if mode == "one-shot" and args.one_shot_max_tokens is not None and tokens > args.one_shot_max_tokens:
                continue
            runs.append(child(args, "--single", f"{mode}:{tokens}"))
            r = runs[-1]
            print(
                f"{mode:9s} {r['prompt_tokens']:6d} tokens  peak RSS above start "
                f"{r['peak_rss_above_start_bytes'] / 2**20:7.0f} MiB  prefill {r['prefill_seconds']:7.2f} s "
                f"({1e3 * r['prefill_seconds_per_token']:.3f} ms/token; CPU {r['prefill_cpu_seconds']:.2f} s)  "
                f"KV {r['kv_bytes'] / 2**20:6.1f} MiB"
            )
    report = {
        "command": "python benchmarks/bounded_memory.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "single" and v is not None),
        "machine": platform.machine(),
        "runs": runs,
        "summary": summary(runs),
    }
    for mode, figures in report["summary"].items():
        print(
            f"{mode}: peak RSS spread {100 * figures['peak_rss_spread']:.1f}%, prefill time per token slope "
            f"{1e3 * figures['seconds_per_token_slope_per_1k_tokens']:.4f} ms/token per 1k tokens (CPU "
            f"{1e3 * figures['cpu_seconds_per_token_slope_per_1k_tokens']:.4f})"
        )
    if args.decode_tokens:
        report["decode"] = decode_run_report = child(args, "--single", "decode")
        steps = decode_run_report["kv_bytes_after_step"]
        for step in range(0, len(steps), max(1, len(steps) // 16)):
            print(f"decode step {step + 1:5d}: KV {steps[step] / 2**20:7.2f} MiB")
        print(
            f"decode: KV at most {decode_run_report['kv_bytes_max'] / 2**20:.2f} MiB; the same tokens as the "
            f"uncompressed generation for {decode_run_report['tokens_equal_to_uncompressed_before_first_difference']}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    plot(report, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
