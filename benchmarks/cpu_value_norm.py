"""One layer's CriticalKV value norms on a CPU, path by path: the fused AMX kernel against torch's products.

For each model shape, values (1, h_kv, t, d) and an output projection drawn at random in bfloat16, one thread:

* ``amx kernel``: ``value_norm_amx`` (the default for bfloat16 values where it builds), float32 norms;
* ``torch float32``: torch's chunked float32 products (every float32 norm without the kernel: ``screen=false``
  with ``$CRITICALKV_AMX=0``);
* ``torch bfloat16, rounded sums``: the screen's bracket (``norm_screen.norm_bounds``' norms, without its bound);
* ``torch bfloat16``: ``norm_dtype="model"``, kvpress's bfloat16 products with float32 sums.

Median ms over interleaved repeats (CPU time), the kernel's GFLOP/s (2 t h_q d hidden multiply-adds), and the
largest relative difference of the kernel's norms from torch's float32 ones.

    OMP_NUM_THREADS=1 python benchmarks/cpu_value_norm.py --tokens 4096 --repeats 5 --out results/cpu_value_norm.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from kept_agreement import fused_kernels_off

from criticalkv.selectors import value_norm_amx
from criticalkv.selectors.value_norm import projected_value_norm

#: name -> (h_q, h_kv, head_dim, hidden) of the presets and of Llama-3.1-8B
SHAPES = {
    "smollm2-135m": (9, 3, 64, 576),
    "qwen2.5-0.5b": (14, 2, 64, 896),
    "qwen2.5-1.5b": (12, 2, 128, 1536),
    "llama-3.1-8b": (32, 8, 128, 4096),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated among {', '.join(SHAPES)}")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("results/cpu_value_norm.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    kernel = value_norm_amx.amx_kernel()
    if kernel is None:
        raise SystemExit(f"no AMX kernel on this machine: {value_norm_amx.why_no_amx_kernel()}")

    report = {
        "command": "python benchmarks/cpu_value_norm.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "cpu_value_norms": value_norm_amx.describe(),
        "torch": torch.__version__,
        "shapes": {},
    }
    for name in args.shapes.split(","):
        h_q, h_kv, d, hidden = SHAPES[name]
        gen = torch.Generator().manual_seed(0)
        values = torch.randn(1, h_kv, args.tokens, d, generator=gen).bfloat16()
        weight = (torch.randn(hidden, h_q * d, generator=gen) / d**0.5).bfloat16()
        paths = {
            "amx kernel": lambda v=values, w=weight: kernel(v, w).mean(-1),
            "torch float32": lambda v=values, w=weight: _torch_float32(v, w),
            "torch bfloat16, rounded sums": lambda v=values, w=weight: projected_value_norm(
                v, w, None, rounded_sums=True
            ),
            "torch bfloat16": lambda v=values, w=weight: projected_value_norm(v, w, None),
        }
        times: dict[str, list[float]] = {path: [] for path in paths}
        for path in paths.values():  # warm-up: the kernel's packed weight, torch's first calls
            path()
        for _ in range(args.repeats):
            for path, compute in paths.items():
                start = time.process_time()
                compute()
                times[path].append((time.process_time() - start) * 1e3)
        exact = _torch_float32(values, weight)
        difference = ((paths["amx kernel"]() - exact).abs() / exact).max().item()
        median = {path: statistics.median(each) for path, each in times.items()}
        flops = 2 * args.tokens * h_q * d * hidden
        report["shapes"][name] = {
            "h_q, h_kv, head_dim, hidden": [h_q, h_kv, d, hidden],
            "median_ms": median,
            "ms_each": times,
            "kernel_gflops": flops / median["amx kernel"] / 1e6,
            "kernel_max_relative_difference": difference,
        }
        print(
            f"{name:13s} "
            + "  ".join(f"{path} {ms:7.2f} ms" for path, ms in median.items())
            + f"  kernel {flops / median['amx kernel'] / 1e6:5.0f} GFLOP/s, max rel. difference {difference:.1e}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


def _torch_float32(values: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """torch's chunked float32 products, the kernel switched off."""
    with fused_kernels_off():
        return projected_value_norm(values, weight)


if __name__ == "__main__":
    main()
