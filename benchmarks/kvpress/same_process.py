#!/usr/bin/env python
"""criticalkv and kvpress 0.5.5 timed in one process, on criticalkv's transformers, their runs interleaved.

``speed_memory.py`` runs each system in its own process and virtual environment, as kvpress requires (it pins
transformers < 5.3): the changes of the machine's speed from process to process then sit in every ratio, and the two
transformers versions differ too. Here both run in one process on this environment's transformers, the runs of one
repeat one after the other (their order turned by one each repeat), so ours / kvpress within a repeat compares the
two systems on the same model code and the same state of the machine.

kvpress 0.5.5 is imported from its virtual environment (``setup_kvpress_env.sh``): its package only, appended to
``sys.path`` after this environment's, so torch and transformers are this environment's. Outside its pinned
transformers it needs an adapter: transformers 5.24 hands the cache to the attention modules as ``cache`` and passes
no ``cache_position``; a forward hook placed before kvpress's fills ``past_key_values`` with the cache and
``cache_position`` with the positions of the forward's tokens, the two things kvpress's hook reads of them. The
presses' own code runs unchanged. This is not kvpress's supported set-up: ``speed_memory.py`` stays the comparison
as a user runs it; this script takes the processes and transformers versions out of the ratio.

Each run is ``timed_generation.timed_greedy``, as in ``speed_memory.py``: the prefill under the method (time to
first token, and the part of it spent compressing), then ``--decode-steps`` greedy steps. One process serves every
run, so how many fresh pages a prefill maps in depends on what the runs before it left in glibc's heap: from none
to 0.8 GiB at 2k tokens under glibc's defaults, enough to move a run's time by 20%. So by default the script
re-runs itself with ``--allocator retain`` (``timed_generation.child_environment``: no buffer ``mmap``ed, the heap
never trimmed) and every method and the ``full`` control first run once on the whole prompt (``--warmup-tokens``):
the timed runs then reuse memory already mapped (their page faults are recorded).

    OMP_NUM_THREADS=1 python benchmarks/kvpress/same_process.py --model smollm2-135m --tokens 4096 --repeats 20 \
        --methods snapkv --threads 1 --out results/same_process_smollm2_4k.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import statistics
import sys
from collections.abc import Callable, Iterator
from importlib.metadata import version as dist_version
from pathlib import Path

import torch

from criticalkv.models.families import attention_modules

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/, for timed_generation and speed_memory

from run_kvpress import add_model_and_press_options, build_press, fill_config_head_dim  # noqa: E402
from speed_kvpress import HookClock  # noqa: E402
from speed_memory import VENV, kvpress_ratio, prompt_ids  # noqa: E402
from timed_generation import ALLOCATORS, rerun_under, timed_greedy  # noqa: E402

METHODS = ("snapkv", "critical-snapkv", "critical-adakv")  # criticalkv presets with a kvpress press of their own
RERUN = "CRITICALKV_SAME_PROCESS_ALLOCATOR"  # set in the re-run process: the allocator setting it runs under


def import_kvpress(venv: Path):
    """kvpress from ``venv``'s site-packages, behind this environment's packages; refuses any other version."""
    found = sorted(venv.glob("lib/python*/site-packages/kvpress"))
    if not found:
        raise SystemExit(f"no kvpress in {venv}: run benchmarks/kvpress/setup_kvpress_env.sh")
    sys.path.append(str(found[0].parent))
    import kvpress
    import transformers

    if Path(transformers.__file__).resolve().is_relative_to(venv.resolve()):
        raise SystemExit("transformers came from kvpress's environment; run this script in criticalkv's")
    if dist_version("kvpress") != "0.5.5":
        raise SystemExit(f"kvpress 0.5.5 expected, found {dist_version('kvpress')}")
    return kvpress


def cache_adapter(module: torch.nn.Module, args: tuple, kwargs: dict, output: object) -> None:
    """Forward hook run before kvpress's: the cache under kvpress's name and the forward's positions.

    kwargs is the dict every forward hook of the module receives, so kvpress's hook sees what is added here.
    """
    cache = kwargs["cache"]
    kwargs["past_key_values"] = cache
    q_len = kwargs["hidden_states"].shape[1]
    end = cache.layers[module.layer_idx].keys.shape[2]  # this layer's length after this forward's tokens
    kwargs.setdefault("cache_position", torch.arange(end - q_len, end, device=kwargs["hidden_states"].device))


@contextlib.contextmanager
def adapted(model: torch.nn.Module, press) -> Iterator[None]:
    """``press(model)`` with ``cache_adapter`` before its hook on every attention module."""
    handles = [m.register_forward_hook(cache_adapter, with_kwargs=True, prepend=True) for m in attention_modules(model)]
    try:
        with press(model):
            yield
    finally:
        for handle in handles:
            handle.remove()


def press_settings(method: str, ratio: float) -> argparse.Namespace:
    """The press options of the cross-process runs (run_kvpress's defaults: window 32, kernel 5, ...)."""
    parser = argparse.ArgumentParser()
    add_model_and_press_options(parser)
    settings = parser.parse_args(["--model", "unused", "--compression-ratio", repr(ratio)])
    settings.press = method
    return settings


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """Index of the first generated token where two runs differ (None when they agree throughout)."""
    return next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)


def summarise(runs: list[dict], methods: list[str]) -> dict[str, dict]:
    """Per method: medians of each system's time to first token, compression, the rest of the prefill and decode
    (CPU), the ratio of medians, and the median of ours / kvpress within each repeat with how often ours was lower;
    the KV bytes each holds after the prefill; the median page faults of their prefills; the first generated token at
    which the two differ in any repeat (None: the same tokens in every repeat)."""
    by = {(r["label"], r["repeat"]): r for r in runs}
    repeats = sorted({r["repeat"] for r in runs})
    summary = {}
    for method in methods:
        pairs = [(by[(f"ours:{method}", k)], by[(f"kvpress:{method}", k)]) for k in repeats]
        figures: dict[str, float | int | None] = {"repeats": len(pairs)}
        for name, read in (
            ("ttft", lambda r: r["ttft_cpu_seconds"]),
            ("compression", lambda r: r["compression_cpu_seconds"]),
            ("rest", lambda r: r["ttft_cpu_seconds"] - r["compression_cpu_seconds"]),
            ("decode_ms", lambda r: r["decode_cpu_ms_per_token_median"]),
        ):
            ours = [read(a) for a, _ in pairs]
            theirs = [read(b) for _, b in pairs]
            within = [a / b for a, b in zip(ours, theirs, strict=True)]
            measured = len(within) > 1 and all(math.isfinite(w) for w in within)  # no decode: NaN ratios
            spread = statistics.stdev(within) / len(within) ** 0.5 if measured else float("nan")
            figures |= {
                f"{name}_ours": statistics.median(ours),
                f"{name}_kvpress": statistics.median(theirs),
                f"{name}_ratio": statistics.median(ours) / statistics.median(theirs),
                f"{name}_within": statistics.median(within),
                f"{name}_within_mean": statistics.fmean(within),
                f"{name}_within_standard_error": spread,
                f"{name}_ours_lower": sum(w < 1 for w in within),
            }
        figures["kv_bytes_ours"], figures["kv_bytes_kvpress"] = pairs[0][0]["kv_bytes"], pairs[0][1]["kv_bytes"]
        figures["faults_ours"] = statistics.median(a["prefill_minor_faults"] for a, _ in pairs)
        figures["faults_kvpress"] = statistics.median(b["prefill_minor_faults"] for _, b in pairs)
        differences = [first_difference(a["generated"], b["generated"]) for a, b in pairs]
        figures["first_difference"] = min((d for d in differences if d is not None), default=None)
        summary[method] = figures
    full = [r["ttft_cpu_seconds"] for r in runs if r["label"] == "full"]
    if full:  # the control, unless the runs left it out (--no-control)
        summary["full"] = {"repeats": len(full), "ttft_median": statistics.median(full)}
    return summary


def runners(
    model, kvpress, methods: list[str], budget: str, tokens: int, control: bool = True
) -> dict[str, Callable[..., dict]]:
    """One function per label (``full`` with ``control``, ``ours:<method>``, ``kvpress:<method>``): (ids, steps) ->
    timed run."""
    from transformers import DynamicCache

    from criticalkv.runtime.api import make_compressor

    def fresh() -> DynamicCache:
        return DynamicCache(config=model.config)

    def full(ids: torch.Tensor, steps: int) -> dict:
        return timed_greedy(model, ids, fresh(), steps)

    def ours(method: str) -> Callable[..., dict]:
        compressor = make_compressor(model, method, budget)

        def run(ids: torch.Tensor, steps: int) -> dict:
            with compressor:  # installed and removed outside the timed prefill
                return timed_greedy(
                    model, ids, fresh(), steps, compression_clock=lambda: compressor.compress_cpu_seconds
                )

        return run

    def theirs(method: str) -> Callable[..., dict]:
        press = build_press(press_settings(method, kvpress_ratio(budget, tokens)), kvpress)
        clock = HookClock()
        clock.wrap(press)

        def run(ids: torch.Tensor, steps: int) -> dict:
            try:  # the hooks are registered inside the timed prefill, as speed_kvpress.py registers the press's
                return timed_greedy(model, ids, fresh(), steps, lambda: adapted(model, press), compression_clock=clock)
            finally:  # AdaKV-style presses leave their masked indices on the modules for the decode steps
                for module in attention_modules(model):
                    module.masked_key_indices = None

        return run

    table = {"full": full} if control else {}
    for method in methods:
        table[f"ours:{method}"] = ours(method)
        table[f"kvpress:{method}"] = theirs(method)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="a criticalkv preset name or a local model folder")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length, template and question included")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--budget", default="0.2")
    parser.add_argument("--methods", default="snapkv", help=f"comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--decode-steps", type=int, default=32, help="0: time the prefill alone")
    parser.add_argument(
        "--no-control", action="store_true", help="leave out the full-cache control run (more pairs in the time)"
    )
    parser.add_argument("--warmup-tokens", type=int, default=0, help="warm-up prompt length (0: the whole prompt)")
    parser.add_argument("--allocator", choices=ALLOCATORS, default="retain", help="glibc's allocator setting")
    parser.add_argument("--out", type=Path, default=Path("results/same_process.json"))
    args = parser.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or not methods:
        parser.error(f"--methods takes {', '.join(METHODS)}; got {args.methods!r}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.decode_steps < 0:
        parser.error("--decode-steps must be at least 0")
    allocator = rerun_under(args.allocator, RERUN)
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers

    import criticalkv
    from criticalkv.models import load_model

    kvpress = import_kvpress(VENV)
    model, tokenizer = load_model(args.model, dtype=args.dtype, device="cpu")
    fill_config_head_dim(model.model)  # CriticalKVPress reads config.head_dim (Qwen2's config has none)
    ids = torch.tensor([prompt_ids(tokenizer, args.tokens)])
    table = runners(model, kvpress, methods, args.budget, ids.shape[1], control=not args.no_control)
    labels = list(table)
    for label in labels:  # warm-up: every code path once, and the memory of a whole prompt mapped in
        table[label](ids[:, : args.warmup_tokens or ids.shape[1]], 2)
    report = {
        "command": "python benchmarks/kvpress/same_process.py " + " ".join(sys.argv[1:]),
        "model": args.model,
        "prompt_tokens": ids.shape[1],
        "budget": args.budget,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "allocator": allocator,
        "warmup_tokens": args.warmup_tokens or ids.shape[1],
        "machine": platform.machine(),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "criticalkv": criticalkv.__version__,
            "kvpress": dist_version("kvpress"),
        },
        "runs": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for repeat in range(args.repeats):
        turn = repeat % len(labels)
        for label in labels[turn:] + labels[:turn]:
            result = table[label](ids, args.decode_steps)
            report["runs"].append({"label": label, "repeat": repeat, **result})
            print(
                f"repeat {repeat + 1}/{args.repeats} {label:24s} TTFT {result['ttft_cpu_seconds']:7.3f} CPU s",
                flush=True,
            )
        report["summary"] = summary = summarise(report["runs"], methods)
        args.out.write_text(json.dumps(report, indent=2))  # after every repeat: a stopped run keeps its repeats
    for method in methods:
        s = summary[method]
        print(
            f"{method:16s} TTFT ours/kvpress {s['ttft_ours']:.3f}/{s['ttft_kvpress']:.3f} s x{s['ttft_ratio']:.3f}"
            f"  within x{s['ttft_within']:.3f} ({s['ttft_ours_lower']}/{s['repeats']} lower,"
            f" mean x{s['ttft_within_mean']:.4f} +- {s['ttft_within_standard_error']:.4f})"
            f"  compression {s['compression_ours']:.3f}/{s['compression_kvpress']:.3f}  rest x{s['rest_within']:.3f}"
            f"  decode x{s['decode_ms_within']:.3f}  first different token {s['first_difference']}"
        )


if __name__ == "__main__":
    main()
