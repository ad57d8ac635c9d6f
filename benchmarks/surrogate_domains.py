"""What the surrogate benchmarks measure on (``surrogate_lengths.py``): the texts, the reconstruction scorer a map
was fitted to, and the held-out figures of several maps on the same seeded windows.

The surrogate of each preset is fitted on the King James text (``criticalkv train-scorer``); the evaluation
haystacks are other prose: RULER's essays (``eval ruler``) and the Python language reference (``eval facts``).
Windows are prefilled under the reconstruction scorer the surrogate was fitted to (the card's chunk size and
sinks) and each map is measured as ``train-scorer`` measures it on its held-out windows: per layer the rank
correlation with the true scores and the share of the true 20% best entries it keeps (means over layers and heads),
and that share over every layer at once (the cross-layer presets' contest). King James windows come from the
held-out last fifth, so no window was trained on; windows of the haystacks measure the fit only (nothing is fitted
on them).
"""

from __future__ import annotations

import torch

from criticalkv.eval.facts import haystack_text
from criticalkv.eval.needle import load_haystack
from criticalkv.progress import step_progress
from criticalkv.scorers.reconstruct import ReconstructionScorer
from criticalkv.scorers.surrogate import SurrogateWeights
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
