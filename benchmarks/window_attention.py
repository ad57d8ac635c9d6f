"""The observation window's attention on a CPU, as criticalkv computes it, against one product and a fresh softmax.

criticalkv's ``window_attention`` (scorers/base.py) computes the window's logits ``CPU_KEY_CHUNK`` keys at a time
and writes the softmax over them. This script times real prefills of a compressed method with it and with the
form it replaced, one product over every key and a softmax into a new tensor (``one_product`` below, the
baseline), alternating the two in one process (which goes first turned each repeat), and checks that both keep the
same entries in every layer of every run. Figures: each prefill's compression CPU time and time to first token.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/window_attention.py --model qwen2.5-0.5b --tokens 16384 \\
        --repeats 3 --threads 1 --out results/window_attention_qwen_16k.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache

import criticalkv
from criticalkv.models import load_model
from criticalkv.runtime.api import make_compressor
from criticalkv.scorers import snapkv
from criticalkv.scorers.base import LayerView

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/, for timed_generation and speed_memory
from speed_memory import prompt_ids
from timed_generation import ALLOCATORS, rerun_under, timed_greedy

RERUN = "CRITICALKV_WINDOW_ATTENTION_ALLOCATOR"  # set in the re-run process: the allocator setting it runs under
METHODS = ("snapkv", "critical-snapkv", "critical-adakv")  # presets whose scores read the window's attention


def one_product(view: LayerView, window: int) -> torch.Tensor:
    """The baseline: the window's attention (b, h_kv, G, w, t) float32 from one product over every key and a
    softmax into a new tensor, as criticalkv computed it before ``CPU_KEY_CHUNK``."""
    b, h_kv, t, d = view.keys.shape
    g, w = view.groups, min(window, t)
    q = view.query[:, :, -w:, :].float().reshape(b, h_kv, g * w, d) * view.scaling  # (b, h_kv, G*w, d)
    logits = torch.matmul(q, view.keys.float().transpose(-1, -2)).view(b, h_kv, g, w, t)  # (b, h_kv, G, w, t)
    logits[..., t - w :].masked_fill_(torch.ones(w, w, dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
    if view.padded:
        logits.masked_fill_(~view.valid[:, None, None, None, :], float("-inf"))
    return torch.softmax(logits, dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="a criticalkv preset name or a local model folder")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length, template and question included")
    parser.add_argument("--repeats", type=int, default=3, help="prefills of each form after one warm-up each")
    parser.add_argument("--method", default="snapkv", choices=METHODS)
    parser.add_argument("--budget", default="0.2")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--allocator", choices=ALLOCATORS, default="retain", help="glibc's allocator setting")
    parser.add_argument("--out", type=Path, default=Path("results/window_attention.json"))
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    allocator = rerun_under(args.allocator, RERUN)
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_model(args.model, dtype=args.dtype, device="cpu")
    ids = torch.tensor([prompt_ids(tokenizer, args.tokens)])  # (1, t)
    compressor = make_compressor(model, args.method, args.budget)
    compressor.record_keep = True
    forms = {"chunked": snapkv.window_attention, "one_product": one_product}

    def prefill(form: str) -> tuple[dict, list[torch.Tensor]]:
        snapkv.window_attention = forms[form]  # what the SnapKV scores (and CriticalKV's first stage) call
        compressor.start_prefill()  # this prefill's records alone
        with compressor:
            result = timed_greedy(
                model,
                ids,
                DynamicCache(config=model.config),
                0,
                compression_clock=lambda: compressor.compress_cpu_seconds,
            )
        return result, [record.keep for record in compressor.records]

    for form in forms:  # warm-up: both paths once, and a whole prompt's memory mapped in
        prefill(form)
    runs, same = [], True
    for repeat in range(args.repeats):
        kept = {}
        for form in list(forms)[repeat % 2 :] + list(forms)[: repeat % 2]:
            result, kept[form] = prefill(form)
            runs.append({"form": form, "repeat": repeat, **{k: v for k, v in result.items() if k != "generated"}})
            print(
                f"repeat {repeat + 1}/{args.repeats} {form:12s} compression {result['compression_cpu_seconds']:.3f}"
                f" CPU s, TTFT {result['ttft_cpu_seconds']:.3f}",
                flush=True,
            )
        same &= all(torch.equal(a, b) for a, b in zip(kept["chunked"], kept["one_product"], strict=True))
    snapkv.window_attention = forms["chunked"]

    def median(form: str, figure: str) -> float:
        return statistics.median(r[figure] for r in runs if r["form"] == form)

    summary = {
        f"{figure}_{form}": median(form, figure)
        for figure in ("compression_cpu_seconds", "ttft_cpu_seconds")
        for form in forms
    }
    summary["same_entries_kept"] = same
    report = {
        "command": "python benchmarks/window_attention.py " + " ".join(sys.argv[1:]),
        "model": args.model,
        "method": args.method,
        "prompt_tokens": ids.shape[1],
        "budget": args.budget,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "allocator": allocator,
        "machine": platform.machine(),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "criticalkv": criticalkv.__version__,
        },
        "runs": runs,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
