"""Where a chunked prefill's kept entries lie, against one-shot compression at the same number of entries: RULER
samples compressed question-agnostic (the context alone), the share of all kept entries (every layer and KV head)
in each tenth of the context (JSON, and a bar plot beside it), and per needle value the share of (layer, KV head)
pairs that hold all its tokens.

    python benchmarks/kept_positions.py --model qwen2.5-0.5b --tasks niah_single_1,niah_single_2,niah_single_3 \
        --samples 4 --method critical-snapkv --cap 1024 --chunk-size 1024 --out results/kept_positions.json

A chunked prefill follows its entries' prompt positions only for the scorers that read them (the surrogate's); the
slow reference of the tests (``tests/bounded_reference.py``: it follows every compression and refill) recovers them
for any method.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import pytest
import torch

from criticalkv.budget import Budget
from criticalkv.eval import ruler
from criticalkv.models import load_model
from criticalkv.palette import distinct_colours
from criticalkv.prompts import chat_prompt_parts, encode_prompt_parts, text_token_span
from criticalkv.runtime.session import ContextSession

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from bounded_reference import Tracker


def held_positions(model, method: str, ids: torch.Tensor, options: dict) -> torch.Tensor:
    """(layers, h_kv, t) bool: the context positions every compressed layer holds after prefilling ids (1, t)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        tracker = Tracker(model, monkeypatch)
        try:
            ContextSession(model, method, **options).prefill(ids)
            held = tracker.held(-1)  # layer -> (1, h_kv, t)
        finally:
            tracker.close()
    return torch.stack([h[0] for h in held.values()])


def shares(held: torch.Tensor, spans: list[tuple[int, int]]) -> dict:
    """Share of the kept entries per tenth of the context; per span, the share of (layer, head) holding it whole."""
    per_position = held.float().sum((0, 1))  # (t,)
    edges = torch.linspace(0, held.shape[-1], 11).long().tolist()
    tenths = [float(per_position[a:b].sum() / per_position.sum()) for a, b in itertools.pairwise(edges)]
    whole = [float(held[..., a:b].all(-1).float().mean()) for a, b in spans]
    return {"share_per_tenth": [round(x, 4) for x in tenths], "pairs_holding_value": [round(x, 4) for x in whole]}


def plot(mean: dict[str, list[float]], path: Path, title: str) -> None:
    """Bars of the share of kept entries per tenth of the context, one colour per way."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 3.5))
    axes = figure.subplots()
    width = 0.8 / len(mean)
    for i, ((way, share), colour) in enumerate(zip(mean.items(), distinct_colours(len(mean)), strict=True)):
        axes.bar([t + i * width for t in range(10)], share, width, label=way, color=colour)
    axes.set_xticks(
        [t + width * (len(mean) - 1) / 2 for t in range(10)], [f"{10 * t}-{10 * t + 10}%" for t in range(10)]
    )
    axes.set_xlabel("place in the context")
    axes.set_ylabel("share of the kept entries")
    axes.set_title(title, fontsize=9)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_single_3")
    parser.add_argument("--samples", type=int, default=4, help="per task (RULER's samples 0, 1, ...)")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--method", default="critical-snapkv")
    parser.add_argument("--cap", type=int, default=1024, help="entries per KV head, both ways")
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("results/kept_positions.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    ways = {"one-shot": {"budget": Budget(args.cap)}, "chunked": {"chunk_size": args.chunk_size, "cap": args.cap}}
    rows = []
    for task in args.tasks.split(","):
        for sample in ruler.generate(task, tokenizer, args.length, args.samples):
            prefix, _ = chat_prompt_parts(tokenizer, sample.context, sample.question, sample.answer_prefix)
            prefix_ids, _ = encode_prompt_parts(tokenizer, prefix, "")
            spans = [text_token_span(tokenizer, prefix, answer, len(prefix_ids)) for answer in sample.answers]
            ids = torch.tensor([prefix_ids])
            row = {"task": task, "index": sample.index, "tokens": len(prefix_ids)}
            row["value_at"] = [round(a / len(prefix_ids), 4) for a, _ in spans]
            for way, options in ways.items():
                row[way] = shares(held_positions(model, args.method, ids, options), spans)
            print(json.dumps(row), flush=True)
            rows.append(row)
    mean = {
        way: [round(sum(r[way]["share_per_tenth"][i] for r in rows) / len(rows), 4) for i in range(10)] for way in ways
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    report = {"settings": settings, "mean_share_per_tenth": mean, "rows": rows}
    args.out.write_text(json.dumps(report, indent=1))
    title = f"{args.model}, {args.method}, {args.cap} entries per KV head, question-agnostic, {len(rows)} samples"
    plot(mean, args.out.with_suffix(".png"), title)
    print(json.dumps(mean))


if __name__ == "__main__":
    main()
