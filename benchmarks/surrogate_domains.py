"""Does the shipped surrogate of the reconstruction scorer rank entries as well on text unlike its training text?

The surrogate of each preset is fitted on the King James text (``criticalkv train-scorer``); the evaluation
haystacks are other prose: RULER's essays (``eval ruler``) and the Python language reference (``eval facts``).
For each of the three texts, seeded windows of the card's length are prefilled under the reconstruction scorer the
surrogate was fitted to (the card's chunk size and sinks) and the shipped map is measured as ``train-scorer``
measures it on its held-out windows: per layer the rank correlation with the true scores and the share of the true
20% best entries it keeps (means over layers and heads), and that share over every layer at once (the cross-layer
presets' contest). King James windows come from the held-out last fifth, so no window was trained on; windows of
the haystacks measure the fit only (nothing is fitted on them).

    python benchmarks/surrogate_domains.py --model qwen2.5-0.5b --windows 3 --threads 1 \
        --out results/surrogate_domains_qwen.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from criticalkv.eval.facts import haystack_text
from criticalkv.eval.needle import load_haystack
from criticalkv.models import load_model
from criticalkv.progress import step_progress
from criticalkv.scorers.reconstruct import ReconstructionScorer
from criticalkv.scorers.surrogate import SurrogateWeights, shipped_for
from criticalkv.training.surrogate import HeldOutFit, collect, split_text, window_ids
from criticalkv.training.text import kjv_text


def texts() -> dict[str, str]:
    """The three texts by name: the King James text's held-out fifth, RULER's essays, the language reference."""
    return {
        "king-james-held-out": split_text(kjv_text().text)[1],
        "ruler-essays": load_haystack(),
        "language-reference": haystack_text(),
    }


def card_scorer(weights: SurrogateWeights, tokenizer) -> ReconstructionScorer:
    """The reconstruction scorer a surrogate was fitted to: its card's chunk size and sinks."""
    built = weights.card["training"]["reconstruction"]
    return ReconstructionScorer(chunk_size=built["chunk_size"], tokenizer=tokenizer, sinks=built["sinks"])


def measured(
    model: torch.nn.Module,
    tokenizer,
    maps: dict[str, SurrogateWeights],
    texts: dict[str, str],
    scorer: ReconstructionScorer,
    windows: int,
    tokens: int,
    budget: float,
    seed: int,
) -> dict[str, dict[str, dict]]:
    """text -> map -> ``HeldOutFit.figures`` (Spearman, per-head kept-set overlap at ``budget``, that overlap across
    layers, per layer), every map measured on the same ``windows`` seeded windows of each text (one reconstruction
    pass a window)."""
    report: dict[str, dict[str, dict]] = {}
    with step_progress("surrogate fit per text", windows * len(texts)) as advance:
        for name, text in texts.items():
            fits = {label: HeldOutFit() for label in maps}
            generator = torch.Generator().manual_seed(seed)
            for index, ids in enumerate(window_ids(tokenizer, text, windows, tokens, generator)):
                samples = collect(model, ids, scorer)
                for label, weights in maps.items():
                    fits[label].add(samples, weights, budget)
                advance(f"{name} window {index + 1}/{windows}")
            report[name] = {label: fit.figures(budget) for label, fit in fits.items()}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="a preset with a shipped surrogate")
    parser.add_argument("--windows", type=int, default=3, help="windows per text")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dtype", default="float32", help="the model's dtype (the surrogates are fitted in float32)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=Path("results/surrogate_domains.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_model(args.model, dtype=args.dtype)
    weights = shipped_for(model)
    training = weights.card["training"]
    tokens, budget = training["tokens_per_window"], weights.card["held_out_fit"]["budget"]
    scorer = card_scorer(weights, tokenizer)
    fits = measured(model, tokenizer, {"shipped": weights}, texts(), scorer, args.windows, tokens, budget, args.seed)
    report = {
        "command": "python benchmarks/surrogate_domains.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "model": args.model,
        "tokens_per_window": tokens,
        "card_held_out_fit": {k: weights.card["held_out_fit"][k] for k in ("mean_spearman", "mean_overlap")},
        "texts": {
            name: {k: row["shipped"][k] for k in ("mean_spearman", "mean_overlap", "cross_layer_overlap", "per_layer")}
            for name, row in fits.items()
        },
    }
    for name, row in report["texts"].items():
        print(
            f"{name:22s} Spearman {row['mean_spearman']:.3f}  overlap at {budget} {row['mean_overlap']:.3f}  "
            f"across layers {row['cross_layer_overlap']:.3f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
