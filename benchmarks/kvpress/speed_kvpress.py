#!/usr/bin/env python
"""Speed and memory runs of one kvpress 0.5.5 press, for benchmarks/speed_memory.py: prints one JSON line (a list).

Runs INSIDE kvpress's virtual environment (setup_kvpress_env.sh), as its own process; it never imports criticalkv.
It times exactly what criticalkv's side times, with the same code (benchmarks/timed_generation.py): a warm-up
generation on the first tokens, then the prefill under the press and greedy decoding outside it, as kvpress's
pipeline does. No recorder is installed, so kvpress runs its own code only. The CPU time of the press's forward
hooks (reading the layer's cache, ``compress``, writing it back) is summed as its compression time.

    $VENV/bin/python benchmarks/kvpress/speed_kvpress.py --model FOLDER --input IDS.json --press snapkv \
        --compression-ratio 0.7998 --dtype bfloat16 --threads 1 --decode-steps 32
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import platform
import sys
import time
from importlib.metadata import version as dist_version
from pathlib import Path

from run_kvpress import PRESSES, add_model_and_press_options, build_press, load_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/, for timed_generation


class HookClock:
    """Running total of the CPU seconds a press spends in its forward hooks (``wrap`` installs it on the press)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, press) -> None:
        hook = press.forward_hook  # BasePress.__call__ registers this attribute on every attention layer

        @functools.wraps(hook)
        def timed(*args, **kwargs):
            start = time.process_time()
            try:
                return hook(*args, **kwargs)
            finally:
                self.seconds += time.process_time() - start

        press.forward_hook = timed

    def __call__(self) -> float:
        return self.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_and_press_options(parser)
    parser.add_argument("--input", required=True, help='JSON file {"input_ids": [[...]]}, batch 1')
    parser.add_argument("--press", required=True, choices=PRESSES)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--warmup-tokens", type=int, default=256, help="prompt length of the warm-up run")
    parser.add_argument("--warmup-steps", type=int, default=2, help="decode steps of the warm-up run")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runs-per-process", type=int, default=1, help="timed runs after the warm-up")
    parser.add_argument("--count-ops", action="store_true", help="count the operators of one more prefill")
    parser.add_argument("--phases", action="store_true", help="split each prefill into phases (PhaseClock)")
    args = parser.parse_args()
    if "criticalkv" in sys.modules:
        raise SystemExit("speed_kvpress.py must not run in criticalkv's environment")

    import kvpress
    import torch
    import transformers
    from timed_generation import PhaseClock, count_prefill_ops, timed_greedy
    from transformers import DynamicCache

    transformers.utils.logging.disable_progress_bar()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    ids = torch.tensor(json.loads(Path(args.input).read_text())["input_ids"], dtype=torch.long, device=device)
    model, _, patched = load_model(args, device)
    press = build_press(args, kvpress)
    scope = (lambda: press(model)) if press is not None else contextlib.nullcontext
    clock = None
    phases = PhaseClock(model) if args.phases else None  # its hooks come before the press's, added at each prefill
    if press is not None:
        clock = HookClock()
        clock.wrap(press)
        if phases is not None:
            phases.wrap(press, "forward_hook", "compression")
    timed_greedy(model, ids[:, : args.warmup_tokens], DynamicCache(), args.warmup_steps, scope)
    results = [
        timed_greedy(model, ids, DynamicCache(), args.decode_steps, scope, compression_clock=clock, phase_clock=phases)
        for _ in range(args.runs_per_process)
    ]
    ops = count_prefill_ops(model, ids, DynamicCache(), scope) if args.count_ops else {}
    shared = {
        "system": "kvpress",
        "press": args.press,
        "press_repr": repr(press),
        "compression_ratio": args.compression_ratio,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "patched_config_head_dim": patched,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "kvpress": dist_version("kvpress"),
        },
    }
    print(json.dumps([{**result, **shared, **ops, "run_in_process": k} for k, result in enumerate(results)]))


if __name__ == "__main__":
    main()
