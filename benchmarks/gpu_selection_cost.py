"""Where a compressed prefill's time goes on a GPU: the value-norm kernel's configs, and each piece's cost per layer.

On a model of a real model's shape with random weights (``gpu_speed_memory.build_model``), bfloat16, SDPA:

1. ``kernel``: the float32 value norms of one layer, values (b, h_kv, t, d) drawn at random, by the tuned Triton
   kernel and by each of its configs, by the chunked float32 products (the path without triton) and by the chunked
   products in the model's dtype (``norm_dtype=model``): median ms (``triton.testing.do_bench``), the kernel's
   TFLOP/s (2 b t h_q d hidden multiply-adds) beside a bfloat16 8192^3 matrix product's, and the largest relative
   difference of the kernel's norms from the chunked float32 ones.
2. ``layers``: prefills of random token ids, one method after another, with every decoder layer, compression step
   (``Compressor.compress_layer``), scoring (``Method.scores_of``) and value-norm call synchronised and timed: the
   median over layers and repeats of each, ms. The synchronisations make these prefills a little slower than
   ``gpu_speed_memory.py``'s, which times the prefill alone.

    python benchmarks/gpu_selection_cost.py --shape llama-3.1-8b --tokens 32768 --batch 1 \\
        --methods full,snapkv,critical-snapkv,critical-adakv --out results/gpu_selection_cost.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from unittest import mock

import torch
from gpu_speed_memory import build_model
from transformers import DynamicCache

import criticalkv
from criticalkv.models.families import head_dim
from criticalkv.runtime.compressor import Compressor
from criticalkv.runtime.method import Method
from criticalkv.selectors import critical, defensive, norm_screen, value_norm


def _synchronised(timings: list[float], function):
    """``function`` wrapped to append its synchronised wall time (ms) to ``timings``."""

    def timed(*args, **kwargs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = function(*args, **kwargs)
        torch.cuda.synchronize()
        timings.append(1000 * (time.perf_counter() - start))
        return result

    return timed


def kernel_costs(model: torch.nn.Module, batch: int, tokens: int) -> dict:
    """Part 1: the value norms of one layer at the model's shape, by every path."""
    from triton.runtime.errors import OutOfResources
    from triton.testing import do_bench

    from criticalkv.selectors.value_norm_triton import CONFIGS, fused_projected_value_norm

    config = model.config
    h_kv, h_q, d = config.num_key_value_heads, config.num_attention_heads, head_dim(config)
    weight = model.model.layers[0].self_attn.o_proj.weight  # (hidden, h_q * d)
    gen = torch.Generator(device=weight.device).manual_seed(0)
    values = torch.randn(batch, tokens, h_kv, d, device=weight.device, generator=gen, dtype=weight.dtype)
    values = values.transpose(1, 2)  # (b, h_kv, t, d), as the attention layers hand them over
    flops = 2 * batch * tokens * h_q * d * config.hidden_size
    paths = {"tuned kernel": lambda: fused_projected_value_norm(values, weight)}
    for i, c in enumerate(CONFIGS):
        paths[f"config {i}: {c.kwargs} warps {c.num_warps} stages {c.num_stages}"] = lambda c=c: (
            fused_projected_value_norm(values, weight, c)
        )
    with mock.patch.object(value_norm, "fused_kernel", lambda: None):
        reference = value_norm.projected_value_norm(values, weight)  # chunked float32 products
        paths["chunked float32"] = lambda: value_norm.projected_value_norm(values, weight)
        paths["chunked model dtype"] = lambda: value_norm.projected_value_norm(values, weight, compute_dtype=None)
        rows = []
        for name, run in paths.items():
            try:
                ms = do_bench(run, warmup=25, rep=100)
            except OutOfResources as error:  # a config this GPU cannot hold (the tuner skips it the same way)
                rows.append({"path": name, "error": str(error)})
                print(f"{name:70s} {error}", flush=True)
                continue
            rows.append({"path": name, "ms": ms, "tflops": flops / ms / 1e9})
            print(f"{name:70s} {ms:8.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s", flush=True)
    fused = fused_projected_value_norm(values, weight)
    difference = ((fused - reference).abs() / reference.abs().clamp(min=1e-30)).max().item()
    a = torch.randn(8192, 8192, device=weight.device, dtype=torch.bfloat16)
    gemm_ms = do_bench(lambda: a @ a, warmup=25, rep=100)
    return {
        "batch": batch,
        "tokens": tokens,
        "values_shape": list(values.shape),
        "weight_shape": list(weight.shape),
        "flops": flops,
        "paths": rows,
        "max_relative_difference_tuned_vs_chunked_float32": difference,
        "bf16_gemm_8192_tflops": 2 * 8192**3 / gemm_ms / 1e9,
    }


@contextlib.contextmanager
def timed_pieces(model: torch.nn.Module, timings: defaultdict[str, list[float]]):
    """Synchronised timers on every decoder layer, compression step, scoring and value-norm call: each appends its
    ms to its list in ``timings`` (a ``defaultdict(list)``)."""
    layers = model.model.layers
    starts: dict[int, float] = {}

    def before(module, args):
        torch.cuda.synchronize()
        starts[id(module)] = time.perf_counter()

    def after(module, args, output):
        torch.cuda.synchronize()
        timings["decoder layer"].append(1000 * (time.perf_counter() - starts[id(module)]))

    handles = [
        h for layer in layers for h in (layer.register_forward_pre_hook(before), layer.register_forward_hook(after))
    ]
    patches = [
        mock.patch.object(
            Compressor, "compress_layer", _synchronised(timings["compression"], Compressor.compress_layer)
        ),
        mock.patch.object(Method, "scores_of", _synchronised(timings["scoring"], Method.scores_of)),
    ]
    norm = _synchronised(timings["value norms"], value_norm.projected_value_norm)
    patches += [
        mock.patch.object(module, "projected_value_norm", norm) for module in (critical, defensive, norm_screen)
    ]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


@torch.no_grad()
def layer_costs(model: torch.nn.Module, methods: list[str], budget: str, batch: int, tokens: int, repeats: int) -> list:
    """Part 2: per method, the median per layer of each piece's synchronised time (ms)."""
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens), device=device)
    rows = []
    for method in methods:
        timings: dict[str, list[float]] = defaultdict(list)
        for repeat in range(repeats + 1):  # the first prefill warms the method up, untimed
            mine: dict[str, list[float]] = defaultdict(list)
            with criticalkv.compress(model, method, budget), timed_pieces(model, mine):
                model(input_ids=ids, cache=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
            if repeat:
                for key, values in mine.items():
                    if values:  # a piece the method never calls (full: no compression) gets no column
                        timings[key].extend(values)
        row = {"method": method, "layers": len(model.model.layers), "repeats": repeats}
        row.update({f"{key} ms": statistics.median(values) for key, values in timings.items()})
        row.update({f"{key} calls": len(values) for key, values in timings.items()})
        rows.append(row)
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b", help="a shape of gpu_speed_memory.py, or a config.json")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--methods", default="full,snapkv,critical-snapkv,critical-adakv")
    parser.add_argument("--budget", default="0.2")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--parts", default="kernel,layers")
    parser.add_argument("--out", type=Path, default=Path("results/gpu_selection_cost.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    model = build_model(args.shape, torch.device("cuda", 0))
    parts = args.parts.split(",")
    report = {
        "command": "python benchmarks/gpu_selection_cost.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "gpu": torch.cuda.get_device_name(0),
        "versions": {"torch": torch.__version__, "triton": __import__("triton").__version__},
    }
    if "kernel" in parts:
        report["kernel"] = kernel_costs(model, args.batch, args.tokens)
    if "layers" in parts:
        methods = [m.strip() for m in args.methods.split(",")]
        report["layers"] = layer_costs(model, methods, args.budget, args.batch, args.tokens, args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
