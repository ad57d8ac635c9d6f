"""Kept sets of criticalkv against NVIDIA kvpress 0.5.5 on identical inputs and settings.

kvpress runs in its own virtual environment and process (benchmarks/kvpress/setup_kvpress_env.sh); both read
the same converted model folder and the same token ids, in float32 (bf16 scores are full of ties at the cut).

    python benchmarks/kvpress/compare_kept.py --model smollm2-135m --tokens 4096 --budget 0.2 \
        --methods snapkv,critical-snapkv --out results/kvpress_kept.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from criticalkv.eval.needle import build_needle_sample
from criticalkv.models import PRESETS, load_model, resolve_model_folder
from criticalkv.prompts import encode_prompt
from criticalkv.runtime.api import make_compressor

HERE = Path(__file__).parent
VENV = Path(os.environ.get("CRITICALKV_KVPRESS_VENV", Path.home() / ".cache/criticalkv/kvpress-venv"))
PRESS_OF = {
    "snapkv": "snapkv",
    "critical-snapkv": "critical-snapkv",
    "critical-adakv": "critical-adakv",
    "adakv": "adakv",
    "streaming": "streaming",
    "knorm": "knorm",
    "tova": "tova",
}


def ours(model, ids: torch.Tensor, method: str, budget: float, window: int) -> list[torch.Tensor]:
    """Keep masks (h_kv, t) per layer."""
    options = {"window": window} if "snapkv" in method or "adakv" in method else {}
    compressor = make_compressor(model, method, budget, **options)
    compressor.record_keep = True
    with compressor, torch.no_grad():
        model(input_ids=ids, use_cache=True, logits_to_keep=1)
    return [r.keep[0] for r in sorted(compressor.records, key=lambda r: r.layer)]


def theirs(folder: Path, ids: torch.Tensor, method: str, kept: int, window: int, work: Path) -> list[torch.Tensor]:
    """kvpress's kept sets for the same number of kept entries per head.

    kvpress keeps int(T * (1 - ratio)) entries; with ratio = 0.8 that product carries float error
    (0.19999999999999996 * T), so T = 4160 keeps 831 where floor(0.2 * T) = 832. The ratio passed here puts the
    product half an entry above the count, so both keep the same number and the comparison is of selection only.
    """
    ratio = 1 - (kept + 0.5) / ids.shape[1]
    source = work / "ids.json"
    source.write_text(json.dumps({"input_ids": ids.tolist()}))
    out = work / f"{method}.pt"
    subprocess.run(
        [
            str(VENV / "bin/python"),
            str(HERE / "run_kvpress.py"),
            "--model",
            str(folder),
            "--input",
            str(source),
            "--press",
            PRESS_OF[method],
            "--compression-ratio",
            repr(ratio),
            "--window-size",
            str(window),
            "--dtype",
            "float32",
            "--out",
            str(out),
        ],
        check=True,
    )
    kept = torch.load(out)["kept"]
    t = ids.shape[1]
    masks = []
    for layer in kept:
        mask = torch.zeros(len(layer), t, dtype=torch.bool)
        for head, positions in enumerate(layer):
            mask[head, positions] = True
        masks.append(mask)
    return masks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--methods", default="snapkv,critical-snapkv")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/kvpress_kept.json"))
    args = parser.parse_args()

    folder = resolve_model_folder(args.model) if args.model in PRESETS else Path(args.model)
    model, tokenizer = load_model(str(folder), dtype="float32")
    sample = build_needle_sample(tokenizer, args.tokens, seed=args.seed)
    prefix_ids, suffix_ids = encode_prompt(tokenizer, sample.context, sample.question, sample.answer_prefix)
    ids = torch.tensor([prefix_ids + suffix_ids])
    kvpress_rounding = int(ids.shape[1] * (1 - (1 - args.budget)))
    report = {
        "kvpress_entries_at_ratio": kvpress_rounding,
        "command": "python benchmarks/kvpress/compare_kept.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
        "prompt_tokens": ids.shape[1],
        "methods": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for method in [m.strip() for m in args.methods.split(",")]:
            a = ours(model, ids, method, args.budget, args.window)
            row_budget = int(a[0].sum()) // a[0].shape[0]  # head-wise budgets average to the row budget
            b = theirs(folder, ids, method, row_budget, args.window, Path(tmp))
            per_head_equal = [bool(torch.equal(x, y)) for la, lb in zip(a, b, strict=True) for x, y in zip(la, lb)]
            overlap = [(x & y).sum().item() / max(1, y.sum().item()) for la, lb in zip(a, b) for x, y in zip(la, lb)]
            counts = [(int(x.sum()), int(y.sum())) for la, lb in zip(a, b) for x, y in zip(la, lb)]
            differing = [
                {
                    "layer": i,
                    "head": h,
                    "ours_only": torch.nonzero(x & ~y).flatten().tolist(),
                    "kvpress_only": torch.nonzero(y & ~x).flatten().tolist(),
                }
                for i, (la, lb) in enumerate(zip(a, b))
                for h, (x, y) in enumerate(zip(la, lb))
                if not torch.equal(x, y)
            ]
            report["methods"][method] = {
                "heads": len(per_head_equal),
                "heads_identical": sum(per_head_equal),
                "entry_agreement": sum(overlap) / len(overlap),
                "kept_counts_equal": all(x == y for x, y in counts),
                "kept_per_head": counts[0],
                "differences": differing[:20],
            }
            r = report["methods"][method]
            print(
                f"{method:16s} identical heads {r['heads_identical']}/{r['heads']}  "
                f"entry agreement {100 * r['entry_agreement']:.3f}%  counts equal {r['kept_counts_equal']}"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
