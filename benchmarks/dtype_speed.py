"""The full prefill of one prompt in float32 and in bfloat16 on the CPU, in one process: what ``--dtype auto`` chooses
between for a preset on a CPU without bfloat16 instructions (``criticalkv.models.device_dtype.preset_dtype``).

The two models load from the same preset and take turns (float32 first in every repeat); each figure is the process
CPU time of one forward over the needle prompt, the fastest repeat of each dtype is compared.

    OMP_NUM_THREADS=1 python benchmarks/dtype_speed.py --model smollm2-135m --tokens 4096 --repeats 2 --threads 1
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from criticalkv.core.device import cpu_multiplies_bfloat16
from criticalkv.eval.needle import needle_prompt_ids
from criticalkv.models import load_model

DTYPES = ("float32", "bfloat16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = {dtype: load_model(args.model, dtype=dtype, device="cpu") for dtype in DTYPES}
    ids = torch.tensor([needle_prompt_ids(loaded["float32"][1], args.tokens)])  # (1, prompt tokens)
    seconds: dict[str, list[float]] = {dtype: [] for dtype in DTYPES}
    with torch.no_grad():
        for _ in range(args.repeats):
            for dtype, (model, _) in loaded.items():
                start = time.process_time()
                model(ids)
                seconds[dtype].append(time.process_time() - start)
    report = {
        "model": args.model,
        "prompt_tokens": ids.shape[1],
        "threads": args.threads,
        "cpu_multiplies_bfloat16": cpu_multiplies_bfloat16(),
        "cpu_seconds": seconds,
        "bfloat16_over_float32": min(seconds["bfloat16"]) / min(seconds["float32"]),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
