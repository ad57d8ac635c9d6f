#!/usr/bin/env python
"""Greedy answers of kvpress 0.5.5 presses to many question-agnostic samples, for benchmarks/quality_vs_kvpress.py.

Runs INSIDE kvpress's virtual environment (setup_kvpress_env.sh), as its own process; it never imports criticalkv.
Each sample's context is prefilled under the press (compressed), then its question is fed on the compressed cache
and the answer decoded greedily outside the press, positions continuing at the context's length: kvpress's
pipeline, question-agnostic. The model is loaded once for every sample and press.

    $VENV/bin/python benchmarks/kvpress/answer_kvpress.py --model FOLDER --input samples.jsonl \
        --presses none,snapkv,critical-snapkv,critical-adakv --eos 2 --dtype float32 --out answers.jsonl

Input, one JSON object a line: {"key": str, "context_ids": [...], "question_ids": [...], "max_new_tokens": int,
"compression_ratio": float}. Output, appended a line per (sample, press): {"key", "press", "tokens"}, the tokens
up to and including the first end-of-sequence token. Samples every press has answered are skipped, so an
interrupted run resumes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from run_kvpress import PRESSES, add_model_and_press_options, build_press, load_model


def answered(path: Path) -> dict[str, set[str]]:
    """Presses that already answered each sample key."""
    done: dict[str, set[str]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                done.setdefault(row["key"], set()).add(row["press"])
    return done


def answer(model, press, context_ids, question_ids, max_new_tokens: int, eos: set[int], torch) -> list[int]:
    """Compress the context under ``press``, then feed the question and decode greedily (EOS stops)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    t = context_ids.shape[1]
    with torch.no_grad():
        with press(model) if press is not None else contextlib.nullcontext():
            model(input_ids=context_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        q = question_ids.shape[1]
        positions = torch.arange(t, t + q, device=context_ids.device)[None]
        out = model(input_ids=question_ids, past_key_values=cache, position_ids=positions, logits_to_keep=1)
        tokens: list[int] = []
        for step in range(max_new_tokens):
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            if token in eos or step == max_new_tokens - 1:
                break
            position = torch.tensor([[t + q + step]], device=context_ids.device)
            out = model(
                input_ids=torch.tensor([[token]], device=context_ids.device),
                past_key_values=cache,
                position_ids=position,
            )
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_and_press_options(parser)
    parser.add_argument("--input", required=True, type=Path, help="samples, one JSON object a line")
    parser.add_argument("--presses", required=True, help=f"comma-separated, of {', '.join(PRESSES)}")
    parser.add_argument("--eos", default="", help="comma-separated end-of-sequence token ids")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    if "criticalkv" in sys.modules:
        raise SystemExit("answer_kvpress.py must not run in criticalkv's environment")
    presses = [p.strip() for p in args.presses.split(",") if p.strip()]
    unknown = [p for p in presses if p not in PRESSES]
    if unknown:
        raise SystemExit(f"unknown presses {unknown}; choose from {', '.join(PRESSES)}")

    import kvpress
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model, _, _ = load_model(args, device)
    eos = {int(x) for x in args.eos.split(",") if x.strip()}
    done = answered(args.out)
    samples = [json.loads(line) for line in args.input.read_text().splitlines() if line.strip()]
    with args.out.open("a") as sink:
        for number, sample in enumerate(samples, 1):
            context = torch.tensor([sample["context_ids"]], device=device)
            question = torch.tensor([sample["question_ids"]], device=device)
            for name in presses:
                if name in done.get(sample["key"], set()):
                    continue
                args.press, args.compression_ratio = name, sample["compression_ratio"]
                tokens = answer(
                    model, build_press(args, kvpress), context, question, sample["max_new_tokens"], eos, torch
                )
                sink.write(json.dumps({"key": sample["key"], "press": name, "tokens": tokens}) + "\n")
                sink.flush()
            print(f"[kvpress] {number}/{len(samples)} {sample['key']}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
