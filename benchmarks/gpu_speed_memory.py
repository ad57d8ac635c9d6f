"""Speed and memory on a CUDA GPU, per method, context length and batch size, on a model of a real model's shape
with random weights.

Random weights, so that nothing but this repository has to reach the GPU machine: times and memory depend on the
shapes, and every method keeps the number of entries its budget says. What random weights change is where the
attention falls: the head-wise budgets of AdaKV-style methods follow the random model's scores, so how uneven the
per-head caches are (the padding of the padded attention path) is not a trained model's.

For every (length, batch size, repeat, method), interleaved: a prefill of random token ids (time to first token,
synchronised), ``--decode-steps`` greedy decode steps (median per step), the KV bytes the cache holds after the
prefill and the peak of CUDA's allocator above its level at the start of the prefill (weights excluded). Before
the timed runs, one untimed generation of every method at every (length, batch size): CUDA's caching allocator
then holds blocks of every size the runs ask for (on a virtualised H200 a padded-path run that had to grow the
pool decoded at 0.3-1.1 s per token instead of 0.03 s). The methods' order rotates from one repeat to the next.
``full`` is transformers' own DynamicCache without criticalkv. A method may carry options after ``@``, e.g.
``critical-adakv@norm_dtype=model`` (a method option) or ``adakv@attention=segments`` (forces an attention path
through ``$CRITICALKV_ATTENTION`` for that run).

    python benchmarks/gpu_speed_memory.py --shape qwen2.5-0.5b --lengths 4096,16384,32768 --batch-sizes 1,4 \\
        --repeats 5 --out results/gpu_speed_memory_qwen.json
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
from timed_generation import held_kv
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, LlamaConfig, Qwen2Config

import criticalkv
from criticalkv.cache.fused_attention import ATTENTION_ENV_VAR
from criticalkv.methods import parse_option_value

# The published configs' shapes (hidden sizes, heads, vocabularies, RoPE); weights are drawn at random.
SHAPES = {
    "qwen2.5-0.5b": lambda: Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1e6,
        tie_word_embeddings=True,
    ),
    "llama-3.1-8b": lambda: LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rope_theta=5e5,
    ),
}


def build_model(shape: str, device: torch.device) -> torch.nn.Module:
    """A bfloat16 model of a named shape, or of a ``config.json`` (a file or the folder holding it)."""
    config = SHAPES[shape]() if shape in SHAPES else AutoConfig.from_pretrained(shape, trust_remote_code=False)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


def parse_spec(spec: str) -> tuple[str, dict, str]:
    """``name@key=value@...`` -> (method name, method options, attention path)."""
    name, *pairs = spec.split("@")
    options = dict(pair.split("=", 1) for pair in pairs)
    attention = options.pop("attention", "auto")
    return name, {k: parse_option_value(v) for k, v in options.items()}, attention


@torch.no_grad()
def measure(model, spec: str, budget: str, ids: torch.Tensor, decode_steps: int) -> dict:
    """One generation: TTFT, decode median, KV bytes after the prefill and peak CUDA memory above its start."""
    device = ids.device
    method, options, attention = parse_spec(spec)
    os.environ[ATTENTION_ENV_VAR] = attention
    with criticalkv.compress(model, method, budget, **options):  # "full": transformers' DynamicCache only
        cache = DynamicCache(config=model.config)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start_memory = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1)  # (b,)
        torch.cuda.synchronize(device)
        ttft = time.perf_counter() - start
        cache = out.cache  # criticalkv swaps in its own cache at the prefill
        kv_bytes, _ = held_kv(cache)
        t = ids.shape[1]
        steps = []
        for i in range(decode_steps):
            tick = time.perf_counter()
            position = torch.full((ids.shape[0], 1), t + i, device=device)
            out = model(input_ids=token[:, None], position_ids=position, cache=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1)
            torch.cuda.synchronize(device)
            steps.append(time.perf_counter() - tick)
        peak = torch.cuda.max_memory_allocated(device) - start_memory
    return {
        "ttft_seconds": ttft,
        "decode_ms_per_token_median": 1000 * statistics.median(steps),
        "decode_ms": [round(1000 * x, 3) for x in steps],
        "kv_bytes": kv_bytes,
        "peak_cuda_above_start_bytes": peak,
    }


def summarise(runs: list[dict]) -> list[dict]:
    """Medians per (length, batch, method), with KV, peak memory and times relative to the full cache."""
    keys = ("ttft_seconds", "decode_ms_per_token_median", "kv_bytes", "peak_cuda_above_start_bytes")
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["length"], r["batch"], r["method"]), []).append(r)
    rows = []
    for (length, batch, method), mine in groups.items():
        row = {"length": length, "batch": batch, "method": method, "repeats": len(mine)}
        row.update({k: statistics.median(r[k] for r in mine) for k in keys})
        rows.append(row)
    for row in rows:
        full = next(
            (f for f in rows if (f["length"], f["batch"], f["method"]) == (row["length"], row["batch"], "full")), None
        )
        if full is not None:
            row["relative_to_full"] = {k: row[k] / full[k] for k in keys if full[k]}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-0.5b", help=f"{', '.join(SHAPES)}, or a config.json / folder")
    parser.add_argument("--lengths", default="4096,16384,32768", help="context lengths in tokens")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--methods", default="full,snapkv,critical-snapkv,adakv,critical-adakv")
    parser.add_argument("--budget", default="0.2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("results/gpu_speed_memory.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (benchmarks/speed_memory.py measures CPUs)")
    device = torch.device("cuda", 0)
    lengths = [int(x) for x in args.lengths.split(",")]
    batches = [int(x) for x in args.batch_sizes.split(",")]
    methods = [m.strip() for m in args.methods.split(",")]
    model = build_model(args.shape, device)
    vocab = model.config.vocab_size
    for length in lengths:
        for batch in batches:
            warm = torch.randint(0, vocab, (batch, length), device=device)
            for method in methods:
                measure(model, method, args.budget, warm, args.decode_steps)
    runs: list[dict] = []
    started = time.perf_counter()
    for repeat in range(args.repeats):
        for length in lengths:
            for batch in batches:
                gen = torch.Generator().manual_seed(1000 * repeat + length + batch)
                ids = torch.randint(0, vocab, (batch, length), generator=gen).to(device)
                shift = repeat % len(methods)
                for method in methods[shift:] + methods[:shift]:
                    result = measure(model, method, args.budget, ids, args.decode_steps)
                    runs.append({"repeat": repeat, "length": length, "batch": batch, "method": method, **result})
                    print(
                        f"[{time.perf_counter() - started:6.0f} s] r{repeat} {length:6d} x{batch} {method:16s} "
                        f"TTFT {result['ttft_seconds']:7.3f} s  decode {result['decode_ms_per_token_median']:6.2f} "
                        f"ms  KV {result['kv_bytes'] / 2**20:8.1f} MiB  "
                        f"peak +{result['peak_cuda_above_start_bytes'] / 2**20:8.1f} MiB",
                        flush=True,
                    )
            report = {
                "command": "python benchmarks/gpu_speed_memory.py "
                + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
                "shape": args.shape,
                "weights": "random (bfloat16)",
                "budget": args.budget,
                "gpu": torch.cuda.get_device_name(device),
                "versions": {
                    "python": platform.python_version(),
                    "torch": torch.__version__,
                    "cuda": torch.version.cuda,
                    "transformers": __import__("transformers").__version__,
                    "criticalkv": criticalkv.__version__,
                },
                "summary": summarise(runs),
                "runs": runs,
            }
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
