"""Does a method keep the needle? The answer on needle prompts and, per token of the needle's number, the share of
(layer, KV head) pairs whose kept set holds it.

At budget b a token the selection ignores is kept in about a share b of the pairs; a needle the method finds is
kept in far more.

    python benchmarks/needle_kept.py --model smollm2-135m --lengths 1024,2048,4096 --depths 0.25,0.5,0.75 \
        --methods snapkv,critical-snapkv --budget 0.2 --threads 1 --out results/needle_kept_smollm2.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from criticalkv.eval.needle import build_needle_sample
from criticalkv.models import load_model
from criticalkv.prompts import chat_prompt_parts, encode_prompt_parts, text_token_span
from criticalkv.runtime.session import ContextSession


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", default="1024,2048,4096")
    parser.add_argument("--depths", default="0.25,0.5,0.75")
    parser.add_argument("--methods", default="snapkv,critical-snapkv")
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--answer-tokens", type=int, default=12)
    parser.add_argument("--dtype", default="auto", help="the model's dtype (auto: as criticalkv run reads it)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=Path("results/needle_kept.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_model(args.model, dtype=args.dtype)
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        for depth in (float(x) for x in args.depths.split(",")):
            sample = build_needle_sample(tokenizer, length, depth=depth, seed=0)
            prefix, suffix = chat_prompt_parts(tokenizer, sample.context, sample.question, sample.answer_prefix)
            prefix_ids, suffix_ids = encode_prompt_parts(tokenizer, prefix, suffix)
            ids = torch.tensor([prefix_ids + suffix_ids])
            positions = range(*text_token_span(tokenizer, prefix, sample.answer, len(prefix_ids)))
            for method in ["full", *args.methods.split(",")]:
                session = ContextSession(model, method, args.budget)
                if session.compressor is not None:
                    session.compressor.record_keep = True
                session.prefill(ids)
                answer = tokenizer.decode(
                    session.ask(None, args.answer_tokens, eos_token_id=None).tokens[0], skip_special_tokens=True
                )
                shares = None
                if session.compressor is not None:
                    keep = torch.stack([r.keep[0] for r in session.compressor.records])  # (layers, h_kv, t)
                    shares = [round(float(keep[:, :, p].float().mean()), 4) for p in positions]
                rows.append(
                    {
                        "length": ids.shape[1],
                        "depth": depth,
                        "method": method,
                        "needle": sample.answer,
                        "answer": answer.strip(),
                        "found": sample.answer in answer,
                        "kept_share_per_needle_token": shares,
                    }
                )
                kept = " ".join(f"{s:.2f}" for s in shares) if shares else "-"
                print(f"{ids.shape[1]:6d} {depth:4.2f} {method:18s} {answer.strip()[:16]!r:20s} kept: {kept}")
    report = {
        "command": "python benchmarks/needle_kept.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "model": args.model,
        "budget": args.budget,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
