"""Does a surrogate of the reconstruction scorer rank entries as well at every context length, and on every text?

``criticalkv train-scorer`` fits one map per context length of its ``--lengths`` (the card's ``training.lengths``)
and mixes the two around a context's length. This measures the shipped maps, and any maps given with ``--map``
(other fits of the same model), on seeded windows of several lengths of up to three texts (``texts``):
the King James text's held-out fifth (the training text's kind), RULER's essays and the language reference that
``eval facts`` hides its facts in (evaluation haystacks, measured only), as ``train-scorer`` measures its held-out
windows, under the reconstruction scorer the map was fitted to (the card's chunk size and sinks): per layer the rank
correlation with the true scores and the share of the true 20% best entries kept (means over layers and heads), and
that share over every layer at once (the cross-layer presets' contest). King James windows come from the held-out
last fifth, so no window was trained on; nothing is fitted on the haystacks.

    python benchmarks/surrogate_lengths.py --model smollm2-135m --lengths 512,1024,2048,4096 --windows 2 \
        --threads 1 --out results/surrogate_lengths_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
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

FIGURES = ("mean_spearman", "mean_overlap", "cross_layer_overlap")


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


def by_length(
    model: torch.nn.Module,
    tokenizer,
    maps: dict[str, SurrogateWeights],
    texts: dict[str, str],
    scorer: ReconstructionScorer,
    lengths: list[int],
    windows: int,
    budget: float,
    seed: int,
) -> dict[str, dict[str, dict[str, dict]]]:
    """length -> text -> map -> its mean figures (``FIGURES``) on ``windows`` seeded windows of that length, every
    map on the same windows; a progress line per length as it is measured."""
    report: dict[str, dict[str, dict[str, dict]]] = {}
    for length in lengths:
        fits = measured(model, tokenizer, maps, texts, scorer, windows, length, budget, seed)
        report[str(length)] = {
            text: {label: {k: fit[k] for k in FIGURES} for label, fit in row.items()} for text, row in fits.items()
        }
        for text, row in report[str(length)].items():
            for label, fit in row.items():
                print(
                    f"{length:6d} {text:20s} {label:30s} Spearman {fit['mean_spearman']:.3f}  "
                    f"overlap {fit['mean_overlap']:.3f}  across layers {fit['cross_layer_overlap']:.3f}",
                    flush=True,
                )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="a preset with a shipped surrogate")
    parser.add_argument("--lengths", default="512,1024,2048,4096", help="comma-separated window lengths (tokens)")
    parser.add_argument("--map", type=Path, action="append", default=[], help="another fit of the model (repeatable)")
    parser.add_argument("--windows", type=int, default=2, help="windows per text and length")
    parser.add_argument(
        "--texts",
        default="king-james-held-out,ruler-essays,language-reference",
        help="comma-separated texts to measure on",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dtype", default="float32", help="the model's dtype (the surrogates are fitted in float32)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=Path("results/surrogate_lengths.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_model(args.model, dtype=args.dtype)
    shipped = shipped_for(model)
    maps = {"shipped": shipped}  # found by the model's fingerprint: each other map must carry the same
    for path in args.map:
        maps[path.name] = SurrogateWeights.load(path)
        maps[path.name].check(model, shipped.fingerprint)
    budget = shipped.card["held_out_fit"]["budget"]
    scorer = card_scorer(shipped, tokenizer)
    every = texts()
    unknown = sorted(set(args.texts.split(",")) - set(every))
    if unknown:
        raise SystemExit(f"--texts: unknown {', '.join(unknown)}; known: {', '.join(every)}")
    chosen = {name: every[name] for name in args.texts.split(",")}
    lengths = [int(n) for n in args.lengths.split(",")]
    report = {
        "command": shlex.join(["python", "benchmarks/surrogate_lengths.py", *sys.argv[1:]]),
        "model": args.model,
        "budget": budget,
        "maps": {label: list(w.lengths) for label, w in maps.items()},  # the lengths each was fitted at
        "lengths": by_length(model, tokenizer, maps, chosen, scorer, lengths, args.windows, budget, args.seed),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
