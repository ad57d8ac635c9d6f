"""How many of the entries CriticalKV keeps with its default value norms are the ones every float32 norm keeps.

One prefill of the needle prompt serves every (method, budget) pair with the default value-norm path (the screen
where it runs, the fused kernel on a GPU or a CPU with AMX), and a second prefill of the same prompt every pair
with ``screen=false`` and the fused kernels switched off (every float32 norm from torch's chunked products: the
reference). Per pair: the share of the reference's kept entries the default path keeps too, and the layers where
the two keep masks differ at all.

    python benchmarks/kept_agreement.py --model smollm2-135m --tokens 4096 --budgets 0.1,0.2,0.4 \
        --out results/kept_agreement_smollm2_4k.json"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from criticalkv.eval.needle import needle_prompt_ids
from criticalkv.methods import build_method
from criticalkv.models import load_model
from criticalkv.runtime.method import Method
from criticalkv.runtime.shared_prefill import SharedPrefill
from criticalkv.selectors import value_norm, value_norm_amx


def recording(method: Method, masks: list[torch.Tensor]) -> Method:
    """``method`` whose every layer's keep mask (b, h_kv, t) bool is appended to ``masks``."""
    decide = method.decide

    def decide_and_record(view, budget, state):
        decision = decide(view, budget, state)
        masks.append(decision.keep.clone())
        return decision

    method.decide = decide_and_record
    return method


@contextlib.contextmanager
def fused_kernels_off() -> Iterator[None]:
    """Every float32 norm from torch's chunked products: neither the GPU's Triton kernel nor the CPU's AMX one."""
    kernel, handles = value_norm.fused_kernel, value_norm_amx.handles
    value_norm.fused_kernel, value_norm_amx.handles = (lambda: None), (lambda values, weight: False)
    try:
        yield
    finally:
        value_norm.fused_kernel, value_norm_amx.handles = kernel, handles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--budgets", default="0.1,0.2,0.4")
    parser.add_argument("--methods", default="critical-snapkv,critical-adakv")
    parser.add_argument("--dtype", default="bfloat16", help="the model's dtype (the screen bounds bfloat16 values)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=Path("results/kept_agreement.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_model(args.model, dtype=args.dtype)
    ids = torch.tensor([needle_prompt_ids(tokenizer, args.tokens)])
    pairs = [(spec, budget) for spec in args.methods.split(",") for budget in args.budgets.split(",")]
    masks: dict[tuple[str, str, str], list[torch.Tensor]] = {}
    for path, off in (("default", contextlib.nullcontext()), ("reference", fused_kernels_off())):
        targets = []
        for spec, budget in pairs:
            masks[spec, budget, path] = []
            full_spec = spec if path == "default" else f"{spec}:screen=false"
            targets.append(
                (f"{path} {spec} {budget}", recording(build_method(full_spec), masks[spec, budget, path]), budget)
            )
        with off:
            SharedPrefill(model, targets).prefill(ids)

    report = {
        "command": "python benchmarks/kept_agreement.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "prompt_tokens": int(ids.shape[1]),
        "dtype": str(next(model.parameters()).dtype),
        "cpu_value_norms": value_norm_amx.describe(),
        "pairs": {},
    }
    for spec, budget in pairs:
        default, reference = masks[spec, budget, "default"], masks[spec, budget, "reference"]
        kept = sum(int(r.sum()) for r in reference)
        shared = sum(int((d & r).sum()) for d, r in zip(default, reference, strict=True))
        differing = [
            layer for layer, (d, r) in enumerate(zip(default, reference, strict=True)) if not torch.equal(d, r)
        ]
        report["pairs"][f"{spec} {budget}"] = {
            "kept_entries": kept,
            "kept_by_both": shared,
            "agreement": shared / kept if kept else 1.0,
            "layers_differing": differing,
        }
        print(
            f"{spec:18s} budget {budget}: {shared}/{kept} kept entries agree ({shared / max(kept, 1):.4%}); "
            f"layers differing: {differing or 'none'}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
